"""Data of the local lm-evaluation-harness tasks: jsonl files ``make install`` writes into ``assets/harness``
(tools/assets.py), read as lm-eval's ``custom_dataset`` so that the task files need no path of their own."""

from framework.harness import LOCAL_DATA


def load(file: str, **metadata):
    """The rows of ``assets/harness/FILE`` as the task's ``test`` split."""
    import datasets

    path = LOCAL_DATA / file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `make install` (or `python tools/assets.py assets`)")
    return datasets.DatasetDict({"test": datasets.Dataset.from_json(str(path))})

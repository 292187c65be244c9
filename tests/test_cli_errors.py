"""Bad input: one clear message naming the key or file, exit status 2, no traceback, nothing lost."""

import pytest

from conftest import synthetic_rows, tiny_args, write_csv
from framework.cli import main


def fails(capsys, args):
    """Run the CLI in-process; return its error message after checking the status."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err
    return err[err.index("error: "):]  # after any progress bars of the data loading


@pytest.fixture
def args(tiny_model, easy_data, tmp_path):
    return lambda *extra: tiny_args(tiny_model, easy_data, tmp_path / "out", *extra)


def test_missing_recipe_file_through_the_process(cli, tmp_path):
    proc = cli(["--config", str(tmp_path / "nope.yaml")], check=False)
    assert proc.returncode == 2
    assert "recipe file" in proc.stderr and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_keys_through_the_process(cli, args):
    proc = cli(args("optim.lr=-1", "train.batchsize=4"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "optim.lr: -1.0 is out of range" in proc.stderr and "did you mean 'train.batch_size'" in proc.stderr


def test_missing_data_file(capsys, args, tmp_path):
    err = fails(capsys, args(f"data.train_file={tmp_path / 'missing.csv'}"))
    assert "data.train_file" in err and "missing.csv does not exist" in err


def test_unknown_data_format(capsys, args, tmp_path):
    (tmp_path / "data.xlsx").write_text("hello\n")
    assert "cannot tell the format" in fails(capsys, args(f"data.train_file={tmp_path / 'data.xlsx'}"))


def test_column_not_in_data_names_the_columns(capsys, args):
    err = fails(capsys, args("data.text_column=review"))
    assert "data.text_column: column 'review' is not in" in err and "its columns are text, label" in err


def test_empty_after_filtering(capsys, args):
    err = fails(capsys, args("data.labels=[fresh,rotten]"))
    assert "has no usable rows" in err and "filtered out by the recipe" in err


def test_single_class(capsys, tiny_model, tmp_path):
    rows = [r for r in synthetic_rows(100, seed=2) if r["label"] == "pos"]
    data = write_csv(tmp_path / "one.csv", rows)
    err = fails(capsys, tiny_args(tiny_model, data, tmp_path / "out"))
    assert "has a single class" in err and "data.label_column 'label'" in err


def test_eval_labels_unseen_in_training(capsys, tiny_model, easy_data, tmp_path):
    data = write_csv(tmp_path / "eval.csv", [{"text": "a movie", "label": "meh"}, {"text": "good", "label": "pos"}])
    err = fails(capsys, tiny_args(tiny_model, easy_data, tmp_path / "out", f"data.eval_file={data}"))
    assert "labels ['meh']" in err


def test_too_little_data_for_one_step(capsys, args):
    assert "fewer than one optimizer step takes" in fails(capsys, args("train.batch_size=1000"))


def test_max_length_beyond_the_models_positions(capsys, args):
    err = fails(capsys, args("data.max_length=128", "data.padding=max_length"))  # the tiny model has 64 positions
    assert "data.max_length=128 is longer than the model takes (max_position_embeddings 64)" in err
    assert "data.max_length=64 or less" in err


def test_model_folder_missing(capsys, args, tmp_path):
    err = fails(capsys, args(f"model.name_or_path={tmp_path / 'no_model'}"))
    assert "model.name_or_path: folder" in err and "does not exist" in err


def test_model_folder_without_config(capsys, args, tmp_path):
    (tmp_path / "empty_model").mkdir()
    assert "has no config.json" in fails(capsys, args(f"model.name_or_path={tmp_path / 'empty_model'}"))


def test_hub_id_while_offline_says_how_to_use_a_local_folder(capsys, args, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    err = fails(capsys, args("model.name_or_path=bert-base-uncased"))
    assert "is unreachable" in err and "point it at a local folder" in err


def test_hub_dataset_while_offline(capsys, args, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    err = fails(capsys, args("data.train_file=null", "data.dataset=rotten_tomatoes"))
    assert "data.dataset" in err and "use data.train_file" in err

"""The real default recipe (pretrained MiniLM, Rotten Tomatoes) on a small sample learns clearly above
the majority class."""

import json

import numpy as np
import pytest

from helpers import ROOT, write_csv
from framework import run_data
from framework.recipe import load_config
from framework.tasks import get_task

RECIPE = ROOT / "recipes" / "text_classification.yaml"
SAMPLE = ["data.max_train_samples=1024", "data.max_eval_samples=512", "train.epochs=2", "optim.lr=1e-4"]


@pytest.mark.slow
def test_default_recipe_on_a_sample_beats_the_majority_class(cli, tmp_path, monkeypatch):
    if not (ROOT / "assets" / "all-MiniLM-L6-v2").is_dir():
        pytest.fail("assets/ is missing: run `make install` (make test does it)")
    out = tmp_path / "default"
    cli([*SAMPLE, f"output_dir={out}"], launch="cpu.yaml")
    accuracy = json.loads((out / "summary.json").read_text())["eval"]["accuracy"]

    monkeypatch.chdir(ROOT)  # the recipe's paths are relative to the repository root
    cfg = load_config(RECIPE, SAMPLE)
    data, task = run_data.from_recipe(cfg), get_task(cfg.task)
    model, tokenizer = task.load(cfg, *data.read(task))
    data.prepare_rows(task, tokenizer, model)
    labels = np.array(data.eval_ds["labels"])
    majority = np.bincount(labels).max() / len(labels)
    assert accuracy >= majority + 0.1, (accuracy, majority)


def test_the_default_recipe_is_a_template_for_a_users_own_file(cli, tmp_path):
    """`recipes/run.py` with no --config, on a file of other columns and other labels: nothing
    dataset-specific (such as a label filter) is inherited from the default recipe."""
    rows = [{"review": f"review number {i} of the film", "sentiment": ("pos", "neg", "meh")[i % 3]} for i in range(90)]
    data = write_csv(tmp_path / "mine.csv", rows)
    proc = cli(["--dry-run", f"data.train_file={data}", "data.text_column=review", "data.label_column=sentiment",
                f"output_dir={tmp_path / 'out'}"])
    assert "train_examples: 81" in proc.stdout and "eval_examples: 9" in proc.stdout  # 90 rows, 10% held out
    assert "parameters: 22.7" in proc.stdout  # the default recipe's MiniLM, with a head for the 3 labels

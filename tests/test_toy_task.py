"""A task from outside framework/ (tests/toy_task.py: regression of a number from a text, with its own ``toy:``
section) trained through the real CLI, named by its file: ``task: tests/toy_task.py:ToyTask``. Nothing in
framework/ knows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (TOY, assert_bitwise_equal_models, crash_then_resume, losses_by_step, tiny_args, toy_scores,
                     train_losses, write_csv)
from in_process import run_main


@pytest.fixture(autouse=True)
def own_registry(toy_registry):
    """The toy registers itself for its test only (conftest.py's toy_registry)."""


@pytest.fixture(scope="module")
def scores(tmp_path_factory) -> Path:
    return write_csv(tmp_path_factory.mktemp("toy") / "scores.csv", toy_scores(320))


def test_the_toy_task_trains_through_the_cli(tiny_model, scores, tmp_path, hf_home):
    out = tmp_path / "run"
    assert run_main(tiny_args(tiny_model, scores, out, TOY, "toy.scale=2", "train.epochs=4",
                              "report.enabled=true"), hf_home) == 0
    losses = train_losses(out)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    summary = json.loads((out / "summary.json").read_text())
    # Better than the best constant guess: targets 0, 2, 4, 6 equally often, whose mean (3) is 2 off on average.
    assert summary["eval"]["mae"] < 2.0 and summary["eval"]["examples"] == 32
    assert "toy:\n  target_column: score\n  scale: 2.0\n" in (out / "config.yaml").read_text()
    assert "<h2>Toy regression (eval)</h2>" in (out / "report.html").read_text()


def test_the_toy_task_resumes_bitwise_after_a_kill(tiny_model, scores, tmp_path, hf_home):
    run = {name: tiny_args(tiny_model, scores, tmp_path / name, TOY, "train.max_steps=12", "checkpoint.every_steps=4")
           for name in ("whole", "resumed")}
    assert run_main(run["whole"], hf_home) == 0
    assert "step_8" in crash_then_resume(hf_home, run["resumed"], kill_at_micro=10).stdout
    assert_bitwise_equal_models(tmp_path / "whole", tmp_path / "resumed")
    assert losses_by_step(tmp_path / "whole") == losses_by_step(tmp_path / "resumed")


def test_a_bad_toy_option_exits_2_naming_it(tiny_model, scores, tmp_path, hf_home, capsys):
    assert run_main(tiny_args(tiny_model, scores, tmp_path / "a", TOY, "toy.scale=0"), hf_home) == 2
    assert "toy.scale: 0.0 is out of range; it must be > 0.0" in capsys.readouterr().err
    assert run_main(tiny_args(tiny_model, scores, tmp_path / "b", TOY, "toy.scale=5000"), hf_home) == 2
    assert "toy.scale: 5000.0 is too large for a toy" in capsys.readouterr().err
    assert run_main(tiny_args(tiny_model, scores, tmp_path / "c", TOY, "toy.scal=2"), hf_home) == 2
    assert "unknown key 'toy.scal'; did you mean 'toy.scale'?" in capsys.readouterr().err


def test_the_toy_dry_run_plans_without_training(tiny_model, scores, tmp_path, hf_home, capsys):
    out = tmp_path / "dry"
    assert run_main([*tiny_args(tiny_model, scores, out, TOY), "--dry-run"], hf_home) == 0
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("spec, says", [
    ("tests/nothing.py:ToyTask", "tests/nothing.py does not exist"),
    ("tests/toy_task.py:NoSuchTask", "has no Task subclass named 'NoSuchTask'"),
    ("tests/conftest.py:ROOT", "has no Task subclass named 'ROOT'"),
    ("no_such_package.module:Task", "importing no_such_package.module failed"),
])
def test_a_task_that_cannot_be_loaded_exits_2_naming_task(tiny_model, scores, tmp_path, hf_home, capsys, spec, says):
    assert run_main(tiny_args(tiny_model, scores, tmp_path / "x", f"task={spec}"), hf_home) == 2
    err = capsys.readouterr().err
    assert f"task: '{spec}': " in err and says in err and "task: path/to/file.py:ClassName" in err, err

"""Checkpoints never lose work: exact resume after SIGKILL (2 processes, inside an accumulation window; one
process: tests/test_task_contract.py), SIGTERM saves and exits 3, damaged checkpoints are skipped, keep_last, best model (bitwise the best
step's weights, either direction of the metric), early stopping, a checkpoint at every epoch end, and
checkpoint.resume=never."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import (KILL_SCRIPT, ROOT, assert_bitwise_equal_models, checkpoint_states, crash_then_resume,
                     environment, losses_by_step, read_metrics, tiny_args)
from in_process import run_captured, run_main, train_ok

# 16 steps of 5 per epoch (40 rows, 8 a step): the kill points below are mid-epoch in the third epoch, after step
# 10's checkpoint. On the CPU wherever the tests run: bitwise comparisons need deterministic kernels (a GPU's are not,
# by default).
COMMON = ["backend=cpu", "data.max_train_samples=40", "train.max_steps=16", "train.log_every=2",
          "checkpoint.every_steps=5", "checkpoint.keep_last=3"]


@pytest.mark.parametrize("case,extra,kill_at,launch", [
    ("accumulation", ["train.batch_size=4", "train.gradient_accumulation_steps=2"], 2 * 13 + 1, None),
    pytest.param("two_processes", ["train.batch_size=4"], 13, "cpu_ddp.yaml", marks=pytest.mark.multiprocess),
], ids=lambda v: v if isinstance(v, str) else None)
def test_exact_resume_after_sigkill(cli, tiny_model, easy_data, hf_home, tmp_path, case, extra, kill_at, launch):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    if launch:
        cli(tiny_args(tiny_model, easy_data, whole, *COMMON, *extra), launch=launch)
    else:
        train_ok(tiny_args(tiny_model, easy_data, whole, *COMMON, *extra), hf_home)
    proc = crash_then_resume(hf_home, tiny_args(tiny_model, easy_data, resumed, *COMMON, *extra), kill_at, launch)
    assert "resuming from" in proc.stdout and "step_10" in proc.stdout
    assert_bitwise_equal_models(whole, resumed)
    expected, got = losses_by_step(whole), losses_by_step(resumed)
    assert got == expected  # every logged loss, before and after the resume point, to the last bit
    assert json.loads((resumed / "summary.json").read_text())["train"]["resumed_from_step"] == 10


def test_sigterm_saves_exits_3_and_resumes_to_the_same_weights(tiny_model, easy_data, hf_home, tmp_path):
    """SIGTERM at micro-batch 13 (mid-epoch, between checkpoints): the step ends, is saved, the run exits 3, and the
    same command ends where the uninterrupted run does. The signal's arrival at any other moment: test_signals.py."""
    args = ["backend=cpu", "data.max_train_samples=40", "train.max_steps=24", "train.log_every=1",
            "checkpoint.every_steps=10"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    train_ok(tiny_args(tiny_model, easy_data, whole, *args), hf_home)
    proc = subprocess.run([sys.executable, str(KILL_SCRIPT), *tiny_args(tiny_model, easy_data, stopped, *args)],
                          cwd=ROOT, env=environment(hf_home, KILL_AT_MICRO="13", KILL_SIGNAL="SIGTERM"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "preempted" in proc.stderr and "Traceback" not in proc.stderr
    assert max(r["step"] for r in read_metrics(stopped)) == 13
    assert (stopped / "checkpoints" / "step_13" / "trainer_state.json").is_file()
    train_ok(tiny_args(tiny_model, easy_data, stopped, *args), hf_home)
    assert_bitwise_equal_models(whole, stopped)
    assert losses_by_step(stopped) == losses_by_step(whole)


@pytest.fixture(scope="module")
def whole(tmp_path_factory, tiny_model, easy_data, hf_home) -> Path:
    """The uninterrupted run of COMMON, which the damaged checkpoints' runs must end with."""
    out = tmp_path_factory.mktemp("whole") / "out"
    train_ok(tiny_args(tiny_model, easy_data, out, *COMMON), hf_home)
    return out


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_checkpoint_is_skipped_with_a_warning(tiny_model, easy_data, hf_home, tmp_path, whole, damage):
    out = tmp_path / "out"
    args = tiny_args(tiny_model, easy_data, out, *COMMON)
    proc = subprocess.run([sys.executable, str(KILL_SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          env=environment(hf_home, KILL_AT_MICRO="13"), timeout=600)
    assert proc.returncode != 0
    victim = out / "checkpoints" / "step_10" / "states" / "__0_0.distcp"  # the weights and Adam's moments
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
    else:
        victim.unlink()
    resumed = run_captured(args, hf_home)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipping checkpoint {out / 'checkpoints' / 'step_10'}: states/__0_0.distcp is" in resumed.stdout
    assert "resuming from" in resumed.stdout and "step_5" in resumed.stdout
    assert_bitwise_equal_models(whole, out)


def test_keep_last_keeps_the_newest_and_the_best(tiny_model, easy_data, hf_home, tmp_path):
    out = tmp_path / "out"
    train_ok(tiny_args(tiny_model, easy_data, out, "train.max_steps=40", "checkpoint.every_steps=5",
                       "checkpoint.keep_last=2", "eval.every_steps=5", "eval.metric=loss"), hf_home)
    summary = json.loads((out / "summary.json").read_text())
    best = summary["best"]["step"]
    kept = {p.name for p in (out / "checkpoints").iterdir()}
    assert kept == {"step_35", "step_40", f"step_{best}"}
    assert not any(p.name.startswith(".tmp") for p in out.rglob("*"))


def test_early_stopping_and_best_model(tiny_model, easy_data, hf_home, tmp_path):
    out = tmp_path / "out"
    # A learning rate this small leaves the accuracy where it starts: the metric stalls after the first eval.
    train_ok(tiny_args(tiny_model, easy_data, out, "optim.lr=1e-12", "train.max_steps=100", "eval.every_steps=5",
                       "eval.metric=accuracy", "train.early_stopping_patience=2"), hf_home)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train"]["stopped_early"] and summary["train"]["steps"] == 15
    assert summary["best"] == {"step": 5, "metric": "accuracy", "value": summary["best"]["value"]}
    assert [r["step"] for r in read_metrics(out) if "eval_accuracy" in r] == [5, 10, 15]
    assert (out / "model" / "model.safetensors").is_file()


def test_resume_refuses_a_finished_run(cli, tiny_model, easy_data, hf_home, tmp_path):
    out = tmp_path / "out"
    train_ok(tiny_args(tiny_model, easy_data, out, "train.max_steps=10", "checkpoint.every_steps=5"), hf_home)
    proc = cli(tiny_args(tiny_model, easy_data, out, "train.max_steps=10", "checkpoint.every_steps=5"), check=False)
    assert proc.returncode == 2 and "already finished" in proc.stderr


def load_weights(path: Path) -> dict:
    """A model's tensors from model/ (save_pretrained) or a checkpoint folder (its states/)."""
    return load_file(path / "model.safetensors") if path.name == "model" else checkpoint_states(path)["model"]


@pytest.mark.parametrize("greater_is_better", [True, False], ids=["greater_is_better", "lower_is_better"])
def test_model_holds_the_best_evaluations_weights(tiny_model, easy_data, hf_home, tmp_path, greater_is_better):
    """model/ is bitwise the checkpoint saved at the best evaluation's step, chosen in the direction asked
    for: with eval.metric=loss and greater_is_better=true, the worst loss. At this learning rate the eval
    loss jumps above ln 2 at first and then comes down, so the worst is an early step, not the last."""
    out = tmp_path / "out"
    assert run_main(tiny_args(tiny_model, easy_data, out, "backend=cpu", "optim.lr=1e-2", "train.max_steps=20",
                              "train.log_every=5", "eval.every_steps=5", "eval.metric=loss",
                              f"eval.greater_is_better={str(greater_is_better).lower()}",
                              "checkpoint.every_steps=5", "checkpoint.keep_last=1"), hf_home) == 0
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r}
    assert list(evals) == [5, 10, 15, 20]
    assert len(set(evals.values())) == 4, evals  # no ties: the best is unambiguous
    best = (max if greater_is_better else min)(evals, key=evals.get)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"] == {"step": best, "metric": "loss", "value": evals[best]}
    if greater_is_better:
        assert best != 20, evals
    # keep_last=1 keeps the newest checkpoint and the best step's.
    assert {p.name for p in (out / "checkpoints").iterdir()} == {f"step_{best}", "step_20"}
    model, at_best = load_weights(out / "model"), load_weights(out / "checkpoints" / f"step_{best}")
    last = load_weights(out / "checkpoints" / "step_20")
    assert model.keys() == at_best.keys() and len(model) > 0
    for name in model:
        assert torch.equal(model[name], at_best[name]), name
    if best != 20:
        assert not all(torch.equal(model[name], last[name]) for name in model)  # not the last step's weights


@pytest.mark.parametrize("epochs,saved", [("3", [5, 10, 15]), ("2.5", [5, 10])])
def test_every_epoch_saves_at_each_epoch_end(tiny_model, easy_data, hf_home, tmp_path, epochs, saved):
    """40 training rows in batches of 8: an epoch is 5 steps. 2.5 epochs train 13 steps and end inside the
    third epoch, which gets no epoch-end checkpoint."""
    out = tmp_path / "out"
    assert run_main(tiny_args(tiny_model, easy_data, out, "backend=cpu", "data.max_train_samples=40",
                              f"train.epochs={epochs}", "checkpoint.every_epoch=true", "checkpoint.keep_last=10"),
                    hf_home) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train"]["steps"] == {"3": 15, "2.5": 13}[epochs]
    assert sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").iterdir()) == saved
    for step in saved:
        state = json.loads((out / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())["state"]
        assert (state["step"], state["epoch"], state["epoch_step"]) == (step, step // 5, 0)


def test_resume_never_with_overwrite_starts_over(capsys, tiny_model, easy_data, hf_home, tmp_path):
    """An unfinished run of the same recipe (killed after its step 4 checkpoint) is resumed even with
    overwrite=true; checkpoint.resume=never starts from step 1 instead and logs a fresh run's losses."""
    args = ["backend=cpu", "train.max_steps=8", "checkpoint.every_steps=4", "checkpoint.keep_last=5"]
    fresh, out, control = tmp_path / "fresh", tmp_path / "out", tmp_path / "control"
    assert run_main(tiny_args(tiny_model, easy_data, fresh, *args), hf_home) == 0
    assert run_main(tiny_args(tiny_model, easy_data, out, *args), hf_home) == 0
    # What a kill between the step 4 and step 8 checkpoints leaves behind.
    shutil.rmtree(out / "checkpoints" / "step_8")
    (out / "summary.json").unlink()
    shutil.copytree(out, control)
    capsys.readouterr()

    # Without resume=never the same command resumes, overwrite or not: there is something to resume.
    assert run_main(tiny_args(tiny_model, easy_data, control, *args, "overwrite=true"), hf_home) == 0
    assert "resuming from" in capsys.readouterr().out
    assert json.loads((control / "summary.json").read_text())["train"]["resumed_from_step"] == 4

    # resume=never without overwrite refuses and leaves the unfinished run as it was.
    assert run_main(tiny_args(tiny_model, easy_data, out, *args, "checkpoint.resume=never"), hf_home) == 2
    err = capsys.readouterr().err
    assert "already holds another run's outputs" in err and "overwrite=true" in err
    assert (out / "checkpoints" / "step_4").is_dir() and not (out / "summary.json").exists()

    assert run_main(tiny_args(tiny_model, easy_data, out, *args, "checkpoint.resume=never", "overwrite=true"),
                    hf_home) == 0
    assert "resuming from" not in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train"]["resumed_from_step"] is None and summary["train"]["steps"] == 8
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, 9))
    assert losses_by_step(out) == losses_by_step(fresh)
    assert_bitwise_equal_models(fresh, out)

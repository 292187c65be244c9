"""Faults during a run lose nothing: a run whose loss or weights stop being finite stops (exit 4) before writing
anything from them, and keeps every checkpoint saved before (one process or two). And the noise a run printed at
every checkpoint of a tied model is gone."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from helpers import lm_args, read_metrics
from in_process import run_captured


def finite_checkpoints(out):
    """The step of each checkpoint, and whether every weight it holds is finite."""
    found = {}
    for folder in sorted((out / "checkpoints").glob("step_*")):
        weights = [t for f in folder.rglob("*.safetensors") for t in load_file(f).values()]
        found[int(folder.name.split("_")[1])] = bool(weights) and all(torch.isfinite(t).all() for t in weights)
    return found


def test_a_diverging_run_stops_and_keeps_its_finite_checkpoints(hf_home, word_tokenizer, corpus, tmp_path):
    """The issue's run: lr 1e4 on a tiny causal LM, a checkpoint every 2 steps, the last 2 kept. The loss turns
    NaN within a few steps: the run stops at that log step with status 4 and one line naming the step and value,
    writes no model/ nor summary, and the checkpoints left are finite ones from before (keep_last never rotated
    them out for a NaN one). The same command resumes the last of them and stops again the same way."""
    out = tmp_path / "out"
    args = lm_args(word_tokenizer, corpus, out, "optim.lr=1e4", "train.max_steps=30", "checkpoint.every_steps=2",
                   "checkpoint.keep_last=2", "train.max_grad_norm=null")
    proc = run_captured(args, hf_home)
    assert proc.returncode == 4, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("diverged:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    stop = len(losses)
    assert not math.isfinite(losses[-1]) and all(math.isfinite(x) for x in losses[:-1]), losses
    assert f"the training loss is {losses[-1]} at step {stop}" in lines[0]
    print(lines[0], {"checkpoints kept (step: finite)": finite_checkpoints(out)})
    assert not (out / "model").exists() and not (out / "summary.json").exists()
    kept = finite_checkpoints(out)
    assert kept and all(kept.values()) and max(kept) < stop, (kept, stop)
    again = run_captured(args, hf_home)
    assert again.returncode == 4 and f"at step {stop}" in again.stderr and finite_checkpoints(out) == kept


@pytest.mark.multiprocess
def test_two_processes_stop_together_on_divergence(cli, word_tokenizer, corpus, tmp_path):
    """The loss read at a log step is summed over the processes, so both see the NaN at the same step and stop
    with status 4 (the launcher then exits 1), neither waiting for the other."""
    out = tmp_path / "out"
    args = lm_args(word_tokenizer, corpus, out, "optim.lr=1e4", "train.max_steps=30", "checkpoint.every_steps=2",
                   "checkpoint.keep_last=2", "train.max_grad_norm=null", "train.batch_size=2")
    proc = cli(args, launch="cpu_ddp.yaml", check=False, timeout=300)
    assert proc.returncode == 1 and proc.stderr.count("exitcode  : 4") >= 1, proc.stderr[-3000:]
    assert len([line for line in proc.stderr.splitlines() if line.startswith("diverged:")]) == 1
    assert not (out / "model").exists() and all(finite_checkpoints(out).values())


def test_checkpoints_of_a_tied_model_print_no_shared_tensor_warning(cli, word_tokenizer, corpus, tmp_path):
    """accelerate warns at every save that it removed the tied output layer's shared tensor; the framework drops
    that line (the weight is saved once and tied again on load)."""
    proc = cli(lm_args(word_tokenizer, corpus, tmp_path / "out", "train.max_steps=4", "checkpoint.every_steps=2"))
    assert len(list((tmp_path / "out" / "checkpoints").glob("step_*"))) == 2
    assert "Removed shared tensor" not in proc.stdout + proc.stderr

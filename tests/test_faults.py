"""Faults during a run lose nothing: a run whose loss or weights stop being finite stops (exit 4) before writing
anything from them, and keeps every checkpoint saved before (one process or two). And the noise a run printed at
every checkpoint of a tied model is gone."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import fault_injection
import pytest
import torch
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from framework import checkpoint
from helpers import (ROOT, TOY, assert_bitwise_equal_models, checkpoint_states, environment, finite_checkpoints,
                     lm_args, read_metrics, summary, tiny_args, toy_scores, toy_task_registered, train_losses, write_csv)
from in_process import run_captured, run_main


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


def test_checkpoints_of_a_tied_model_print_no_shared_tensor_warning(cli, word_tokenizer, corpus, tmp_path):
    """accelerate warns at every save that it removed the tied output layer's shared tensor; the framework drops
    that line (the weight is saved once and tied again on load)."""
    proc = cli(lm_args(word_tokenizer, corpus, tmp_path / "out", "train.max_steps=4", "checkpoint.every_steps=2"))
    assert len(list((tmp_path / "out" / "checkpoints").glob("step_*"))) == 2
    assert "Removed shared tensor" not in proc.stdout + proc.stderr


# ---------------------------------------------------------------- the fault-injection harness

STEPS = 10  # one epoch of the harness's 80 training rows, 8 a step; a checkpoint every 2 steps
CASES = int(os.environ.get("FAULT_CASES", "0"))  # make faults: this many random cases (make test: a fixed few)
FAULT_SCRIPT = ROOT / "tests" / "scripts" / "fault_at.py"
# What each fault may end with: 0 where it struck after the last write it could break (a disk filled after
# everything fit), 3 or 143 for SIGTERM (a checkpoint to resume from, or none yet), 5 for a failed write.
OUTCOMES = {"SIGKILL": (-9,), "SIGTERM": (3, 143), "damage": (3, 143), "fill": (0, 5), "readonly": (5,),
            "vanish": (5,)}
LINES = {3: ("preempted:", "stopped by"), 143: ("stopped by",), 4: ("diverged:",), 5: ("write failed:",)}
CALLS = {"micro": STEPS, "log": STEPS + 1, "save": STEPS // 2, "eval": 1}  # each point's calls in the run


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # SIGKILL, SIGTERM, fill, readonly, vanish; damage (SIGTERM, then a byte of the newest checkpoint
    # changed); nan (a row whose target is infinite, so one step's loss and gradients are not finite)
    point: str = "micro"  # fault_injection.POINTS
    n: int = 1  # the point's n-th call
    leave: int = 0  # fill: the bytes left free
    keep_last: int = 2
    row: int = 0  # nan: the row made infinite; damage: which file of the checkpoint (and where in it) is damaged
    policy: str = "stop"  # nan: train.on_nonfinite

    @property
    def spec(self) -> str:
        kind = {"fill": f"fill={self.leave}", "damage": "SIGTERM"}.get(self.kind, self.kind)
        return f"{kind}@{self.point}:{self.n}"


@st.composite
def faults(draw) -> Fault:
    kind = draw(st.sampled_from(["SIGKILL", "SIGTERM", "damage", "fill", "readonly", "vanish", "nan"]))
    point = draw(st.sampled_from(sorted(CALLS)))
    return Fault(kind, point, draw(st.integers(1, CALLS[point])), draw(st.integers(0, 400_000)),
                 draw(st.sampled_from([1, 2])), draw(st.integers(0, 79)), draw(st.sampled_from(["stop", "skip"])))


@pytest.fixture(scope="module")
def harness(tmp_path_factory, tiny_model, hf_home):
    """The toy regression task (tests/toy_task.py) on 80 rows for 10 steps: its data, and its uninterrupted run."""
    folder = tmp_path_factory.mktemp("harness")
    rows = toy_scores(96, seed=11)
    files = {"train": write_csv(folder / "train.csv", rows[:80]), "eval": write_csv(folder / "eval.csv", rows[80:])}

    def args(out: Path, *extra: str, train: Path = files["train"]) -> list:
        return tiny_args(tiny_model, train, out, TOY, f"data.eval_file={files['eval']}", f"train.max_steps={STEPS}",
                         "checkpoint.every_steps=2", *extra)

    def poisoned(row: int) -> Path:
        bad = [dict(r, score="inf") if i == row else r for i, r in enumerate(rows[:80])]
        return write_csv(folder / f"inf_{row}.csv", bad)

    with toy_task_registered():
        assert run_main(args(folder / "reference"), hf_home) == 0
    return SimpleNamespace(args=args, poisoned=poisoned, reference=folder / "reference")


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """A 16 MB filesystem of the harness's own, to fill up and turn read-only."""
    if not fault_injection.can_mount():
        pytest.skip("the fault harness mounts a small tmpfs (a disk that really fills up): run it as root")
    with fault_injection.small_disk(tmp_path_factory.mktemp("disk"), 16 << 20) as folder:
        yield folder


def no_partial_writes(out: Path) -> None:
    for folder in (out, out / "checkpoints"):
        left = [p.name for p in folder.glob(".*") if p.name.startswith((".tmp_", ".old_"))] if folder.is_dir() else []
        assert not left, left


def run_with_fault(fault: Fault, args: list, disk: Path, out: Path, hf_home: Path):
    """The run with ``fault`` injected: in this process, or for SIGKILL in one of its own. Returns the finished
    process and the newest checkpoint saved before the fault (in this process only)."""
    if fault.kind == "SIGKILL":
        env = environment(hf_home, FAULT=fault.spec, FAULT_DISK=str(disk))
        return subprocess.run([sys.executable, str(FAULT_SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300), None
    saved = []
    with pytest.MonkeyPatch.context() as patch:
        if fault.kind != "nan":
            fault_injection.install(fault.spec, disk, out, patch.setattr)
        save = checkpoint.save
        patch.setattr(checkpoint, "save", lambda *a, **k: saved.append(save(*a, **k)) or saved[-1])
        return run_captured(args, hf_home), (saved[-1] if saved else None)


@settings(max_examples=CASES or 3, derandomize=not CASES, database=None, deadline=None, print_blob=True,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow])
@given(fault=faults())
@example(fault=Fault("SIGKILL", "save", 3))  # inside a checkpoint's write
@example(fault=Fault("SIGTERM", "micro", 5))
@example(fault=Fault("damage", "log", 7, row=3))
@example(fault=Fault("fill", "save", 2, leave=50_000, keep_last=1))  # the disk fills mid-checkpoint
@example(fault=Fault("fill", "eval", 1, leave=20_000))  # ... while writing model/
@example(fault=Fault("readonly", "log", 4))
@example(fault=Fault("readonly", "save", 5))  # inside the last checkpoint's write: its partial write stays
@example(fault=Fault("vanish", "micro", 3))
@example(fault=Fault("nan", row=37))
@example(fault=Fault("nan", row=70, policy="skip"))
def test_a_fault_loses_nothing_and_the_same_command_ends_as_if_uninterrupted(fault, harness, disk, hf_home):
    """The fault-injection harness. A fault at a random point: killed (SIGKILL, SIGTERM; inside a checkpoint write
    too), the disk filling at a random byte, the output folder read-only or gone, the newest checkpoint damaged, a
    NaN at a random step (the row with an infinite target lands where the shuffle puts it). The property: the run
    ends with its documented status and one line, no traceback; every checkpoint left verifies and none saved
    before the fault is lost; no partial write is left. The same command afterwards (space and writes restored)
    ends bitwise equal to the uninterrupted run, its logged losses too; a diverging run stops again the same way,
    or with train.on_nonfinite=skip finishes with the step skipped."""
    out = disk / "run"
    fault_injection.restore(disk)  # first: a failed case may have left it read-only
    shutil.rmtree(out, ignore_errors=True)
    extra = [f"checkpoint.keep_last={fault.keep_last}"]
    if fault.kind == "nan":
        extra += [f"train.on_nonfinite={fault.policy}", "train.log_every=1"]
    args = harness.args(out, *extra, **({"train": harness.poisoned(fault.row)} if fault.kind == "nan" else {}))
    with toy_task_registered():
        proc, newest = run_with_fault(fault, args, disk, out, hf_home)
        event(f"{fault.kind} -> {proc.returncode}")
        expected = OUTCOMES.get(fault.kind) or ((4,) if fault.policy == "stop" else (0,))
        assert proc.returncode in expected and "Traceback" not in proc.stderr, (fault, proc.stderr[-3000:])
        prefixes = LINES.get(proc.returncode)
        lines = [line for line in proc.stderr.splitlines() if prefixes and line.startswith(prefixes)]
        assert len(lines) == (prefixes is not None), (fault, proc.stderr[-3000:])
        for folder in (out / "checkpoints").glob("step_*"):
            assert checkpoint.verify(folder) is None, folder
        if newest is not None and fault.kind != "vanish":  # the user's own removal aside
            assert checkpoint.verify(newest) is None, (fault, newest)
        if fault.kind == "readonly" and "could not be removed" in lines[0]:
            pass  # a read-only filesystem keeps the partial write; the line says so and the next run removes it
        elif fault.kind != "SIGKILL":
            no_partial_writes(out)
        fault_injection.restore(disk)
        if fault.kind == "damage" and proc.returncode == 3:
            damage_newest(out, fault.row)
        # A fault after every write it could break (a disk filled when all fitted): the run is done.
        again = run_captured(args, hf_home) if proc.returncode else proc
    no_partial_writes(out)
    if fault.kind == "nan" and fault.policy == "stop":
        assert again.returncode == 4 and lines[0].split(".")[0] in again.stderr, again.stderr[-3000:]
        return
    assert again.returncode == 0, (fault, again.stderr[-3000:])
    if fault.kind == "nan":
        assert summary(out)["train"]["skipped_steps"] == 1 and all(math.isfinite(x) for x in train_losses(out))
        return
    if fault.kind == "damage" and proc.returncode == 3:
        assert "skipping checkpoint" in again.stdout + again.stderr
    assert_bitwise_equal_models(harness.reference, out)
    assert read_metrics(out) and [(r["step"], r.get("loss")) for r in read_metrics(out)] == \
        [(r["step"], r.get("loss")) for r in read_metrics(harness.reference)]


def damage_newest(out: Path, seed: int) -> None:
    """Change one byte of one file of the newest checkpoint (which file and where: from ``seed``)."""
    newest = max((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    files = sorted(p for p in newest.rglob("*") if p.is_file() and p.name != checkpoint.STATE_FILE)
    file = files[seed % len(files)]
    data = bytearray(file.read_bytes())
    data[(seed * 7919) % len(data)] ^= 0xFF
    file.write_bytes(bytes(data))


# ---------------------------------------------------------------- train.on_nonfinite, one process and two


def skipped_step(output: str) -> int:
    lines = [line for line in output.splitlines() if line.startswith("warning: step ") and " skipped" in line]
    assert len(lines) == 1, output[-3000:]
    return int(lines[0].split()[2])


def test_a_skipped_step_leaves_the_weights_and_the_optimizer_state_as_they_were(harness, hf_home, tmp_path):
    """train.on_nonfinite=skip: the step whose batch holds the infinite target changes nothing (the weights and
    Adam's moments and step count at its checkpoint equal the step before's, bitwise); the run goes on, its logged
    losses finite, and summary.json counts the skip. Then every row infinite: max_skipped_steps (2) in a row stop
    the run with status 4, naming the step."""
    out = tmp_path / "skip"
    with toy_task_registered():
        proc = run_captured(harness.args(out, "train.on_nonfinite=skip", "checkpoint.every_steps=1",
                                         f"checkpoint.keep_last={STEPS}", train=harness.poisoned(40)), hf_home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = skipped_step(proc.stdout + proc.stderr)
    assert summary(out)["train"]["skipped_steps"] == 1 and all(math.isfinite(x) for x in train_losses(out))
    states = {at: checkpoint_states(out / "checkpoints" / f"step_{at}") for at in (step - 1, step, step + 1) if at}
    moments = {at: {k: v for k, v in state["optimizer"].items() if k.startswith("state.")}
               for at, state in states.items()}
    if step == 1:  # no update yet: Adam holds no state
        assert not moments[1]
    else:
        for before, at in ((states[step - 1]["model"], states[step]["model"]), (moments[step - 1], moments[step])):
            assert before.keys() == at.keys() and all(torch.equal(before[k], at[k]) for k in before)
    assert not all(torch.equal(v, states[step + 1]["model"][k]) for k, v in states[step]["model"].items())

    rows = [dict(r, score="inf") for r in toy_scores(80, seed=11)]
    with toy_task_registered():
        proc = run_captured(harness.args(tmp_path / "all", "train.on_nonfinite=skip", "train.max_skipped_steps=2",
                                         train=write_csv(tmp_path / "all.csv", rows)), hf_home)
    assert proc.returncode == 4 and "the gradient norm is not finite at step 2, 2 times in a row" in proc.stderr


# The 2-process fault tests under DDP (make test), under FSDP2 and ZeRO-3, chosen by key (make test-slow): sharded
# checkpoints (DCP's, DeepSpeed's own) and a sharded gradient norm meet the same faults. ZeRO-3 refuses
# train.on_nonfinite=skip by key (DeepSpeed steps its own optimizer).
STRATEGIES = {"ddp": [], "fsdp2": ["distributed.strategy=fsdp"],
              "zero3": ["distributed.strategy=deepspeed", "distributed.deepspeed.zero_stage=3"]}


def cells(*names: str) -> list:
    """(policy, strategy) parameters, "policy-strategy" or "strategy"; all but DDP's marked slow."""
    params = []
    for name in names:
        strategy = name.rpartition("-")[2]
        values = (name.partition("-")[0], STRATEGIES[strategy]) if "-" in name else (STRATEGIES[strategy],)
        params.append(pytest.param(*values, id=name, marks=[pytest.mark.slow] if strategy != "ddp" else []))
    return params


@pytest.mark.multiprocess
@pytest.mark.parametrize("policy,strategy", cells("stop-ddp", "skip-ddp", "stop-fsdp2", "skip-fsdp2", "stop-zero3"))
def test_a_nan_on_one_process_of_two(policy, strategy, harness, cli, tmp_path):
    """One row with an infinite target, so one process's loss in one step is not finite. stop: both processes see
    it in the loss summed over them at that log step and stop with status 4 (the launcher exits 1), one line, the
    checkpoints before kept and finite. skip: the gradients are all-reduced, so both skip the same step and finish."""
    out = tmp_path / policy
    args = harness.args(out, f"train.on_nonfinite={policy}", "train.batch_size=4", "checkpoint.every_steps=1",
                        *strategy, train=harness.poisoned(50))
    proc = cli(args, launch="cpu_ddp.yaml", check=False, timeout=300)
    if policy == "stop":
        assert proc.returncode == 1 and proc.stderr.count("exitcode  : 4") >= 1, proc.stderr[-3000:]
        assert len([line for line in proc.stderr.splitlines() if line.startswith("diverged:")]) == 1
        assert not (out / "model").exists() and all(finite_checkpoints(out).values())
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        skipped_step(proc.stdout + proc.stderr)
        assert summary(out)["train"]["skipped_steps"] == 1 and all(math.isfinite(x) for x in train_losses(out))


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", cells("ddp", "fsdp2", "zero3"))
def test_a_disk_filled_by_one_process_of_two_ends_both_with_status_5(strategy, disk, harness, cli, monkeypatch):
    """2 processes (cpu_ddp), the disk filled right after process 1 wrote its share of the second checkpoint: each
    process that meets the full disk says so in one line (process 1's marked), the launcher reports status 5, the
    main process alone removes the shared partial folder, the first checkpoint stays; the same command, with room
    again, resumes it and finishes."""
    fault_injection.restore(disk)
    out = disk / "run"
    shutil.rmtree(out, ignore_errors=True)
    monkeypatch.setenv("FAULT", "fill=0@save:2")
    monkeypatch.setenv("FAULT_RANK", "1")
    monkeypatch.setenv("FAULT_DISK", str(disk))
    args = harness.args(out, "train.batch_size=4", *strategy)
    try:
        proc = cli(args, launch="cpu_ddp.yaml", check=False, timeout=300, script=FAULT_SCRIPT)
    finally:
        fault_injection.restore(disk)
    lines = [line for line in proc.stderr.splitlines() if "write failed: cannot write checkpoint step_4" in line]
    assert proc.returncode == 1 and "exitcode  : 5" in proc.stderr and lines, proc.stderr[-3000:]
    assert all("no space left on its device" in line for line in lines), lines
    assert len(lines) == 1 or any("[process 1] write failed:" in line for line in lines), lines  # the bar's line
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_2"]
    assert checkpoint.verify(out / "checkpoints" / "step_2") is None
    monkeypatch.delenv("FAULT")
    again = cli(args, launch="cpu_ddp.yaml", timeout=300)
    assert "step_2" in again.stdout and summary(out)["train"]["steps"] == STEPS

def test_a_read_only_output_dir_is_refused_before_any_work(disk, harness, hf_home, capsys):
    """A read-only output_dir (here its filesystem remounted read-only) is a bad input: exit 2, one line naming it."""
    fault_injection.restore(disk)
    (disk / "ro").mkdir(exist_ok=True)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    try:
        with toy_task_registered():
            assert run_main(harness.args(disk / "ro" / "out"), hf_home) == 2
    finally:
        fault_injection.restore(disk)
    err = capsys.readouterr().err
    assert f"output_dir: {disk / 'ro'} is not writable (a read-only filesystem, or no permission)" in err, err

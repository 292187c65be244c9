"""SIGTERM or SIGINT at any moment ends the run with one line, no traceback, and never a half-written
model/ or summary.json: exit 3 where a checkpoint exists to resume from (the same command resumes),
128 + the signal's number before there is one. And a user error exits non-zero under the TPU launcher's
code path, which ignores main()'s return value."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, read_metrics, tiny_args
from in_process import run_captured

SIGNAL_SCRIPT = ROOT / "tests" / "scripts" / "signal_at.py"
TEN_STEPS = ["train.max_steps=10", "train.log_every=5"]
SAVED = [*TEN_STEPS, "checkpoint.every_steps=5"]  # checkpoints at steps 5 and 10, before the final evaluation


def signalled(hf_home, args, **signal_env):
    env = {**os.environ, "HF_HOME": str(hf_home), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           **signal_env}
    return subprocess.run([sys.executable, str(SIGNAL_SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("phase,at,call,extra,signame,status", [
    ("loading the model", "framework.tasks.text_classification:TextClassification.load", 1, TEN_STEPS, "SIGTERM", 143),
    ("tokenizing", "framework.tasks.text_classification:TextClassification.prepare", 1, TEN_STEPS, "SIGINT", 130),
    ("the final evaluation, no checkpoint", "framework.train:evaluate", 1, TEN_STEPS, "SIGTERM", 143),
    ("the final evaluation", "framework.train:evaluate", 1, SAVED, "SIGTERM", 3),
    ("saving the final model", "transformers.tokenization_utils_base:PreTrainedTokenizerBase.save_pretrained", 1,
     SAVED, "SIGINT", 3),
    ("an evaluation inside the loop", "framework.train:evaluate", 1, ["train.max_steps=50", "train.log_every=5"],
     "SIGTERM", 3),
], ids=lambda v: v if isinstance(v, str) and " " in v else None)
def test_a_signal_in_any_phase_ends_cleanly(hf_home, tiny_model, easy_data, tmp_path, phase, at, call, extra,
                                            signame, status):
    out = tmp_path / "out"
    args = tiny_args(tiny_model, easy_data, out, *extra)
    proc = signalled(hf_home, args, SIGNAL_AT=at, SIGNAL_CALL=str(call), SIGNAL=signame)
    assert f"signal_at: sending {signame}" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == status, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if signame in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert not (out / "summary.json").exists()
    if (out / "model").exists():  # only ever a complete model: an earlier best, never a half-written one
        assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "tokenizer.json").is_file()
    if status == 3:
        assert "run the same command again to resume" in lines[0]
    else:
        assert "nothing to resume, the same command starts over" in lines[0]
    again = run_captured(args, hf_home)  # the same command, to the end (a new process is not the point here)
    assert again.returncode == 0, again.stderr[-3000:]
    assert ("resuming from" in again.stdout) == (status == 3)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train"]["steps"] == int(extra[0].split("=")[1])
    assert [r["step"] for r in read_metrics(out) if "loss" in r][-1] == summary["train"]["steps"]


def test_a_signal_during_the_first_imports_ends_with_one_line(hf_home, tiny_model, easy_data, tmp_path):
    """Ctrl-C while the run starts, as torch is being imported (the CLI's first heavy import): one line and 130, no
    traceback from inside the import. The CLI installs its handlers before it imports torch (framework/cli.py);
    with the import at module level, the signal came before them: exit -2 and a KeyboardInterrupt traceback."""
    out = tmp_path / "out"
    proc = signalled(hf_home, tiny_args(tiny_model, easy_data, out), SIGNAL_AT="import:torch", SIGNAL="SIGINT")
    assert "signal_at: sending SIGINT" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == ["stopped by SIGINT before the first checkpoint; nothing to resume, "
                                                "the same command starts over"]
    assert not out.exists()


def test_the_tpu_launchers_code_path_exits_non_zero_on_a_user_error(tmp_path):
    """accelerate's TPU launcher calls recipes/run.py's main() through PrepareForLaunch and drops its return
    value; main() must leave with SystemExit(2) instead."""
    code = ("import sys; sys.argv = ['run.py', 'train.batchsize=3']; sys.path.insert(0, 'recipes');"
            "from accelerate.utils import PrepareForLaunch; import run;"
            "PrepareForLaunch(run.main, distributed_type='XLA')(0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown key 'train.batchsize'; did you mean 'train.batch_size'?" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_signal_repeated_at_once_is_one_request_and_a_later_one_stops_at_once(monkeypatch):
    """Inside the loop the first signal asks for a checkpoint. The same signal again within SAME_REQUEST_S is that
    request delivered twice (Slurm's scancel signals every process of the step, then torchrun's agent signals its
    workers again: tests/test_slurm.py); one after it is a second request, and stops at once."""
    import signal
    import time

    from framework.signals import Interrupted, Signals

    monkeypatch.setattr(Signals, "SAME_REQUEST_S", 0.5)
    with Signals() as signals, signals.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.name == "SIGTERM"
        time.sleep(0.6)
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs at the next bytecode boundary; it raises before this ends

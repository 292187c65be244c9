"""launch/ray_train.py on a real local Ray cluster (Ray Train's TorchTrainer, 2 CPU workers over gloo; `pip install
'.[ray]'`, which make test-slow installs): it trains bitwise what `accelerate launch` (torchrun) with 2 processes
trains, and its checkpoints are the framework's own, so a run killed under accelerate launch resumes under Ray; with
--max_failures a dead worker restarts the group, which resumes. A bad recipe or flag is refused before Ray starts."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import (KILL_SCRIPT, LAUNCHERS_RUN, ROOT, assert_bitwise_equal_models, environment, free_port, tiny_args,
                     train_losses)

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(torch.cuda.is_available(), reason="backend auto would train on the GPU here")]

RAY_TRAIN = ROOT / "launch" / "ray_train.py"


def ray_run(args, hf_home: Path, storage: Path, *launcher: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(RAY_TRAIN), "--num_workers", "2", "--storage_path", str(storage), *launcher, *args]
    return subprocess.run(cmd, cwd=ROOT, env=environment(hf_home, RAY_DEDUP_LOGS="0"), text=True,
                          capture_output=True, timeout=600)


@pytest.mark.slow
def test_ray_workers_train_what_accelerate_launch_trains(two_process_run, tiny_model, easy_data, hf_home, tmp_path):
    out = tmp_path / "out"
    proc = ray_run(tiny_args(tiny_model, easy_data, out, *LAUNCHERS_RUN), hf_home, tmp_path / "ray")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["plan"]["strategy"] == "ddp", summary["plan"]
    assert_bitwise_equal_models(two_process_run, out)
    assert train_losses(out) == train_losses(two_process_run)


@pytest.mark.slow
def test_a_run_killed_under_accelerate_launch_resumes_under_ray(two_process_run, cli, tiny_model, easy_data, hf_home,
                                                                tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = tiny_args(tiny_model, easy_data, out, *LAUNCHERS_RUN)
    monkeypatch.setenv("KILL_AT_MICRO", "6")
    killed = cli(args, script=KILL_SCRIPT, launch="cpu_ddp.yaml", check=False,
                 launch_args=["--num_processes", "2", "--main_process_port", str(free_port())])
    monkeypatch.delenv("KILL_AT_MICRO")
    assert killed.returncode != 0 and (out / "checkpoints" / "step_4").is_dir() and not (out / "summary.json").exists()
    proc = ray_run(args, hf_home, tmp_path / "ray")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    assert f"resuming from {out / 'checkpoints' / 'step_4'}: step 4" in said, said[-4000:]
    assert_bitwise_equal_models(two_process_run, out)
    assert train_losses(out) == train_losses(two_process_run)


@pytest.mark.parametrize("argv, message", [
    (["train.batch_sise=4"], "train.batch_sise"),
    (["--num_workers", "0"], "--num_workers: 0"),
    pytest.param(["--address", "auto"], "--address auto: Could not find any running Ray instance", marks=pytest.mark.slow),
])
def test_a_bad_recipe_or_flag_is_refused_before_ray_starts(argv, message, hf_home, tmp_path):
    proc = ray_run(argv, hf_home, tmp_path / "ray")
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: ") and not (tmp_path / "ray").exists()


@pytest.mark.slow
def test_a_dead_worker_restarts_the_group_which_resumes_from_the_last_checkpoint(tiny_model, easy_data, hf_home,
                                                                                  tmp_path):
    """--max_failures 1: a worker SIGKILLed after the first checkpoint makes Ray start the worker group again, whose
    workers run the same command: it resumes from the newest checkpoint and finishes."""
    out, steps = tmp_path / "out", 300
    args = tiny_args(tiny_model, easy_data, out, f"train.max_steps={steps}", "train.log_every=1",
                     "checkpoint.every_steps=10", "train.cpu_threads=1", "train.batch_size=4")
    cmd = [sys.executable, str(RAY_TRAIN), "--num_workers", "2", "--storage_path", str(tmp_path / "ray"),
           "--max_failures", "1", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=environment(hf_home, RAY_DEDUP_LOGS="0"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "step_10").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.1)
        workers = subprocess.run(["pgrep", "-f", "RayTrainWorker"], capture_output=True, text=True).stdout.split()
        assert workers, "no Ray Train worker process found"
        os.kill(int(workers[-1]), signal.SIGKILL)
        said, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, said[-4000:]
    resumed = re.findall(r"resuming from \S+/step_(\d+): step", said)
    assert resumed and 10 <= int(resumed[0]) < steps, said[-4000:]
    assert json.loads((out / "summary.json").read_text())["train"]["steps"] == steps

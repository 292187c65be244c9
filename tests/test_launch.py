"""Every launch config that can start on this machine, through the real ``accelerate launch``: what it started
is what trains (or it is refused with a message), and the CPU thread count each process gets by default.

These tests assume a machine without CUDA (the GPU configs then train on the CPU, or are refused): on a CUDA
machine tests/test_gpu.py covers them instead. ``accelerate launch`` turns the child's exit 2 into its own
exit 1, so refusals are checked as a non-zero status and the message in stderr.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import ACCELERATE_COMMAND, ROOT, RUN, cli_runner, cores, summary, tiny_args

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="assumes a machine without CUDA")
# The launch configs for 8 GPUs are started with 2 processes here: the same launcher and the same code path
# per process, affordable on a 2-core machine.
TWO = ["--num_processes", "2"]


def plan_value(stdout: str, key: str) -> str:
    match = re.search(rf"^  {key}: (.*)$", stdout, re.MULTILINE)
    assert match, f"no {key} in the plan:\n{stdout}"
    return match.group(1)


@pytest.fixture
def cli(hf_home):
    """The CLI runner through the ``accelerate launch`` command itself (the other tests' runner uses its module)."""
    run = cli_runner(hf_home)
    return lambda *args, **kwargs: run(*args, launcher=ACCELERATE_COMMAND, **kwargs)


@pytest.fixture
def args(tiny_model, easy_data, tmp_path):
    return lambda *extra: tiny_args(tiny_model, easy_data, tmp_path / "out", "train.max_steps=2", *extra)


@NO_CUDA
@pytest.mark.parametrize("config, launch_args, processes", [
    ("cpu.yaml", [], 1),
    ("gpu.yaml", [], 1),  # no GPU: backend auto trains on the CPU and the plan says so
    pytest.param("multi_gpu.yaml", TWO, 2, marks=pytest.mark.multiprocess),  # no GPU: DDP over gloo
])
def test_config_trains_as_many_processes_as_it_started(cli, args, tmp_path, config, launch_args, processes):
    """cpu_ddp.yaml (2 processes, default backend) is tests/test_distributed.py's
    test_two_processes_equal_one_with_double_batch_and_with_accumulation, which also compares the weights."""
    proc = cli(args(), launch=config, launch_args=launch_args)
    assert plan_value(proc.stdout, "num_processes") == str(processes)
    assert plan_value(proc.stdout, "strategy") == ("ddp" if processes > 1 else "single process")
    result = summary(tmp_path / "out")
    assert (result["backend"], result["num_processes"]) == ("cpu", processes)
    assert result["train"]["samples"] == 2 * 8 * processes  # 2 steps x batch 8 per process
    if config != "cpu.yaml":
        assert "note: backend auto: no GPU or XLA device found, training on the CPU" in proc.stdout


@NO_CUDA
def test_the_deepspeed_zero2_config_trains_the_default_task_on_cpu_processes(cli, args):
    """DeepSpeed's own launch config as written, the recipe's defaults (strategy auto): ZeRO-2 on CPU processes
    (tests/test_deepspeed.py: ZeRO-1/2/3 against DDP, resume, deepspeed_zero3.yaml's stage)."""
    if importlib.util.find_spec("deepspeed") is None:  # accelerate's DeepSpeed launcher refuses first
        proc = cli(args(), launch="deepspeed_zero2.yaml", launch_args=TWO, check=False)
        assert proc.returncode != 0 and "DeepSpeed is not installed => run `pip3 install deepspeed`" in proc.stderr
        return
    proc = cli(args(), launch="deepspeed_zero2.yaml", launch_args=TWO)
    assert plan_value(proc.stdout, "strategy") == "deepspeed (ZeRO stage 2)" and plan_value(proc.stdout, "num_processes") == "2"


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed")
def test_tpu_config_without_torch_xla_fails_naming_it(cli, args):
    """accelerate's TPU launcher imports torch_xla before it loads recipes/run.py, so the message is its own:
    none of our code runs."""
    proc = cli(args(), launch="tpu.yaml", check=False)
    assert proc.returncode != 0
    assert "No module named 'torch_xla'" in proc.stderr


# ---------------------------------------------------------------- CPU threads


def launch_plain(hf_home: Path, arguments: list) -> subprocess.CompletedProcess:
    """``accelerate launch recipes/run.py ...`` as users type it: no config file and no thread flags (the
    launcher then sets OMP_NUM_THREADS=1). HF_HOME points away from any default accelerate config."""
    env = {**os.environ, "HF_HOME": str(hf_home), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    for name in ("ACCELERATE_CONFIG_FILE", "OMP_NUM_THREADS"):
        env.pop(name, None)
    cmd = [*ACCELERATE_COMMAND, str(RUN), *arguments]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@NO_CUDA
def test_plain_launch_uses_every_core(hf_home, args):
    proc = launch_plain(hf_home, ["--dry-run", *args()])
    assert plan_value(proc.stdout, "cpu_threads") == (
        f"{cores()} (auto: {cores()} cores / 1 process; OMP_NUM_THREADS=1 overridden; set train.cpu_threads to pin it)")


@NO_CUDA
def test_plain_launch_with_cpu_threads_set(hf_home, args):
    proc = launch_plain(hf_home, ["--dry-run", *args("train.cpu_threads=1")])
    assert plan_value(proc.stdout, "cpu_threads") == "1 (train.cpu_threads)"


@pytest.mark.parametrize("env, threads", [
    ({}, (max(1, cores() // 1), "auto: {c} cores / 1 process; set train.cpu_threads to pin it")),
    ({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"},
     (max(1, cores() // 2), "auto: {c} cores / 2 processes; OMP_NUM_THREADS=1 overridden; set train.cpu_threads to pin it")),
    ({"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "2"},
     (3, "auto: OMP_NUM_THREADS=3 respected; set train.cpu_threads to pin it")),
])
def test_cpu_threads_auto(monkeypatch, env, threads):
    from framework import backend
    from framework.config import RunConfig

    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = RunConfig()
    assert backend.cpu_threads(cfg) == (threads[0], threads[1].format(c=cores()))
    cfg.train.cpu_threads = 5
    assert backend.cpu_threads(cfg) == (5, "train.cpu_threads")

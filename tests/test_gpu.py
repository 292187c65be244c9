"""GPU checks, one short script (under 5 minutes on one GPU); skipped where torch sees no CUDA device.

    .venv/bin/python -m pytest -m gpu tests/test_gpu.py

Each case trains the tiny model for 90 steps and asserts a finite loss that goes down.
"""

import importlib.util
import math

import pytest
import torch

from conftest import read_metrics, tiny_args

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU checks skipped")]

CASES = {
    "bf16": ("gpu.yaml", ["precision=bf16"], []),
    "fp16": ("gpu.yaml", ["precision=fp16"], []),
    "fsdp_one_process": ("fsdp.yaml", ["distributed.strategy=fsdp"], ["--num_processes", "1"]),
    "deepspeed_zero2": ("deepspeed_zero2.yaml", ["distributed.strategy=deepspeed"], ["--num_processes", "1"]),
}


@pytest.mark.parametrize("case", CASES)
def test_trains_on_gpu(case, cli, tiny_model, easy_data, tmp_path):
    if case.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    launch, overrides, launch_args = CASES[case]
    out = tmp_path / case
    proc = cli(tiny_args(tiny_model, easy_data, out, "train.max_steps=90", "backend=gpu", *overrides),
               launch=launch, launch_args=launch_args)
    assert "backend: gpu" in proc.stdout
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.1, losses

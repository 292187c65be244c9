"""GPU checks, one short suite for one GPU machine: ``make test-gpu`` (installs the deepspeed extra, then runs
``pytest -m gpu tests/test_gpu.py``; under 8 minutes on one H100-class GPU). Skipped where torch sees no CUDA
device; the two-process cases run where two GPUs exist.

Each training case runs the tiny model through the real CLI and its launch config, and asserts what the case
is about (the grad scaler's state in the checkpoint, compiled graphs, the 8-bit optimizer's state, the sharded
strategy in the plan) and a finite loss that goes down.
"""

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, read_metrics, tiny_args
from framework.backend.hardware import chip

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU checks skipped")]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

# case: (launch config, recipe overrides, launch arguments, what the plan must say, GPUs needed)
CASES = {
    "bf16": ("gpu.yaml", ["precision=bf16"], [], "precision: bf16", 1),
    "fp16_grad_scaler": ("gpu.yaml", ["precision=fp16", "checkpoint.every_steps=45"], [], "precision: fp16", 1),
    "torch_compile": ("gpu.yaml", ["train.compile=true", "data.padding=max_length"], [], "backend: gpu", 1),
    "adamw_8bit": ("gpu.yaml", ["optim.name=adamw_8bit"], [], "optimizer state (adamw_8bit)", 1),
    "fsdp2_one_process": ("fsdp.yaml", [], ["--num_processes", "1"], "strategy: fsdp (version 2)", 1),
    "fsdp2_two_processes": ("fsdp.yaml", [], ["--num_processes", "2"], "strategy: fsdp (version 2)", 2),
    "deepspeed_zero2_one_process": ("deepspeed_zero2.yaml", [], ["--num_processes", "1"],
                                    "strategy: deepspeed (ZeRO stage 2)", 1),
    "deepspeed_zero2_two_processes": ("deepspeed_zero2.yaml", [], ["--num_processes", "2"],
                                      "strategy: deepspeed (ZeRO stage 2)", 2),
}


@pytest.mark.parametrize("case", CASES)
def test_trains_on_gpu(case, cli, tiny_model, easy_data, tmp_path):
    launch, overrides, launch_args, planned, gpus = CASES[case]
    if GPUS < gpus:
        pytest.skip(f"needs {gpus} GPUs, this machine has {GPUS}")
    if case.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.fail("deepspeed is not installed: `pip install -e '.[deepspeed]'` (make test-gpu does)")
    out = tmp_path / case
    proc = cli(tiny_args(tiny_model, easy_data, out, "train.max_steps=90", "backend=gpu", "train.log_every=5",
                         *overrides), launch=launch, launch_args=launch_args)
    assert "backend: gpu" in proc.stdout and planned in proc.stdout, proc.stdout[-3000:]
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"].startswith("cuda")
    if chip(torch.cuda.get_device_name(0)):  # a GPU of the peak table: MFU is reported
        assert 0 < summary["mfu"] < 1, summary["mfu"]
    if case == "fp16_grad_scaler":  # accelerate's GradScaler is saved with the checkpoint
        assert (out / "checkpoints" / "step_90" / "scaler.pt").is_file()
    if case == "adamw_8bit":  # uint8 moments: about 2 bytes per parameter instead of 8
        memory = summary["memory"]
        assert memory["optimizer_state_bytes"] < 4 * memory["trainable_parameters"], memory


def test_default_recipe_accuracy_on_gpu(cli, tmp_path):
    """The default recipe as written (one epoch of MiniLM on Rotten Tomatoes) on one GPU in bf16."""
    out = tmp_path / "default"
    cli([f"output_dir={out}", "precision=bf16"], launch="gpu.yaml")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "gpu" and summary["eval"]["accuracy"] >= 0.78, summary["eval"]
    print(f"default recipe on {torch.cuda.get_device_name(0)}: accuracy {summary['eval']['accuracy']:.4f}, "
          f"{summary['train']['samples_per_second']:.0f} samples/s, MFU {summary['mfu']:.3f}")


def test_loop_benchmark_in_gpu_mode(tmp_path):
    """benchmarks/compare_loops.py --device gpu on the tiny case: the framework against a raw loop and the
    Trainer, side by side, on the GPU."""
    report = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare_loops.py"), "--device", "gpu",
                           "--case", "tiny", "--repeats", "1", "--json", str(report)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    result = json.loads(report.read_text())
    assert result["device"] == "gpu" and "gpu" in result["machine"]
    assert result["cases"]["tiny"]["runs"], result["cases"]["tiny"]

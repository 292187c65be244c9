"""What the tests of strategies over several processes share (tests/test_fsdp.py, tests/test_deepspeed.py, the task
contract's matrix): the backend and launch configs by hardware, the language model's common run of 12 steps with a
checkpoint every 4, the launch arguments, and the bounds within which a sharded strategy trains what plain data
parallelism or one process does."""

from __future__ import annotations

from pathlib import Path
from typing import List

import torch

from helpers import ROOT, free_port, losses_by_step, weights

CUDA = torch.cuda.is_available()
# The same tests on GPUs (make test-gpu, NCCL): the backend is the only difference. Bitwise comparisons need
# deterministic kernels: on the CPU they are; on a GPU a resume is compared within the bounds below.
BACKEND = "backend=gpu" if CUDA else "backend=cpu"
# Plain data parallel (and tensor parallelism) over the same processes: cpu_ddp.yaml forces the CPU (use_cpu).
DDP_LAUNCH = "multi_gpu.yaml" if CUDA else "cpu_ddp.yaml"
# 12 optimizer steps of 8 blocks (21 per epoch: a kill after step 8's checkpoint is mid-epoch), a checkpoint every 4,
# one thread a process (the 2 processes share 2 cores).
COMMON = [BACKEND, "train.max_steps=12", "train.log_every=1", "checkpoint.every_steps=4", "checkpoint.keep_last=3",
          "train.cpu_threads=1"]
# A sharded strategy sums each gradient in another order than DDP or one process (FSDP2's reduce-scatter, ZeRO's
# buckets, tensor parallelism's rowwise all-reduce; one process in its own matrix products): fp32 rounding apart.
# Measured over the 12 steps: losses within 2.5e-7 (FSDP2) to 7.5e-7 (ZeRO-3) of DDP's, 5.3e-7 of one process's;
# weights within 4.6e-6 to 8.0e-6 absolute, the size by which DDP itself differs from one process (4.5e-6): AdamW
# divides each update by sqrt(v), so a gradient that differs in its last bits moves a weight by up to ~lr * 1e-3.
# Relative figures mean nothing for weights near 0, so the bound is absolute: about 4 x the measured.
WEIGHT_TOLERANCE = dict(rtol=1e-4, atol=2e-5)
LOSS_TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def llama_args(word_tokenizer: Path, corpus: Path, out: Path, *extra: str) -> List[str]:
    """The tiny Llama (tests/tiny_llama.yaml: SmolLM2's shape, tied head; a tensor-parallel plan) on the documents,
    12 steps."""
    return ["--config", str(ROOT / "tests" / "tiny_llama.yaml"), f"model.tokenizer={word_tokenizer}",
            f"data.train_file={corpus}", f"output_dir={out}", BACKEND, "train.max_steps=12", "train.log_every=1",
            "train.cpu_threads=1", *extra]


def launch(processes: int = 2) -> List[str]:
    """``accelerate launch`` arguments: ``processes`` processes on a free port."""
    return ["--num_processes", str(processes), "--main_process_port", str(free_port())]


def into(args: List[str], out: Path) -> List[str]:
    """The same run's arguments with another output_dir."""
    return [a if not a.startswith("output_dir=") else f"output_dir={out}" for a in args]


def assert_trains_alike(a: Path, b: Path, weight_tolerance: dict = WEIGHT_TOLERANCE) -> None:
    """Two runs' losses at every logged step within LOSS_TOLERANCE, and their saved weights, name for name, within
    ``weight_tolerance``."""
    la, lb = losses_by_step(a), losses_by_step(b)
    assert la.keys() == lb.keys()
    torch.testing.assert_close(torch.tensor(list(la.values())), torch.tensor(list(lb.values())), **LOSS_TOLERANCE)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], **weight_tolerance, msg=lambda m: f"{name}: {m}")

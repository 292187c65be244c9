"""The training loss and what else the steps report (tokens, further metrics, examples), summed over a log window
on the device and read only when it is logged: reading them every step would force a host sync (and on XLA cut the
step's graph)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from framework import backend, flops
from framework.step import StepResult

if TYPE_CHECKING:
    from accelerate import Accelerator


@dataclass
class Window:
    """What one log window trained: read at its close."""

    loss: float  # mean per target over the window and all processes
    micro_steps: int
    seconds: float
    tokens: int  # real (non-padding) tokens, all processes
    flops: float  # model FLOPs of those tokens (framework.flops)
    metrics: Dict[str, float]  # the steps' further scalars (StepResult.metrics), each its mean over the window
    examples: List[Dict[str, object]]  # the window's last step's (StepResult.examples)


class LossWindow:
    """Training loss (a sum over targets, with their count) and tokens, as the steps report them (framework.step),
    summed on the device and read only at log intervals: reading them every step would force a host sync (and on
    XLA cut the step's graph)."""

    def __init__(self, accelerator: Accelerator, model_flops: flops.ModelFlops):
        self.accelerator, self.model_flops = accelerator, model_flops
        self.loss_sum = backend.zero_scalar(accelerator)
        self.targets = backend.zero_scalar(accelerator)
        # Since the start of this process's training: real tokens, and each token times its row's real length
        # (attention's FLOPs grow with it); ``logged``: their values at the latest close.
        self.tokens = backend.zero_scalar(accelerator, torch.long)
        self.token_context = backend.zero_scalar(accelerator, torch.long)
        self.logged = (0, 0)
        self.micro_steps, self.start = 0, time.perf_counter()
        self.metrics: Dict[str, list] = {}  # name -> [sum, steps] over the window
        # The last step's examples: a log window ends at the step it logs, so a resumed run logs the same ones.
        self.examples: List[Dict[str, object]] = []

    def add(self, result: StepResult) -> None:
        self.loss_sum += result.loss_sum
        self.targets += result.targets
        self.tokens += result.tokens
        self.token_context += result.token_context
        self.micro_steps += result.micro_steps
        self.examples = result.examples
        for name, value in result.metrics.items():
            total = self.metrics.setdefault(name, [0.0, 0])
            total[0] += value
            total[1] += 1

    def skip(self) -> None:
        """A step whose update was skipped (its loss is not finite): nothing of it is logged, its examples not shown."""
        self.examples = []

    def close(self) -> Window:
        """Host sync: the window's figures over all processes; starts a new window."""
        loss = backend.read_scalar(self.accelerator, self.loss_sum, "sum") / backend.read_scalar(
            self.accelerator, self.targets, "sum")
        (tokens, context), before = self.totals(), self.logged
        result = Window(loss, self.micro_steps, time.perf_counter() - self.start, tokens - before[0],
                        self.model_flops.total(tokens - before[0], context - before[1]),
                        {name: total / steps for name, (total, steps) in self.metrics.items()}, self.examples)
        self.logged = (tokens, context)
        self.loss_sum, self.targets = backend.zero_scalar(self.accelerator), backend.zero_scalar(self.accelerator)
        self.micro_steps, self.start, self.metrics, self.examples = 0, time.perf_counter(), {}, []
        return result

    def totals(self) -> tuple:
        """Host sync: (tokens, token context) trained on by this process's run so far, all processes (the processes
        of a tensor-parallel group train on the same tokens: counted once)."""
        tp = backend.tensor_parallel_size(self.accelerator)
        return tuple(int(backend.read_scalar(self.accelerator, t, "sum")) // tp
                     for t in (self.tokens, self.token_context))

    def snapshot(self, accumulation: int) -> dict:
        """The unlogged window, for a checkpoint (a host sync, as saving is anyway), in a form any layout restores:
        its loss and target totals over the processes (a tensor-parallel group's processes, which train on the same
        data, counted once) and its optimizer steps (``accumulation`` micro-batches each)."""
        shared = backend.tensor_parallel_size(self.accelerator)
        return {"loss_total": backend.read_scalar(self.accelerator, self.loss_sum, "sum") / shared,
                "targets_total": backend.read_scalar(self.accelerator, self.targets, "sum") / shared,
                "steps": self.micro_steps // accumulation, "metrics": self.metrics}

    def restore(self, snapshot: Optional[dict], accumulation: int) -> None:
        """What ``snapshot`` saved, on this layout: each process its share of the totals (so the next logged sum over
        the processes holds them once), the steps in this layout's micro-batches."""
        if snapshot and "loss_total" not in snapshot:  # an older checkpoint's, resumed on its own layout only
            self.loss_sum, self.targets = self.loss_sum + snapshot["loss_sum"], self.targets + snapshot["targets"]
            self.micro_steps, self.metrics = snapshot["micro_steps"], snapshot.get("metrics", {})
        elif snapshot:
            share = self.accelerator.num_processes / backend.tensor_parallel_size(self.accelerator)
            self.loss_sum = self.loss_sum + snapshot["loss_total"] / share
            self.targets = self.targets + snapshot["targets_total"] / share
            self.micro_steps = snapshot["steps"] * accumulation
            self.metrics = {name: list(total) for name, total in snapshot.get("metrics", {}).items()}

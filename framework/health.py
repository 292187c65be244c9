"""Numerical health: a training loss or weight that is no longer finite. ``check_finite`` stops the run
(``Diverged``, exit status 4) before anything is written from it; ``SkippedSteps`` is ``train.on_nonfinite: skip``'s
count of updates left out because their gradient norm was not finite (framework/step.py's ``Update`` asks it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from framework import backend

if TYPE_CHECKING:
    from accelerate import Accelerator


class Diverged(Exception):
    """Raised where the training loss or a weight is no longer finite, before anything is written from it; the CLI
    exits with status 4. The checkpoints saved before stay (none is rotated out for a non-finite one) and model/ is
    not written."""


def check_finite(accelerator: Accelerator, model: Optional[torch.nn.Module], loss: Optional[float], step: int) -> None:
    """Raise Diverged where ``loss`` (already read over every process) or, with ``model``, any weight of any
    process's shards is NaN or infinite. Called before a checkpoint or model/ is written, never inside a step: on XLA
    the check is one small graph (compiled once, the shapes never change) and one host read beside the save's own."""
    if loss is not None and not np.isfinite(loss):
        raise Diverged(f"the training loss is {loss} at step {step}")
    if model is None:
        return
    flags = [torch.isfinite(backend.local_shard(p)).all() for p in model.parameters()]
    bad = bool(flags) and not bool(torch.stack(flags).all())  # one host read
    if backend.any_process(accelerator, bad)[0]:
        raise Diverged(f"a weight is not finite after step {step}, although the loss was")


class SkippedSteps:
    """``train.on_nonfinite: skip``: whether each optimizer update may go ahead, from its gradient norm (every
    process agrees), counting the updates skipped: in all, in a row, and in the current step."""

    def __init__(self, limit: int, total: int = 0, in_a_row: int = 0):
        self.limit, self.total, self.in_a_row = limit, total, in_a_row
        self.step, self.in_step = 0, 0

    def begin(self, step: int) -> None:
        """Step ``step`` (counted from 1) starts."""
        self.step, self.in_step = step, 0

    def allow(self, accelerator: Accelerator, norm: torch.Tensor) -> bool:
        """Whether an update may use gradients of norm ``norm``; raises Diverged at the ``limit``-th non-finite one
        in a row. One host read and, on several processes, an all-reduce (under local SGD one process's NaN is its
        own)."""
        bad = backend.any_process(accelerator, not bool(torch.isfinite(norm)))[0]
        if not bad:
            self.in_a_row = 0
            return True
        self.total, self.in_a_row, self.in_step = self.total + 1, self.in_a_row + 1, self.in_step + 1
        if self.in_a_row >= self.limit:
            raise Diverged(f"the gradient norm is not finite at step {self.step}, {self.in_a_row} times in a row "
                           f"(train.max_skipped_steps: {self.limit})")
        return False



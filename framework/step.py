"""One step of the loop: the loop hands a step the micro-batches of one step and logs what it returns.

- ``Step``: what a task's ``step(cfg)`` returns. ``micro_batches_per_update``: the micro-batches each weight update
  accumulates (accelerate's and DeepSpeed's accumulation count); ``updates``: the weight updates one call makes (the
  learning-rate schedule's length is the run's steps times this); called with a ``StepContext`` and the step's
  micro-batches, it returns a ``StepResult``. :class:`SupervisedStep` is every supervised task's; online RL brings
  its own (framework/tasks/online_rl/step.py: generate, score, then update one or more times on the same rollouts).
- ``StepContext``: what a step is given, and all it is given: the accelerator, the model as prepared, the SPMD mesh,
  the task as the run binds it (``TaskRun``), and the ``Update``.
- ``Update``: where the weights change, the one place: each micro-batch's backward under accelerate's accumulation
  and, where an accumulation window ends, clipping, the optimizer's step (or its skip, ``train.on_nonfinite: skip``,
  counted by framework/health.py's ``SkippedSteps``), the schedule's step, local SGD's, and zeroing the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Protocol, Tuple, Union

import torch

from framework import backend
from framework.health import SkippedSteps

if TYPE_CHECKING:
    import datasets
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    from framework.tasks.base import TaskRun

Count = Union[int, torch.Tensor]  # a host number, or a device scalar read only at log steps


@dataclass
class StepResult:
    """What one step of the loop did on this process; the loop's loss window sums it and reads it at log steps."""

    loss_sum: torch.Tensor  # the loss summed over the step's targets (the sum its logged mean divides)
    targets: Count  # what the loss sum is normalised by (examples, or target tokens)
    tokens: Count  # real (non-padding) tokens put through the model
    token_context: Count  # each of those tokens times its row's real length (attention's FLOPs grow with it)
    micro_steps: int  # micro-batches (forward and backward passes; online RL's several updates count once)
    # Further scalars to log with the loss (online RL's rewards), each already the same on every process (the
    # step reduced it over them); the loop logs each one's mean over the steps of its log window.
    metrics: Dict[str, float] = field(default_factory=dict)
    # A few of the step's examples as text, from the main process (online RL: one prompt's completions with their
    # rewards): the loop logs the last step's with each training record, and the report shows them over the run.
    examples: List[Dict[str, object]] = field(default_factory=list)


@dataclass
class Update:
    """The weights' update: the optimizer, its schedule, clipping, skipped updates and local SGD, used by every step
    through ``micro_batch``."""

    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    max_grad_norm: Optional[float]
    skips: Optional[SkippedSteps] = None  # train.on_nonfinite: skip
    local_sgd: Optional[LocalSGD] = None  # distributed.local_sgd_steps

    def begin(self, step: int) -> None:
        """Step ``step`` of the loop (counted from 1) starts."""
        if self.skips is not None:
            self.skips.begin(step)

    @property
    def skip_counts(self) -> Tuple[int, int]:
        """(updates skipped in all, in a row): what a checkpoint keeps."""
        return (self.skips.total, self.skips.in_a_row) if self.skips is not None else (0, 0)

    @skip_counts.setter
    def skip_counts(self, counts: Tuple[int, int]) -> None:
        if self.skips is not None:
            self.skips.total, self.skips.in_a_row = counts

    @property
    def skipped(self) -> bool:
        """Whether an update of the current step was skipped (its gradient norm was not finite)."""
        return self.skips is not None and self.skips.in_step > 0

    def micro_batch(self, loss_sum_of: Callable[[torch.nn.Module], torch.Tensor], scale) -> torch.Tensor:
        """One micro-batch under accelerate's accumulation: the forward ``loss_sum_of(model)``, the backward of it
        times ``scale`` and, where the accumulation window ends, the update (``_update``); returns the loss sum,
        detached."""
        acc, model = self.accelerator, self.model
        with acc.accumulate(model):
            loss_sum = loss_sum_of(model)
            acc.backward(loss_sum * scale)
            if acc.sync_gradients:
                self._update()
            else:
                self.optimizer.step()  # accelerate's wrapper: nothing before the window ends (DeepSpeed counts it)
            self.optimizer.zero_grad()
        return loss_sum.detach()

    def _update(self) -> None:
        """Clip, step the optimizer (unless the gradient norm is not finite under ``train.on_nonfinite: skip``: the
        weights and the optimizer's state stay as they were), then the schedule (which advances either way: the
        step's data was consumed) and local SGD's count."""
        allowed = True
        if self.max_grad_norm or self.skips is not None:
            norm = backend.clip_gradients(self.accelerator, self.model, self.max_grad_norm)
            allowed = self.skips is None or self.skips.allow(self.accelerator, norm)
        if allowed:
            self.optimizer.step()
        self.scheduler.step()
        if self.local_sgd is not None:
            self.local_sgd.step()


@dataclass
class StepContext:
    """What a step works with."""

    accelerator: Accelerator
    model: torch.nn.Module  # as accelerate prepared it
    mesh: backend.Mesh  # the devices one process drives under SPMD (one otherwise)
    task: TaskRun  # the task as the run binds it
    update: Update
    examples: Optional[datasets.Dataset] = None  # the prepared training rows (None for a stream)


class Step(Protocol):
    micro_batches_per_update: int
    updates: int

    def __call__(self, ctx: StepContext, batches: List[Dict[str, torch.Tensor]]) -> StepResult:
        """One step of the loop over ``batches`` (``train.gradient_accumulation_steps`` micro-batches): ``updates``
        weight updates."""


def real_tokens(batch: Dict[str, torch.Tensor]) -> tuple:
    """(tokens, token context) of a batch from its attention mask: padding never counts."""
    row_lengths = batch["attention_mask"].sum(dim=1)
    return row_lengths.sum(), (row_lengths * row_lengths).sum()


class SupervisedStep:
    """Micro-batches with gradient accumulation, one update per step. The step's loss is the sum of every target's
    loss over the number of targets of the whole step (all micro-batches, all processes), counted before the
    forward pass: uneven micro-batches (token counts) weigh each target alike, unlike a mean of per-batch means."""

    updates = 1

    def __init__(self, cfg):
        self.micro_batches_per_update = cfg.train.gradient_accumulation_steps

    def __call__(self, ctx: StepContext, batches: List[Dict[str, torch.Tensor]]) -> StepResult:
        acc, task = ctx.accelerator, ctx.task
        counts = [task.targets(batch) for batch in batches]
        total = backend.total_over_processes(acc, sum(counts))
        # accelerate divides each micro-batch's loss by the accumulation steps, and DDP/FSDP/DeepSpeed average
        # the gradients over processes: this scale turns both back into the division by the step's total.
        scale = acc.num_processes * len(batches) / total
        loss_sum = tokens = token_context = 0
        for batch in batches:
            loss_sum = loss_sum + ctx.update.micro_batch(lambda model, batch=batch: task.loss_sum(model, batch), scale)
            batch_tokens, batch_context = real_tokens(batch)
            tokens, token_context = tokens + batch_tokens, token_context + batch_context
        return StepResult(loss_sum, sum(counts), tokens, token_context, len(batches))

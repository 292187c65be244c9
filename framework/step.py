"""One optimizer step, as the task chooses it: the loop hands a step the micro-batches of one optimizer step and
logs what it returns. ``Task.step(cfg)`` picks the implementation; :class:`SupervisedStep` is the one every task
uses today. Another (online RL: generate, score, then update one or more times on the same rollouts, whose
targets exist only after generation) counts what it really processed the same way, inside the step, so the
loop's tokens/s and MFU count that."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Protocol, Union

import torch

from framework import backend

if TYPE_CHECKING:
    from framework.train import Run

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


class Step(Protocol):
    def __call__(self, run: "Run", batches: List[Dict[str, torch.Tensor]]) -> StepResult:
        """One step of the loop over ``batches`` (``train.gradient_accumulation_steps`` micro-batches): one
        optimizer step, or as many as the task's ``updates_per_step``."""


def real_tokens(batch: Dict[str, torch.Tensor]) -> tuple:
    """(tokens, token context) of a batch from its attention mask: padding never counts."""
    row_lengths = batch["attention_mask"].sum(dim=1)
    return row_lengths.sum(), (row_lengths * row_lengths).sum()


class SupervisedStep:
    """Micro-batches with gradient accumulation. The step's loss is the sum of every target's loss over the
    number of targets of the whole step (all micro-batches, all processes), counted before the forward pass:
    uneven micro-batches (token counts) weigh each target alike, unlike a mean of per-batch means."""

    def __call__(self, run: "Run", batches: List[Dict[str, torch.Tensor]]) -> StepResult:
        acc, task = run.accelerator, run.task
        counts = [task.targets(batch) for batch in batches]
        total = backend.total_over_processes(acc, sum(counts))
        # accelerate divides each micro-batch's loss by the accumulation steps, and DDP/FSDP/DeepSpeed average
        # the gradients over processes: this scale turns both back into the division by the step's total.
        scale = acc.num_processes * len(batches) / total
        loss_sum = tokens = token_context = 0
        for batch in batches:
            loss_sum = loss_sum + self.micro_batch(run, batch, scale)
            batch_tokens, batch_context = real_tokens(batch)
            tokens, token_context = tokens + batch_tokens, token_context + batch_context
        return StepResult(loss_sum, sum(counts), tokens, token_context, len(batches))

    def micro_batch(self, run: "Run", batch: Dict[str, torch.Tensor], scale) -> torch.Tensor:
        """Forward and backward (and, at the last micro-batch, the optimizer step); returns the loss sum, detached."""
        return backward_and_step(run, lambda model: run.task.loss_sum(model, batch), scale)


def backward_and_step(run: "Run", loss_sum_of: Callable[[torch.nn.Module], torch.Tensor], scale) -> torch.Tensor:
    """One micro-batch under accelerate's accumulation: the forward ``loss_sum_of(model)``, the backward of it
    times ``scale`` and, where the accumulation window ends, gradient clipping and the optimizer step; returns
    the loss sum, detached."""
    acc, model, skips = run.accelerator, run.model, run.skipped_steps
    with acc.accumulate(model):
        loss_sum = loss_sum_of(model)
        acc.backward(loss_sum * scale)
        update = True
        if acc.sync_gradients and (run.cfg.train.max_grad_norm or skips is not None):
            norm = backend.clip_gradients(acc, model, run.cfg.train.max_grad_norm)
            # train.on_nonfinite: skip. A non-finite norm leaves the weights and the optimizer's state as they were.
            update = skips is None or skips.allow(acc, norm)
        if update:
            run.optimizer.step()
        run.optimizer.zero_grad()
    return loss_sum.detach()

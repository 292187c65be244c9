"""Resuming on another topology: another process count, another launch config (DDP, FSDP2, HSDP, tensor parallelism,
2D), the same run continued.

Every checkpoint records its run's ``Layout``: how many processes and devices trained it, how many data-parallel
replicas of the model they made, the per-device batch and the accumulation, hence the effective batch (examples per
optimizer step), and whether its training state is portable (framework/backend/states.py: DCP, loadable into any
layout; DeepSpeed's and XLA's own checkpoints are not). What the run depends on is independent of the layout once
the effective batch is kept:

- the data: rows in memory are drawn in one seeded order per epoch (the same for every process count) and each
  optimizer step takes the next ``effective batch`` of them, however they are split into micro-batches and
  processes, so the position is the optimizer steps done in the epoch (``TrainState.epoch_step``);
- sampling (online RL) and masking (masked LMs) are keyed by example, not by process;
- the loss of a step is normalised by the targets of the whole step, so its split does not change the gradient.

So ``resumed`` keeps the checkpoint's effective batch on the new replicas, changing the accumulation (or, where that
cannot, the per-device batch) and saying so in one line; where no split keeps it, or the run's state is tied to
its layout (a stream's position is each process's own share; DeepSpeed's and XLA's states), the resume is refused
by key with the numbers. Each process's random states (dropout) come from its own process of the checkpoint where
there is one; dropout off, a resumed run ends where the uninterrupted run ends, within the rounding that a
different split of the same sums gives (the task contract's 1-process-vs-2 bounds)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from framework.errors import UserError


@dataclass(frozen=True)
class Layout:
    """How a run splits its work, as a checkpoint records it."""

    processes: int
    devices: int  # processes x the SPMD devices each drives
    replicas: int  # data-parallel copies of the model: the devices over the tensor-parallel size
    strategy: str  # the plan's strategy
    batch_size: int  # examples per device per micro-batch
    accumulation: int  # micro-batches per optimizer step
    portable: bool  # its training state loads into another layout (framework/backend/states.py)
    streaming: bool  # its data position is each process's share of a stream

    @property
    def effective_batch(self) -> int:
        return self.batch_size * self.accumulation * self.replicas

    def describe(self) -> str:
        return (f"{self.processes} process(es), {self.strategy}, {self.batch_size} per device x {self.accumulation} "
                f"accumulation x {self.replicas} replica(s) = {self.effective_batch}")

    @classmethod
    def of(cls, saved: Optional[Dict]) -> Optional["Layout"]:
        """A checkpoint's recorded layout (None for a checkpoint from before layouts were recorded)."""
        return cls(**saved) if saved else None


def resumed(saved: Layout, here: Layout, cfg, path: str, problems: Callable[[object], List[str]]) -> Tuple[object,
                                                                                                     List[str]]:
    """(``cfg`` with the per-device batch and accumulation that keep the checkpoint's effective batch on this
    layout, the plan's note about what changed) for a resume of a checkpoint of layout ``saved`` on ``here`` (its
    batch and accumulation the recipe's); ``problems(cfg)``: what the recipe's checks find in a candidate (a task
    may constrain the accumulation: online RL's generation steps divide it). Raises UserError where it cannot
    continue the same run."""
    if here == saved:
        return cfg, []
    moved = (here.processes, here.devices, here.replicas, here.strategy) != \
        (saved.processes, saved.devices, saved.replicas, saved.strategy)
    if moved and not (saved.portable and here.portable):
        raise UserError(f"checkpoint.resume: {path} holds DeepSpeed's or XLA's own checkpoint of {saved.describe()}, "
                        f"which only that layout loads; this launch is {here.describe()}: launch it as it was "
                        "trained to resume it, or choose a new output_dir=...")
    if moved and saved.streaming:
        raise UserError(f"data.streaming: {path} was trained on {saved.processes} process(es), each reading its own "
                        f"share of the stream, whose positions it holds; this launch has {here.processes}: resume it "
                        f"on {saved.processes}, or choose a new output_dir=...")
    adjusted = split(saved.effective_batch, here.replicas, cfg, problems)
    batch, accumulation = adjusted.train.batch_size, adjusted.train.gradient_accumulation_steps
    now = dataclasses.replace(here, batch_size=batch, accumulation=accumulation)
    changes = [f"train.{key} {old} -> {new}" for key, old, new in
               (("batch_size", here.batch_size, batch), ("gradient_accumulation_steps", here.accumulation, accumulation))
               if old != new]
    kept = f": {', '.join(changes)} keep its effective batch of {saved.effective_batch}" if changes else ""
    return adjusted, [f"resuming {saved.describe()} as {now.describe()}{kept}"]


def split(effective: int, replicas: int, cfg, problems: Callable[[object], List[str]]):
    """``cfg`` with a per-device batch and accumulation whose product over ``replicas`` is ``effective``: the
    recipe's per-device batch with another accumulation where that divides, else the largest per-device batch below
    the recipe's that does (a micro-batch's memory stays within the recipe's), the first the recipe's checks accept
    (``problems``). Length-grouped batches keep their size (their order depends on it)."""
    per_replica, left = divmod(effective, replicas)
    t, found = cfg.train, []
    sizes = [t.batch_size] if cfg.data.group_by_length else range(t.batch_size, 0, -1)
    for batch in sizes:
        accumulation, rest = divmod(per_replica, batch)
        if left or rest or accumulation < 1:
            continue
        candidate = dataclasses.replace(cfg, train=dataclasses.replace(t, batch_size=batch,
                                                                       gradient_accumulation_steps=accumulation))
        found = problems(candidate)
        if not found:
            return candidate
    because = f" ({found[0]})" if found else ""
    raise UserError(f"train.gradient_accumulation_steps: the checkpoint trained with an effective batch of {effective} "
                    f"examples per optimizer step, which {replicas} data-parallel replica(s) cannot split into whole "
                    f"micro-batches of at most {t.batch_size} (train.batch_size)"
                    + (" of that size (data.group_by_length)" if cfg.data.group_by_length else "") + because
                    + f"; {_fitting_counts(effective, t.batch_size if cfg.data.group_by_length else 1)}, or choose a "
                    "new output_dir=...")


def _fitting_counts(effective: int, batch: int) -> str:
    """The data-parallel replica counts that can continue an effective batch of ``effective`` in whole micro-batches
    of ``batch`` (1: any size), said as advice."""
    batches = effective // batch if effective % batch == 0 else 0
    counts = [str(n) for n in range(1, batches + 1) if batches % n == 0]
    if not counts:
        return f"no replica count can: its effective batch is not a multiple of train.batch_size {batch}"
    return f"launch {', '.join(counts[:8])}{' ...' if len(counts) > 8 else ''} data-parallel replica(s)"

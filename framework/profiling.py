"""``train.profile_steps: [START, END]``: a profiler trace of optimizer steps START to END, one per process, in
``output_dir/profile/`` (``backend.Trace``: torch.profiler's Chrome trace, torch_xla's profiler on XLA)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Callable, List, Optional

from framework import backend

FOLDER = "profile"


class StepProfiler:
    """Starts the trace when step START begins and writes it when step END is done (or when training ends first),
    each step a named range (``optimizer_step_N``). Tracing costs time: the steps traced run slower."""

    def __init__(self, accelerator, steps: Optional[List[int]], output_dir: Path, say: Callable[[str], None]):
        self.accelerator, self.steps, self.say = accelerator, steps, say
        self.folder = output_dir / FOLDER
        self.trace: Optional[backend.Trace] = None
        self.first = 0

    def after_step(self, done: int) -> None:
        """Call with the optimizer steps done: before the first step of this run, then after every step."""
        if self.steps is None:
            return
        start, end = self.steps
        if self.trace is None and start - 1 <= done < end:  # also a run resumed inside the window
            self.first = done + 1
            self.trace = backend.Trace(self.accelerator, self.folder,
                                      f"steps_{self.first}-{end}_rank{self.accelerator.process_index}")
        elif self.trace is not None and done >= end:
            self.close(done)

    def step(self, number: int):
        """Optimizer step ``number`` as a named range of the trace while tracing; else nothing."""
        return self.trace.range(f"optimizer_step_{number}") if self.trace is not None else nullcontext()

    def close(self, done: int) -> None:
        """End the trace (training ended, or step END is done) and write it."""
        if self.trace is None:
            return
        path, self.trace = self.trace.stop(), None
        self.say(f"profile of steps {self.first}-{done} written to {path}")

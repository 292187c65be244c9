"""Profiler traces: torch.profiler's, or torch_xla's on XLA."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from framework.backend.topology import on_xla

if TYPE_CHECKING:
    from accelerate import Accelerator


class Trace:
    """A profiler trace of this process, recording from its creation until ``stop()``, which writes it into
    ``folder`` and returns the Chrome trace written. torch.profiler (host ops, and CUDA kernels on a GPU) writes
    ``folder/name.json``; on XLA torch_xla's profiler writes the host and device timeline (tracing, compiling,
    the executed HLO ops) into ``folder/plugins/profile/<time>/``: ``<host>.xplane.pb`` for TensorBoard's profile
    plugin and ``<host>.trace.json.gz``, the Chrome trace."""

    def __init__(self, accelerator: Accelerator, folder: Path, name: str):
        self.folder, self.name, self.xla = folder, name, on_xla(accelerator)
        folder.mkdir(parents=True, exist_ok=True)
        if self.xla:
            import torch_xla.debug.profiler as xp

            xp.start_trace(str(folder))
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if accelerator.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.start()

    def range(self, name: str):
        """A named range on the trace's timeline (an optimizer step). Not on XLA: torch_xla's ranges must not
        hold a graph execution, and the step's graph runs when the next batch arrives."""
        return nullcontext() if self.xla else torch.profiler.record_function(name)

    def stop(self) -> Path:
        if self.xla:
            import torch_xla.debug.profiler as xp

            xp.stop_trace()
            return max(self.folder.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
        self.profiler.stop()
        path = self.folder / f"{self.name}.json"
        self.profiler.export_chrome_trace(str(path))
        return path


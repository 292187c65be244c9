"""XLA's compilations and host transfers, counted and watched during training."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Dict, Optional

from framework.backend.topology import on_xla

if TYPE_CHECKING:
    from accelerate import Accelerator


def xla_stats(accelerator: Accelerator) -> Optional[Dict[str, float]]:
    """Compilation and execution counters from torch_xla.debug.metrics; None off XLA."""
    if not on_xla(accelerator):
        return None
    compiles, compile_seconds = _xla_metric("CompileTime")
    executions, execute_seconds = _xla_metric("ExecuteTime")
    return {"compiles": compiles, "compile_seconds": compile_seconds, "executions": executions,
            "execute_seconds": execute_seconds, "transfers_to_host": _xla_metric("TransferFromDeviceTime")[0]}


def _xla_metric(name: str) -> tuple:
    """(count, total seconds) of a torch_xla timing metric; reading it touches no device."""
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return (data[0], data[1] / 1e9) if data else (0, 0.0)


class CompileWatch:
    """Warns once when XLA keeps compiling after the first steps: each compile stalls the run for seconds.
    Also counts the transfers to the host made inside training steps, outside the loop's deliberate host
    work (logging, evaluating, saving: ``host_work``); each is a stall that cuts the step's graph, and
    the count should stay 0."""

    def __init__(self, accelerator: Accelerator, expected: int):
        self.accelerator, self.expected = accelerator, expected
        self.last: Optional[int] = None
        self.warning: Optional[str] = None
        self.transfers_in_steps = 0
        self._mark: Optional[int] = None

    def begin(self) -> None:
        """Training starts: transfers count from here."""
        self._mark = self._transfers()

    def _transfers(self) -> Optional[int]:
        return _xla_metric("TransferFromDeviceTime")[0] if on_xla(self.accelerator) else None

    @contextmanager
    def host_work(self):
        """Wraps the loop's deliberate host reads; transfers between two such blocks happened in the steps."""
        count = self._transfers()
        if count is not None and self._mark is not None:
            self.transfers_in_steps += count - self._mark
        try:
            yield
        finally:
            self._mark = self._transfers()

    def check(self, step: int) -> Optional[str]:
        """Call at log points; returns the warning the first time it applies."""
        stats = xla_stats(self.accelerator)
        if stats is None or self.warning:
            return None
        grew = self.last is not None and stats["compiles"] > self.last
        self.last = stats["compiles"]
        if grew and stats["compiles"] > self.expected:
            self.warning = (f"XLA has compiled {stats['compiles']} graphs by step {step} and is still compiling "
                            f"(about {self.expected} expected): likely a new input shape each time (dynamic padding, "
                            "a varying batch size; see data.padding and data.pad_buckets) or a host sync inside "
                            "the step (.item(), printing a tensor, a Python branch on a tensor value)")
            return self.warning
        return None


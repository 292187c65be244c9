"""SIGTERM and SIGINT at any moment of a run. Kept free of heavy imports: the CLI installs the handlers
before it imports torch, so even a signal during start-up ends with one line."""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Optional


class Signals:
    """SIGTERM and SIGINT, for the whole run.

    Outside the training loop a signal stops the run at once: the handler raises ``Interrupted``, a
    BaseException so that no library's ``except Exception`` swallows it. Nothing is left half-written by
    that, since every output is written to a temporary name and renamed when complete. Inside the loop
    (``deferred()``) a signal only asks the loop to stop after the current optimizer step and save a
    checkpoint; a second signal then stops at once, unless it comes within ``SAME_REQUEST_S`` of the first: a
    launcher delivers one preemption several times (``scancel --signal=TERM`` signals every process of the job
    step, and then torchrun's agent, signalled too, sends TERM again to its workers; tests/test_slurm.py), and
    that echo must not cut short the checkpoint the first asked for. All processes must stop at the same step
    (saving is collective), so with several processes the request is combined across them (``any_process``).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    SAME_REQUEST_S = 2.0

    def __init__(self):
        self.signal: Optional[int] = None
        self._first_at = 0.0
        self._deferring = False
        self._previous = {}

    def __enter__(self) -> "Signals":
        # Python delivers signals to the main thread only; a launcher that runs main() in a worker thread
        # (torch_xla's spawn for one device) keeps them for itself.
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signal is None:
            self._first_at = now
        self.signal = signum
        if not (self._deferring and now - self._first_at < self.SAME_REQUEST_S):
            raise Interrupted(signum)

    @contextmanager
    def deferred(self):
        """Within this block a (first) signal waits for the loop to act on it."""
        installed = bool(self._previous)
        if not installed:  # used as a library, without the CLI's handlers
            self.__enter__()
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = False
            if not installed:
                self.__exit__()

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "no signal"


class Interrupted(BaseException):
    """A signal outside the training loop (loading, tokenizing, compiling, evaluating, saving)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

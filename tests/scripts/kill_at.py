"""Runs the real CLI and SIGKILLs its own process at micro-batch KILL_AT_MICRO (counted from the start of
this process, as calls of framework.step.Update.micro_batch: every task's step, supervised or not, goes through
it), to test resuming after a crash at an exact, chosen point (inside an accumulation window too).

KILL_SIGNAL (default SIGKILL) sends another signal instead: SIGSTOP freezes the process (a hung machine).
KILL_ONCE=PATH: only the first process to get there does it, leaving PATH behind (holding the time it did and its
pid): a worker restarted by an elastic launcher then trains on."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import framework.step  # noqa: E402
from run import main  # noqa: E402  (recipes/run.py: the default recipe too)

kill_at = int(os.environ["KILL_AT_MICRO"])
sig = getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL"))
once = os.environ.get("KILL_ONCE")
micro_batch = framework.step.Update.micro_batch
seen = 0


def micro_batch_then_maybe_die(*args):
    global seen
    loss_sum = micro_batch(*args)
    seen += 1
    if seen == kill_at:
        if once:
            try:
                with open(once, "x") as f:  # exclusive: the first process to get here, once
                    f.write(f"{time.time()!r} {os.getpid()}")
            except FileExistsError:
                return loss_sum
        os.kill(os.getpid(), sig)
    return loss_sum


framework.step.Update.micro_batch = micro_batch_then_maybe_die

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Runs the real CLI and SIGKILLs its own process at micro-batch KILL_AT_MICRO (counted from the start of
this process), to test resuming after a crash at an exact, chosen point (inside an accumulation window too)."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
from framework import train  # noqa: E402
from run import main  # noqa: E402  (recipes/run.py: the default recipe too)

kill_at = int(os.environ["KILL_AT_MICRO"])
add = train.LossWindow.add
seen = 0


def add_then_maybe_die(self, *args):
    global seen
    add(self, *args)
    seen += 1
    if seen == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)


train.LossWindow.add = add_then_maybe_die

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

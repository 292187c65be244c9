"""Runs the real CLI and sends SIGNAL (default SIGTERM) to its own process at the SIGNAL_CALL-th call
(default 1) of SIGNAL_AT ('module:Class.method' or 'module:function'), just before the call: a signal
arriving in that phase (loading, tokenizing, evaluating, saving the model ...)."""

import importlib
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
from run import main  # noqa: E402  (recipes/run.py: the default recipe too)

module_name, _, attr_path = os.environ["SIGNAL_AT"].partition(":")
owner = importlib.import_module(module_name)
*parents, name = attr_path.split(".")
for part in parents:
    owner = getattr(owner, part)
original = getattr(owner, name)
which = int(os.environ.get("SIGNAL_CALL", "1"))
sig = getattr(signal, os.environ.get("SIGNAL", "SIGTERM"))
calls = 0


def signalled(*args, **kwargs):
    global calls
    calls += 1
    if calls == which:
        print(f"signal_at: sending {sig.name} at {os.environ['SIGNAL_AT']}", flush=True)
        os.kill(os.getpid(), sig)
    return original(*args, **kwargs)


setattr(owner, name, signalled)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

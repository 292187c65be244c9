"""Runs the real CLI and sends SIGNAL (default SIGTERM) to its own process at the SIGNAL_CALL-th call
(default 1) of SIGNAL_AT ('module:Class.method' or 'module:function'), just before the call: a signal
arriving in that phase (loading, tokenizing, evaluating, saving the model ...). SIGNAL_AT='import:MODULE' sends it
when MODULE starts being imported (the CLI's own imports of torch, its first heavy one), once."""

import importlib
import importlib.abc
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
from run import main  # noqa: E402  (recipes/run.py: the default recipe too)

where = os.environ["SIGNAL_AT"]
which = int(os.environ.get("SIGNAL_CALL", "1"))
sig = getattr(signal, os.environ.get("SIGNAL", "SIGTERM"))
calls = 0


def send() -> None:
    print(f"signal_at: sending {sig.name} at {where}", flush=True)
    os.kill(os.getpid(), sig)


class SignalOnImport(importlib.abc.MetaPathFinder):
    """Sends the signal when the module is first looked for, then finds nothing (the usual finders go on)."""

    def __init__(self, module: str):
        self.module, self.sent = module, False

    def find_spec(self, name, path=None, target=None):
        if name == self.module and not self.sent:
            self.sent = True
            send()
        return None


if where.startswith("import:"):
    sys.meta_path.insert(0, SignalOnImport(where.partition(":")[2]))
else:
    module_name, _, attr_path = where.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = attr_path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    original = getattr(owner, name)

    def signalled(*args, **kwargs):
        global calls
        calls += 1
        if calls == which:
            send()
        return original(*args, **kwargs)

    setattr(owner, name, signalled)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

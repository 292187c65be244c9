"""Faults injected into a real run at a chosen point: a signal, the disk filling up, the output folder turning
read-only or vanishing. A fault is ``KIND@POINT:N``: do KIND right after the N-th call (counted from 1 in this
process) of the run's function at POINT. In this process (``inject``, the harness's in-process runs) or in a run of
tests/scripts/fault_at.py (``FAULT=KIND@POINT:N``, for SIGKILL, which needs a process of its own).

Points:
- ``micro``: a micro-batch's forward and backward (``framework.step.Update.micro_batch``, every task's step);
- ``log``: a line of metrics.jsonl written (``Reporter.log``);
- ``save``: inside a checkpoint's write, the state files written into its temporary folder but the manifest and
  the rename not yet done (``framework.backend.save_states``);
- ``eval``: an evaluation (``framework.train.evaluate``; the last one comes before model/ and summary.json).

Kinds: ``SIGKILL``, ``SIGTERM``; ``fill=R`` (a ballast file on the small filesystem ``disk`` leaves R bytes
free); ``readonly`` (``disk`` remounted read-only); ``vanish`` (the run's output_dir removed); ``nan`` (at
``micro`` only: the first weight of this process's shard made NaN, as a corrupted update would leave it; under
ZeRO-3 that is its partition, ``ds_tensor``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

BALLAST = ".ballast"
POINTS = {"micro": ("framework.step", "Update.micro_batch"), "log": ("framework.report", "Reporter.log"),
          "save": ("framework.backend", "save_states"), "eval": ("framework.train", "evaluate")}


def parse(fault: str) -> tuple:
    """``KIND@POINT:N`` -> (kind, point, n)."""
    kind, rest = fault.split("@")
    point, n = rest.split(":")
    assert point in POINTS, point
    return kind, point, int(n)


def act(kind: str, disk: Path, output_dir: Path, args: tuple = ()) -> None:
    """Do the fault; ``args``: those of the call it follows."""
    if kind in ("SIGKILL", "SIGTERM"):
        os.kill(os.getpid(), getattr(signal, kind))
    elif kind.startswith("fill="):
        leave = int(kind.split("=")[1])
        room = shutil.disk_usage(disk).free - leave
        if room > 0:
            with (disk / BALLAST).open("ab") as f:
                f.write(b"\0" * room)
    elif kind == "readonly":
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    elif kind == "vanish":
        shutil.rmtree(output_dir)
    elif kind == "nan":
        import torch

        weight = next(args[0].model.parameters())  # Update.micro_batch(self, ...)
        with torch.no_grad():
            getattr(weight, "ds_tensor", weight).view(-1)[0] = float("nan")
    else:
        raise ValueError(kind)


def _target(point: str):
    import importlib

    module_name, attr = POINTS[point]
    owner = importlib.import_module(module_name)
    for part in attr.split(".")[:-1]:
        owner = getattr(owner, part)
    return owner, attr.split(".")[-1]


def install(fault: str, disk: Path, output_dir: Path, setattr_=setattr) -> None:
    """Wrap POINT's function so that its N-th call is followed by the fault. ``setattr_``: a monkeypatch's, to undo."""
    kind, point, n = parse(fault)
    owner, name = _target(point)
    original = getattr(owner, name)
    calls = [0]

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == n:
            act(kind, disk, output_dir, args)
        return result

    setattr_(owner, name, wrapped)


@contextmanager
def small_disk(folder: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``folder`` (root only): a disk that really fills up."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True,
                   capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def restore(disk: Path) -> None:
    """Space and writes again: read-write, the ballast gone."""
    subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
    (disk / BALLAST).unlink(missing_ok=True)


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None

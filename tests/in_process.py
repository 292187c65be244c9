"""Runs of the real CLI inside the test process (``framework.cli.main``): no interpreter start-up and no
imports per run, so a run of the tiny model costs about a second. Use the ``cli`` fixture instead where the
process boundary is what is tested (launchers, signals, a cache reused by a later process)."""

from __future__ import annotations

import functools
import importlib.util
import io
import os
import subprocess
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Iterator, List


@contextmanager
def fresh_process(hf_home: Path) -> Iterator[None]:
    """What a new process would start with: no accelerate state left by an earlier run in this process, and
    the session's datasets cache (the one the ``cli`` fixture's subprocesses use through HF_HOME) instead of
    the user's. The environment variables a run sets (the backend switch) are put back afterwards."""
    import datasets.config
    from accelerate.state import AcceleratorState, GradientState

    cache = Path(hf_home) / "datasets"
    paths = {"HF_DATASETS_CACHE": cache, "DOWNLOADED_DATASETS_PATH": cache / "downloads",
             "EXTRACTED_DATASETS_PATH": cache / "downloads" / "extracted"}
    saved_paths = {name: getattr(datasets.config, name) for name in paths}
    saved_env = dict(os.environ)
    for name, path in paths.items():
        setattr(datasets.config, name, path)

    def reset() -> None:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset()
    try:
        yield
    finally:
        reset()
        for name, path in saved_paths.items():
            setattr(datasets.config, name, path)
        for name in set(os.environ) - set(saved_env):
            del os.environ[name]
        os.environ.update(saved_env)


@functools.lru_cache(maxsize=None)
def default_recipe() -> Path:
    """recipes/run.py's default recipe (the one it trains when no --config is given)."""
    spec = importlib.util.spec_from_file_location("run", Path(__file__).resolve().parents[1] / "recipes" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    return run.DEFAULT_RECIPE


def run_main(args: List[str], hf_home: Path) -> int:
    """``run.py ARGS`` in this process; returns the exit status."""
    from framework.cli import main

    with fresh_process(hf_home):
        return main(list(args), default_recipe=default_recipe())


def train_ok(args: List[str], hf_home: Path) -> None:
    """``run.py ARGS`` in this process, which must succeed: a baseline run whose process boundary is not what a
    test is about (a subprocess of its own costs about 4 s more here: its imports and start-up)."""
    assert run_main(args, hf_home) == 0, args


def run_captured(args: List[str], hf_home: Path) -> subprocess.CompletedProcess:
    """``run.py ARGS`` in this process, its output captured as a subprocess's would be (returncode, stdout,
    stderr): where a later run of the same command needs no process of its own (a resume after a kill)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = run_main(args, hf_home)
    return subprocess.CompletedProcess(list(args), status, out.getvalue(), err.getvalue())

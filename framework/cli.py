"""Command line: ``run.py [--config RECIPE] [--print-config] [--dry-run] [--help-keys [SECTION]] [KEY=VALUE ...]``.

The entry point, and the one module that stages its imports: at module level only what is light (the signal
handlers among it), so that the handlers are installed before torch and the tasks are imported: a signal during
start-up then ends with one line and the shell's status, not a traceback from inside an import."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

from framework.disk import WriteFailed
from framework.errors import UserError
from framework.signals import Interrupted, Signals

EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 3  # stopped by SIGTERM/SIGINT with a checkpoint to resume from: the same command resumes
EXIT_DIVERGED = 4  # the loss or a weight stopped being finite: stopped before writing anything from it
EXIT_WRITE_FAILED = 5  # an output could not be written (no space, read-only, output_dir gone): nothing complete lost
# Stopped by a signal with nothing to resume from yet: 128 + the signal's number (130 SIGINT, 143 SIGTERM),
# the shell's convention; the same command starts over.


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints its usage and exits; the CLI says one line instead
        raise UserError(f"{message}; usage: {self.format_usage().strip().removeprefix('usage: ')}")


def parse_args(argv: List[str]) -> argparse.Namespace:
    """Options may come anywhere among the KEY=VALUE overrides (``run.py seed=1 --dry-run``)."""
    parser = _Parser(
        prog="run.py",
        description="Train from a YAML recipe. KEY=VALUE pairs override recipe keys, e.g. train.batch_size=16.",
    )
    parser.add_argument("--config", help="recipe YAML (default: recipes/text_classification.yaml)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate, load data and model, print the plan, and exit without training")
    parser.add_argument("--help-keys", nargs="?", const="", metavar="SECTION",
                        help="print every recipe key (or one section's) with its type, default and meaning, and exit")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return parser.parse_intermixed_args(argv)


def main(argv: Optional[List[str]] = None, default_recipe: Optional[Path] = None) -> int:
    """Run one training process; returns the exit status: 0 done, 2 user error, 3 stopped by SIGTERM/SIGINT
    with a checkpoint to resume from (the same command resumes), 4 diverged (a non-finite loss or weight), 5 an
    output could not be written (no space, read-only, vanished), 128 + signal number when stopped before there
    was one."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    cfg = None
    # Installed before the heavy imports, so a signal at any moment ends with one line.
    with Signals() as signals:
        try:
            if args.help_keys is not None:
                return _help_keys(args.help_keys)
            with _imports_uncollected():
                from framework.config import to_yaml
                from framework.recipe import load_config

                cfg = load_config(args.config or default_recipe, args.overrides)
                if args.print_config:
                    print(to_yaml(cfg), end="")
                    return 0
                from framework import backend

                backend.select_backend(cfg)  # before anything imports accelerate
                from framework.health import Diverged
                from framework.checkpoint import Preempted
                from framework.train import train
            try:
                train(cfg, dry_run=args.dry_run, signals=signals)
            except Preempted as e:
                _say(f"preempted: {e}")
                return EXIT_PREEMPTED
            except Diverged as e:
                _say(f"diverged: {e}. Nothing was written from it: the checkpoints saved before stay, model/ is not "
                     "written. Lower optim.lr or set train.max_grad_norm and start again in a new output_dir (the "
                     "same recipe resumed diverges again)")
                return EXIT_DIVERGED
            except WriteFailed as e:
                _say(f"write failed: {e}. Nothing complete was lost; make room (or make the folder writable "
                     f"again) and run the same command: {_next_start(cfg)}", every_process=True)
                return EXIT_WRITE_FAILED
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
        except Interrupted as e:
            return _stopped(cfg, signals, e.signum)
    return 0


@contextmanager
def _imports_uncollected():
    """The imports of torch, transformers, accelerate and datasets without the cyclic garbage collector, which then
    leaves everything they made out of its later scans (``gc.freeze``, once per process). They make about 360,000
    objects that live as long as the process and that every full collection walked: 0.18 s each, 0.65 s of the
    3.3 s of imports (gc off against on) and 0.26 s of a tiny model's 0.68 s run in one process (0.43 s frozen),
    measured alone. Objects made later are collected as before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
    if not gc.get_freeze_count():  # later runs in the same process (tests, one launch of several runs) keep theirs
        gc.freeze()


def _help_keys(section: str) -> int:
    from framework import keys

    try:
        print(keys.render(keys.select(keys.recipe_sections(), section)).lstrip("\n"), end="")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


def _stopped(cfg, signals: Signals, signum: int) -> int:
    """A signal outside the training loop: say whether the same command resumes (exit 3) or starts over."""
    resume_from = None
    if cfg is not None:  # a recipe was read: its output_dir may hold a checkpoint
        try:
            from framework.checkpoint import start_point

            resume_from = start_point(cfg).resume_from
        except (UserError, Interrupted):
            pass
    if resume_from is not None:
        _say(f"stopped by {signals.name}; run the same command again to resume from {resume_from}")
        return EXIT_PREEMPTED
    _say(f"stopped by {signals.name} before the first checkpoint; nothing to resume, the same command starts over")
    return 128 + signum


def _next_start(cfg) -> str:
    from framework.checkpoint import newest_complete

    newest = newest_complete(Path(cfg.output_dir) / "checkpoints")[0]
    return f"it resumes from {newest}" if newest else "it starts over (no checkpoint was saved yet)"


def _say(line: str, every_process: bool = False) -> None:
    """One line on stderr, from the first process only (every process gets the signal); ``every_process``: from
    any that says it (a write that failed on another process only: its shard of a checkpoint), others' lines
    prefixed with their rank."""
    rank = os.environ.get("RANK", "0")
    if rank == "0" or every_process:
        print(line if rank == "0" else f"[process {rank}] {line}", file=sys.stderr, flush=True)

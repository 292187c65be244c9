"""Command line: ``run.py [--config RECIPE] [--print-config] [--dry-run] [KEY=VALUE ...]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from framework.config import load_config, to_yaml
from framework.errors import UserError

EXIT_USER_ERROR = 2


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="run.py",
        description="Train from a YAML recipe. KEY=VALUE pairs override recipe keys, e.g. train.batch_size=16.",
    )
    parser.add_argument("--config", help="recipe YAML (default: recipes/text_classification.yaml)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate, load data and model, print the plan, and exit without training")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None, default_recipe: Optional[Path] = None) -> int:
    """Run one training process; returns the exit status: 0 done, 2 user error, 3 preempted (a checkpoint
    was saved on SIGTERM/SIGINT; the same command resumes)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config or default_recipe, args.overrides)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        from framework import device

        device.select_backend(cfg)  # before anything imports accelerate
        from framework.checkpoint import EXIT_PREEMPTED, Preempted  # heavy imports only when training
        from framework.train import train

        try:
            train(cfg, dry_run=args.dry_run)
        except Preempted as e:
            print(f"preempted: {e}", file=sys.stderr, flush=True)
            return EXIT_PREEMPTED
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0

"""lm-evaluation-harness on a finished run's model, or on any model folder:

    python -m framework.evaluate RUN_OR_MODEL --tasks rt_sentiment,hamlet_next_line [--limit N] [--num-fewshot K]

RUN_OR_MODEL: a run's ``output_dir`` (its ``model/`` is evaluated) or a folder ``save_pretrained`` wrote: a causal
LM, or a peft adapter (``adapter_config.json``; its base model must be loadable). The results go to
``RUN_OR_MODEL/harness.json`` (or ``--out``), nothing else is written; bad input exits 2 with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from framework.config import HarnessConfig
from framework.errors import UserError
from framework.harness import Harness, format_result
from framework.disk import write_json
from framework.tasks.language import check_causal

RESULT = "harness.json"


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m framework.evaluate",
                                     description="Score a run's model (or a model folder) with lm-evaluation-harness.")
    parser.add_argument("path", type=Path, metavar="RUN_OR_MODEL", help="a run's output_dir, or a model folder")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated lm-eval task names, e.g. rt_sentiment,hamlet_next_line")
    parser.add_argument("--num-fewshot", type=_count, help="examples before each question (default: each task's)")
    parser.add_argument("--limit", type=_positive, help="score at most this many examples of each task")
    parser.add_argument("--batch-size", type=_positive, default=8, help="requests per forward pass (default 8)")
    parser.add_argument("--include-path", action="append", default=[], metavar="FOLDER",
                        help="a folder of lm-eval task YAML files (repeatable)")
    parser.add_argument("--out", type=Path, help=f"where the results go (default RUN_OR_MODEL/{RESULT})")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier result file")
    parser.add_argument("--seed", type=int, default=42, help="few-shot examples' sampling seed (default 42)")
    return parser.parse_args(argv)


def locate(path: Path) -> Tuple[Path, str]:
    """(the model folder, what it holds: 'model' or 'adapter') of a run's output_dir or a model folder."""
    folder = path / "model" if (path / "model").is_dir() else path
    if (folder / "config.json").is_file():
        return folder, "model"
    if (folder / "adapter_config.json").is_file():
        return folder, "adapter"
    if not path.exists():
        raise UserError(f"{path} does not exist (relative paths start at {Path.cwd()}); pass a run's output_dir or "
                        "a model folder")
    raise UserError(f"{path} holds no model (no model/, config.json or adapter_config.json): pass a finished run's "
                    "output_dir or a folder written by save_pretrained")


def load(folder: Path, kind: str):
    """(model, tokenizer) on this machine's default device, in eval mode."""
    from accelerate import PartialState
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        if kind == "adapter":
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(folder)
        else:
            check_causal(AutoConfig.from_pretrained(folder), f"{folder}")
            model = AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise UserError(f"{folder}: cannot load a causal language model and its tokenizer: "
                        f"{str(e).splitlines()[0]}") from None
    if tokenizer.pad_token is None:  # as the causal_lm task trains it: padding reuses EOS, never a target
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(PartialState().device).eval(), tokenizer


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        folder, kind = locate(args.path)
        out = args.out or args.path / RESULT
        if out.exists() and not args.overwrite:
            raise UserError(f"{out} exists (an earlier evaluation); pass --out another file, or --overwrite")
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        if not tasks:
            raise UserError("--tasks: name at least one lm-eval task, e.g. --tasks rt_sentiment")
        harness = Harness(HarnessConfig(tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
                                        batch_size=args.batch_size, include_path=args.include_path),
                          args.seed, keys=("--tasks", "--include-path"))
        model, tokenizer = load(folder, kind)
        result = harness.evaluate(model, tokenizer)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    write_json(out, {"model": str(folder), **result})
    print(format_result(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

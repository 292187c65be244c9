"""Tokens per second of the causal-LM recipe: the framework vs a raw accelerate loop and transformers.Trainer.

    .venv/bin/python benchmarks/compare_lm.py [--steps 30] [--warmup-steps 5] [--rounds 5] [--threads N]
        [--device cpu|gpu] [--raw-nomask] [--set KEY=VALUE ...] [--json results.json]

The default LM recipe (``recipes/examples/causal_lm_from_scratch.yaml``: a 4-layer GPT-2, n_embd 128, from scratch, on Hamlet in
packed 128-token blocks with the GPT-2 BPE, batch 16, AdamW lr 2e-3, betas (0.9, 0.95), weight decay 0.1,
cosine schedule with 5% warmup, clipping at 1.0) trained for the same number of optimizer steps
(``--warmup-steps`` + ``--steps``) by three sides, each in its own process:

- framework: the real CLI, ``python recipes/run.py --config recipes/examples/causal_lm_from_scratch.yaml train.max_steps=N
  output_dir=DIR`` plus ``eval.every_steps`` beyond the run and ``checkpoint.every_minutes=null``: a run of
  more than one epoch (Hamlet makes 22 steps) would otherwise evaluate at every epoch's end, and save
  a checkpoint every 2 minutes, inside the measured steps. It still evaluates once at the end, saves the
  model and generates its 24-token sample (in total wall, not in the steady window);
- raw: ``compare_lm.py --side raw``, a minimal hand-written accelerate loop, nanoGPT-style: the framework's
  packed blocks (``run_data``, as setup reads them) in the same seeded order, the framework's forward
  (the causal_lm run's ``forward``: the 4D block-diagonal document mask and restarting position_ids),
  the summed token cross-entropy divided by the step's target count, backward, clip, step, schedule,
  zero_grad. Nothing after the last step;
- Trainer: ``compare_lm.py --side Trainer``, ``transformers.Trainer`` as a user gets it:
  ``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` on the same packed blocks (input_ids only, so it
  attends across documents and, pad being EOS, does not train on EOS targets), pad = eos, TrainingArguments'
  own defaults (``adamw_torch_fused``, decay on all but biases and LayerNorm, logging every 500 steps, the
  NaN/inf loss filter, a checkpoint at the end of training, no eval) with the recipe's hyperparameters and
  ``max_steps``, and one departure: ``dataloader_drop_last=True``, so that every step trains on a full batch
  across epoch ends, as on the other two sides (the same tokens per step).

Optionally (``--raw-nomask``), ``raw_nomask``: the raw loop with plain causal attention (input_ids only,
the same labels and loss), for information: what the document mask costs. No target on it.

Same work: all sides read the recipe and ``--set`` overrides through the framework's config loader, train
on the framework's packed blocks, shuffled by accelerate's seedable sampler from the recipe seed (the same
batches in the same order on all three), with the same AdamW (the recipe's lr, betas, eps and weight decay,
none on biases and LayerNorm, torch's fused kernel as ``framework.optim._kernel`` picks it) and the same
cosine schedule; the probe records each side's optimizer and the output says whether they match. All use
the same number of CPU threads: ``--threads N`` (default: the cores this process may run on, the
framework's own ``auto``), as OMP_NUM_THREADS for all and ``train.cpu_threads`` for the framework; the
probe records ``torch.get_num_threads()``.

Measurement, as in compare_loops.py (its Bench runs the processes, its probe is loaded into each): the
probe records the end of every optimizer step from outside the scripts. Steady tokens/s: steps
``warmup+1 .. warmup+steps`` x batch x block over the window from the end of step ``warmup`` to the end of
the last step; also from the median step, and per CPU second. Time to first step: launch to the end of
step 1. Total wall: launch to exit (each side's final work included: see above). Peak RSS: the child's,
from ``os.wait4`` (the CUDA allocator's peak with ``--device gpu``). For the framework, its own logged
throughput (metrics.jsonl ``samples_per_second`` x block over the log windows after warm-up) is given as a
cross-check. One unmeasured warm-up run per side (2 steps) first fills the datasets and OS caches; then
rounds run the sides in turn; ratios are the median over rounds of the ratio within a round. Targets:
framework/raw steady tokens/s >= 0.99 and framework/Trainer > 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar, Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LM_RECIPE = ROOT / "recipes" / "examples" / "causal_lm_from_scratch.yaml"
FAR = 10 ** 9  # a step count beyond any run: eval.every_steps that never comes


# ---------------------------------------------------------------- the raw and Trainer sides (children)


def raw_side(cfg, document_mask: bool) -> None:
    """The raw accelerate loop: ``train.max_steps`` optimizer steps, over as many epochs as that takes."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    from common import adamw, load_data_and_model
    from framework.tasks import get_task
    from framework.tasks.causal_lm import PackedCollator


    t, o = cfg.train, cfg.optim
    # The seedable sampler, as the framework and the Trainer: the same shuffle on all three sides.
    accelerator = Accelerator(cpu=cfg.backend == "cpu",
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    tokenizer, model, train_ds, _ = load_data_and_model(cfg)
    task = get_task("causal_lm").bind(cfg, model, None)
    # Its own generator, as the framework's: iterating the loader then draws no seed from the global RNG,
    # so the dropout masks follow the framework's.
    train_dl = DataLoader(train_ds, batch_size=t.batch_size, shuffle=True, drop_last=True, collate_fn=PackedCollator(),
                          generator=torch.Generator().manual_seed(cfg.seed))
    model = model.to(accelerator.device)
    optimizer = adamw(model, o, accelerator.device.type)
    warmup = o.warmup_steps if o.warmup_steps is not None else math.ceil(o.warmup_ratio * t.max_steps)
    scheduler = get_scheduler(o.scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=t.max_steps)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)

    model.train()
    step, epoch = 0, 0
    while step < t.max_steps:
        train_dl.set_epoch(epoch)
        for batch in train_dl:
            if document_mask:
                logits, targets = task.forward(model, batch)  # full logits, as a hand-written loop has them
            else:  # plain causal attention over the whole block (an all-ones 2D mask, as the Trainer's collator)
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
                targets = batch["labels"][:, 1:]
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                   reduction="sum") / (targets != -100).sum()
            accelerator.backward(loss)
            if t.max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step == t.max_steps:
                break
        epoch += 1
    accelerator.print(f"raw: {step} steps, last loss {loss.item():.4f}")


def trainer_side(cfg) -> None:
    """transformers.Trainer on its defaults, with the recipe's hyperparameters and the packed blocks."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from common import load_data_and_model, recipe_training_args

    tokenizer, model, train_ds, _ = load_data_and_model(cfg)
    task = get_task("causal_lm").bind(cfg, model, None)
    if tokenizer.pad_token is None:  # GPT-2 has none: what users do (the framework's task has done it already)
        tokenizer.pad_token = tokenizer.eos_token
    # train.max_steps is set (side_main checks it), so it is the max_steps of recipe_training_args. The one
    # departure from the defaults: full batches at every step, across epoch ends, as on the other sides.
    args = TrainingArguments(**recipe_training_args(cfg), dataloader_drop_last=True)
    trainer = Trainer(model=model, args=args, train_dataset=train_ds.select_columns(["input_ids"]),
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), processing_class=tokenizer)
    trained = trainer.train()
    print(f"Trainer: {trained.global_step} steps, {trained.metrics}")


def side_main(side: str, argv: List[str]) -> None:
    """A child: ``compare_lm.py --side raw|raw_nomask|Trainer [--config RECIPE] KEY=VALUE...``."""
    sys.argv = [sys.argv[0], *argv]
    from common import read_recipe

    cfg = read_recipe(loop_only=False)
    if cfg.task != "causal_lm" or cfg.data.packing is False:
        sys.exit("compare_lm.py measures the causal_lm task with packing")
    if cfg.precision != "no" or cfg.optim.name != "adamw" or cfg.optim.param_groups or not cfg.train.max_steps:
        sys.exit("the raw and Trainer sides mirror fp32 training with plain AdamW for train.max_steps steps")
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)  # the parent removes it after the run
    if side == "Trainer":
        trainer_side(cfg)
    else:
        if cfg.train.gradient_accumulation_steps != 1:
            sys.exit("the raw loop does not accumulate gradients")
        raw_side(cfg, document_mask=side == "raw")


# ---------------------------------------------------------------- the parent


def _parent_imports():
    """compare_loops.py's process runner, probe helpers, statistics and machine description (imported by the
    parent only)."""
    global Bench, Case, Finished, RUN, add_device_and_threads, child_env, machine, medians, paired, probe_env, \
        probe_lines, probe_measure
    from compare_loops import (RUN, Bench, Case, Finished, add_device_and_threads, child_env,  # noqa: F401
                               machine, medians, paired, probe_env, probe_lines, probe_measure)


@dataclass
class LMCase:
    """The three (or four) sides on the LM recipe, with the interface of compare_loops.Case (which Bench runs)."""
    name: str
    title: str
    overrides: List[str]  # --set, for every side
    steps: int  # optimizer steps per run: warm-up + measured
    skip: int  # the warm-up steps, left out of the steady window
    batch: int
    block: int
    threads: int
    raw_nomask: bool = False
    loops: Dict[str, List[str]] = field(default_factory=dict)

    SIDES: ClassVar[Dict[str, str]] = {
        "raw": "hand-written accelerate loop, the framework's forward with the document mask",
        "framework": "recipes/run.py, the real CLI",
        "Trainer": "transformers.Trainer on its defaults, DataCollatorForLanguageModeling(mlm=False)",
        "raw_nomask": "the raw loop with plain causal attention (information only)",
    }
    METRICS: ClassVar[List[str]] = [
        "time_to_first_step_s", "steady_tokens_per_s", "median_step_tokens_per_s", "tokens_per_cpu_s",
        "total_wall_s", "peak_memory_mib", "first_loss", "last_loss"]
    TARGETS: ClassVar[Dict[str, tuple]] = {  # name -> (ratio, threshold, strict)
        "framework/raw steady tokens/s >= 0.99": ("framework/raw", 0.99, False),
        "framework/Trainer steady tokens/s > 1": ("framework/Trainer", 1.0, True),
    }

    def __post_init__(self):
        me = [sys.executable, str(Path(__file__).resolve())]
        self.loops = {"raw": [*me, "--side", "raw"], "framework": [sys.executable, str(RUN)],
                      "Trainer": [*me, "--side", "Trainer"]}
        if self.raw_nomask:
            self.loops["raw_nomask"] = [*me, "--side", "raw_nomask"]

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.block

    def command(self, loop: str, device: str, output_dir: Path, steps: Optional[int]) -> List[str]:
        return [*self.loops[loop], "--config", str(LM_RECIPE), f"backend={device}", f"output_dir={output_dir}",
                f"train.max_steps={steps}", f"train.cpu_threads={self.threads}",
                # No evaluation at epoch ends and no timed checkpoints inside the measured steps (the
                # framework still evaluates, saves and samples once, after the last step).
                f"eval.every_steps={FAR}", "checkpoint.every_minutes=null", *self.overrides]

    def env(self, base: Dict[str, str], probe_file: Optional[Path], steps: Optional[int]) -> Dict[str, str]:
        return probe_env(base, probe_file, steps, self.skip)

    def measure(self, loop: str, steps: Optional[int], device: str, done: Finished) -> Dict:
        result = probe_measure(loop, steps, device, done, self.skip, "tokens", self.tokens_per_step, sides="sides")
        if loop == "framework":
            result["logged_tokens_per_s"] = self.logged_tokens_per_s(done.output_dir / "metrics.jsonl")
        return result

    def logged_tokens_per_s(self, metrics: Path) -> Optional[float]:
        """The framework's own throughput: its log windows that start after the warm-up steps, pooled."""
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        records = [r for r in records if "samples_per_second" in r]
        steps = seconds = 0.0
        for before, r in zip([{"step": 0}] + records, records):
            if before["step"] >= self.skip:
                n = r["step"] - before["step"]
                steps, seconds = steps + n, seconds + n * self.batch / r["samples_per_second"]
        return steps * self.tokens_per_step / seconds if seconds else None

    def summarize(self, runs: List[Dict]) -> Dict:
        per_loop = medians(runs, self.loops, self.METRICS)
        logged = [r["logged_tokens_per_s"] for r in runs if r.get("logged_tokens_per_s")]
        if logged:
            per_loop["framework"]["logged_tokens_per_s"] = statistics.median(logged)
        ratios = {f"framework/{other}": {
            "steady_tokens_per_s": paired(runs, "steady_tokens_per_s", "framework", other),
            "median_step_tokens_per_s": paired(runs, "median_step_tokens_per_s", "framework", other),
            "tokens_per_cpu_s": paired(runs, "tokens_per_cpu_s", "framework", other),
            "time_to_first_step": paired(runs, "time_to_first_step_s", "framework", other),
            "total_wall": paired(runs, "total_wall_s", "framework", other),
            "peak_memory": paired(runs, "peak_memory_mib", "framework", other),
        } for other in self.loops if other != "framework"}
        targets = {}
        for name, (ratio, threshold, strict) in self.TARGETS.items():
            value = ratios[ratio]["steady_tokens_per_s"]
            targets[name] = value > threshold if strict else value >= threshold
        compared = [r for r in runs if r["loop"] != "raw_nomask"]  # the same optimizer everywhere
        optimizers = {json.dumps(r["optimizer"], sort_keys=True) for r in compared}
        return {"medians": per_loop, "ratios": ratios, "targets": targets,
                "same_optimizer": len(optimizers) == 1, "same_threads": len({r["threads"] for r in runs}) == 1}

    def markdown(self, runs: List[Dict], summary: Dict) -> str:
        rounds = len(runs) // len(self.loops)
        m = summary["medians"]
        lines = [f"## {self.title}", "",
                 f"{self.steps} optimizer steps per run ({self.skip} warm-up + {self.steps - self.skip} measured) x "
                 f"batch {self.batch} x block {self.block} = {self.tokens_per_step} tokens per step; "
                 f"{self.threads} CPU thread(s) per process; medians of {rounds} round(s)."
                 + (f" Overrides on every side: {' '.join(self.overrides)}." if self.overrides else ""), "",
                 "| side | time to first step (s) | steady tokens/s | median-step tokens/s | tokens per CPU s "
                 "| total wall (s) | peak memory (MiB) | first loss | last loss |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {loop} | {v['time_to_first_step_s']:.2f} | {v['steady_tokens_per_s']:.0f} | "
                  f"{v['median_step_tokens_per_s']:.0f} | {v['tokens_per_cpu_s']:.0f} | {v['total_wall_s']:.1f} | "
                  f"{v['peak_memory_mib']:.0f} | {v['first_loss']:.4f} | {v['last_loss']:.4f} |"
                  for loop, v in m.items()]
        lines += ["", "Sides: " + "; ".join(f"{loop}: {self.SIDES[loop]}" for loop in self.loops) + ". Total wall "
                  "includes each side's work after the last step: the framework's eval pass, model save and "
                  "sample; the Trainer's end-of-training checkpoint (model and optimizer); nothing for raw.", "",
                  "Ratios framework / side: the median over the rounds of each round's ratio (for tokens/s, above 1: "
                  "the framework is faster; for time, wall and memory, below 1: the framework is quicker or lighter).",
                  "", "| ratio | steady tokens/s | median-step tokens/s | tokens per CPU s | time to first step "
                  "| total wall | peak memory |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {name} | {r['steady_tokens_per_s']:.3f} | {r['median_step_tokens_per_s']:.3f} | "
                  f"{r['tokens_per_cpu_s']:.3f} | {r['time_to_first_step']:.3f} | {r['total_wall']:.3f} | "
                  f"{r['peak_memory']:.3f} |" for name, r in summary["ratios"].items()]
        if "logged_tokens_per_s" in m["framework"]:
            lines += ["", f"Cross-check, the framework's own log (metrics.jsonl windows after step {self.skip}): "
                      f"{m['framework']['logged_tokens_per_s']:.0f} tokens/s (median over runs)."]
        compared = [r for r in runs[:len(self.loops)] if r["loop"] != "raw_nomask"]
        if summary["same_optimizer"]:
            lines += ["", f"Optimizer, the same on every side: {json.dumps(compared[0]['optimizer'])}."]
        else:
            lines += ["", "WARNING: the sides' optimizers differ: " + "; ".join(
                f"{r['loop']} {json.dumps(r['optimizer'])}" for r in compared) + "."]
        lines += probe_lines(runs, summary, self.loops, sides="sides", unit="tokens", digits=0)
        return "\n".join(lines)


def main() -> None:
    _parent_imports()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="measured optimizer steps per run (default 30)")
    parser.add_argument("--warmup-steps", type=int, default=5,
                        help="optimizer steps before the measured ones, left out of steady tokens/s (default 5)")
    parser.add_argument("--rounds", "--repeats", type=int, default=5,
                        help="measured runs per side, the sides alternating in each round (default 5)")
    add_device_and_threads(parser, "CPU threads per training process, on every side (default: the cores this "
                                   "process may run on, the framework's auto)")
    parser.add_argument("--raw-nomask", action="store_true",
                        help="also run the raw loop without the document mask (information only)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="a recipe override for every side (after this script's own)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()
    if args.steps < 2 or args.warmup_steps < 1 or args.rounds < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--steps must be at least 2, --warmup-steps, --rounds and --threads at least 1")
    if any("=" not in override for override in args.overrides):
        parser.error("--set takes KEY=VALUE")

    sys.path.insert(0, str(ROOT))
    from framework.recipe import load_config

    cfg = load_config(LM_RECIPE, args.overrides)
    if not cfg.data.block_size or cfg.data.packing is False:
        sys.exit("compare_lm.py counts batch x data.block_size tokens per step: keep packing and a block size")
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    case = LMCase("causal_lm", "The causal-LM recipe (recipes/examples/causal_lm_from_scratch.yaml): framework vs raw accelerate vs "
                  "transformers.Trainer", args.overrides, steps=args.warmup_steps + args.steps,
                  skip=args.warmup_steps, batch=cfg.train.batch_size, block=cfg.data.block_size, threads=threads,
                  raw_nomask=args.raw_nomask)

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = machine(args.device, threads)
    env = child_env(args.device, threads)  # threads is set: OMP_NUM_THREADS for every side
    gpu = f", {info['gpu']}" if "gpu" in info else ""
    print(f"# Causal LM: the framework vs a raw accelerate loop and transformers.Trainer ({args.device})\n\n"
          f"Date: {started}. Machine: {info['cpu']}, {info['cores']} cores{gpu}. Framework "
          f"{info['framework_revision']}; torch {info['torch']}, transformers {info['transformers']}, "
          f"accelerate {info['accelerate']}.", flush=True)
    with tempfile.TemporaryDirectory(prefix="compare_lm-") as tmp:
        work = Path(tmp)
        env["HF_HOME"] = str(work / "hf_home")  # a fresh datasets cache, filled by the warm-up runs
        runs = Bench(args.device, work, env).rounds(case, args.rounds, word="round")
    summary = case.summarize(runs)
    print("\n" + case.markdown(runs, summary), flush=True)
    if args.json:
        settings = {k: v for k, v in asdict(case).items() if k != "loops"}
        report = {"date": started, "device": args.device, "machine": info, "rounds": args.rounds,
                  "settings": settings, "runs": runs, **summary}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--side":
        side_main(sys.argv[2], sys.argv[3:])
    else:
        main()

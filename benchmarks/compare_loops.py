"""Compare this framework with a minimal accelerate loop and with transformers.Trainer.

    .venv/bin/python benchmarks/compare_loops.py [--repeats|--rounds 5] [--device cpu|gpu] [--threads N]
        [--case default|tiny|loops|default_job|all] [--job-sides all|as-users-get-them] [--set KEY=VALUE ...]
        [--json results.json]

Two comparisons. The loop-only cases (``default``, ``tiny``; ``--case loops``, the default) make everything
but the training loop equal, below. The end-to-end case (``default_job``) runs the default recipe's whole
job on each side the way its users run it: see "End to end" at the end.

Loop only. Three loops train the same model on the same examples, each in its own process:

- raw: ``benchmarks/raw_loop.py``, a hand-written accelerate loop (forward, backward, step, zero_grad);
- framework: the real CLI, ``python recipes/run.py --config recipes/text_classification.yaml KEY=VALUE...``;
- Trainer: ``benchmarks/trainer_loop.py``, ``transformers.Trainer`` with equivalent TrainingArguments.

Same work. All three get the same recipe and overrides. The raw and Trainer scripts resolve them with the
framework's config loader and read and tokenize the data with the framework's ``load_splits`` and
``tokenize``: the same train rows, truncation to ``data.max_length``, dynamic padding per batch
(DataCollatorWithPadding; ``data.padding=dynamic`` in the framework). All three shuffle with accelerate's
seedable sampler seeded by the recipe seed, so they see the same batches in the same order (drop_last):
the same shapes at every step. The overrides make the rest identical: ``data.group_by_length=false`` (the
others do not group), ``train.max_grad_norm=null`` (no clipping anywhere), ``train.log_every`` beyond the
run (the framework reads the loss on the host once, at the last step). All train in fp32 with AdamW built
alike (the recipe's lr, betas, eps and weight decay, none on biases and LayerNorm, the kernel the framework
picks: fused, on the CPU as on CUDA) and a linear schedule with the recipe's warmup ratio. The probe
records each run's optimizer and the output says whether they all match. A run is at most one epoch, so
the framework evaluates once, at the end; the raw and Trainer scripts then do the same final work: one
pass over the eval split and save_pretrained. The first and last losses in the tables show that the work
was the same: they agree exactly when the model has no dropout (the tiny case). With dropout (MiniLM) they
differ a little: each loop leaves the global RNG, which draws the dropout masks, in its own state (the
framework's train loader has its own generator, the Trainer reseeds before training).

Measurement. Each child starts with ``benchmarks/probe`` on PYTHONPATH, whose ``sitecustomize`` (see its
docstring) hooks every optimizer step from outside the scripts, the same way in the three loops, and
records when each step ended, relative to ``BENCH_T0``, the parent's ``time.time()`` at launch:

- time to first step: launch to the end of optimizer step 1 (interpreter, imports, config, data, model);
- steady samples/s: ``(steps - skip) * batch / (t[steps] - t[skip])``, the window from the end of step
  ``skip`` to the end of the last step; it leaves out the first steps and the final eval and save.
  Also given, as a check on a busy machine: ``batch / median step time`` over the same window, which
  ignores bursts of load from other processes (and would also hide a cost paid on few steps);
- steady samples per CPU second: the same window over the process's CPU time instead of the wall clock.
  With ``--threads 1`` it is the work each loop does per sample, untouched by other load on the machine
  (with more threads it also counts the time OpenMP threads spin while waiting for each other);
- total wall: launch to process exit, final eval and save included;
- peak memory: on the CPU the child's peak RSS, from ``os.wait4`` (``RUSAGE_CHILDREN`` would give the
  largest of all children so far); on a GPU the CUDA allocator's peak in the child;
- first and last loss: the losses of step 1 and of the last step, read at exit (no extra host sync).

Runs alternate (raw, framework, Trainer, raw, ...) so drift in the machine's load hits the three alike,
after one unmeasured warm-up run of each loop that fills the datasets cache and the OS file cache. The
first table gives each loop's medians; the ratios are the median over rounds of the ratio within a round
(one round runs each loop once, back to back), and the targets are checked on them. On a CPU shared with
other work, ``--threads 1`` keeps the numbers meaningful: with one OpenMP thread per core, every parallel op
waits for the thread that another process has descheduled, and steps get up to 100x slower in bursts.
``--threads N`` sets OMP_NUM_THREADS=N for the three and ``train.cpu_threads=N`` for the framework, which
otherwise chooses its own count (it overrides an OMP_NUM_THREADS of 1, what a plain ``accelerate launch``
sets, with the number of cores); the probe records each run's ``torch.get_num_threads()`` and the output
says whether they all match.

End to end (``--case default_job``): the Trainer as a user gets it. The default recipe's whole job (MiniLM
on the Rotten Tomatoes reviews, one epoch, batch 32, lr 1e-4, warmup ratio 0.1, weight decay 0.01,
max_length 64, length grouping, the seeded 10% eval split; evaluated once, at the end), on two sides:

- framework: exactly what a user types, ``accelerate launch recipes/run.py output_dir=DIR``: plain launch,
  no config file (the children get an empty HF_HOME, so no saved accelerate config either), no thread flags;
  the recipe as it is, its checkpoints every 2 minutes included;
- Trainer: ``python benchmarks/trainer_job.py`` (see its docstring), a Trainer script on TrainingArguments'
  own defaults (its fused AdamW, its length-grouped sampler, its collator and data loader, its logging and
  end-of-training checkpoint) with the recipe's hyperparameters, on the framework's train/eval rows;
- the same two without any resumable checkpoint (``checkpoint.every_minutes=null`` and ``trainer_job.py
  --no-checkpoints``: ``save_strategy="no"``), so both sides do the same work: train, evaluate, save the model.

Nothing is probed or matched beyond that: --threads does not apply (OMP_NUM_THREADS and
TOKENIZERS_PARALLELISM are removed from these children's environment, as in a user's shell), and
``--set KEY=VALUE`` overrides reach both sides. Measured per run: total wall, launch to exit of the process
(the launcher's, for the framework); train + eval, each side's own clock (the framework's
``train.wall_seconds``, whose epoch includes its final eval; the Trainer's ``train_runtime`` plus its
``eval_runtime``); the rest (start, imports, data, model, final save, exit) is the difference; steps, eval
accuracy, and the peak RSS of the process tree. One unmeasured warm-up run per side (2 steps) first fills
the datasets cache, so both sides then read the same cached, tokenized rows. Rounds alternate the sides; the
ratio is the median over rounds of Trainer wall / framework wall: above 1, the framework is faster. The target
is on the sides as users get them; the sides without checkpoints give the same-work ratio beside it
(``--job-sides as-users-get-them`` leaves those two out, in half the time).
"""

from __future__ import annotations

import argparse
import bz2
import csv
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import ClassVar, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
RECIPE = ROOT / "recipes" / "text_classification.yaml"
RUN = ROOT / "recipes" / "run.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
MIB = 2 ** 20


@dataclass
class Finished:
    """One training process that exited cleanly, before its measurements are read."""
    wall: float  # launch to exit, seconds
    peak_rss_bytes: int  # the process tree's peak RSS
    output_dir: Path
    probe_file: Path


def medians(runs: List[Dict], loops: Dict, metrics: List[str]) -> Dict[str, Dict[str, float]]:
    return {loop: {m: statistics.median(r[m] for r in runs if r["loop"] == loop) for m in metrics} for loop in loops}


def paired(runs: List[Dict], metric: str, numerator: str, denominator: str) -> float:
    """The median over rounds of numerator/denominator, each from the two runs of one round: runs of a round
    are back to back, so a slow spell of the machine that spans a round cancels out of its ratio."""
    by_loop = {loop: [r[metric] for r in runs if r["loop"] == loop] for loop in (numerator, denominator)}
    return statistics.median(a / b for a, b in zip(by_loop[numerator], by_loop[denominator]))


# What the probed cases share (LoopCase here, compare_lm.py's LMCase): the probe in their children and the
# measurements over the window of steady steps it records.


def probe_env(base: Dict[str, str], probe_file: Optional[Path], steps: Optional[int], skip: int) -> Dict[str, str]:
    """A probed case's child environment: for a measured run (``probe_file`` set), ``benchmarks/probe`` on
    PYTHONPATH and its settings (where to write, the steps to expect, the warm-up steps to leave out)."""
    env = dict(base)
    if probe_file is not None:
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(HERE / "probe"), env.get("PYTHONPATH")])),
                   BENCH_PROBE_OUT=str(probe_file), BENCH_STEPS=str(steps), BENCH_SKIP_STEPS=str(skip))
    return env


def probe_measure(loop: str, steps: Optional[int], device: str, done: Finished, skip: int, unit: str,
                  per_step: int, sides: str) -> Dict:
    """A probed run's measurements, from the probe's file: ``unit`` (samples, tokens; ``per_step`` of them in
    each optimizer step) per second over the steady window, from the end of step ``skip`` to the end of the
    last step, by the window's mean and by its median step, and per CPU second over the same window; time to
    first step, total wall, peak memory (the CUDA allocator's on a GPU, else the process's RSS), the first and
    last losses, the optimizer and the thread count. Exits if the run did not make ``steps`` optimizer steps
    (``sides``, the word for the case's sides in that message)."""
    p = json.loads(done.probe_file.read_text())
    ends = p["step_ends"]
    if len(ends) != steps:
        sys.exit(f"{loop}: {len(ends)} optimizer steps instead of {steps}; the {sides} did not do the same work")
    window = ends[skip - 1:]  # from the end of step `skip` to the end of the last step
    cpu = p["step_cpu_seconds"][skip - 1:]
    peak = p["cuda_peak_bytes"] if device == "gpu" else done.peak_rss_bytes
    return {
        "loop": loop,
        "time_to_first_step_s": ends[0],
        f"steady_{unit}_per_s": (len(window) - 1) * per_step / (window[-1] - window[0]),
        f"median_step_{unit}_per_s": per_step / statistics.median(b - a for a, b in zip(window, window[1:])),
        f"{unit}_per_cpu_s": (len(cpu) - 1) * per_step / (cpu[-1] - cpu[0]),
        "total_wall_s": done.wall,
        "peak_memory_mib": peak / MIB,
        "first_loss": p["first_loss"],
        "last_loss": p["last_loss"],
        "optimizer": p["optimizer"],
        "threads": p["threads"],
    }


def probe_lines(runs: List[Dict], summary: Dict, loops: Dict, sides: str, unit: str, digits: int) -> List[str]:
    """The end of a probed case's report: whether every run had the same thread count, the targets, and each
    run's steady ``unit``/s (by the window's mean and by its median step, ``digits`` decimals)."""
    if summary["same_threads"]:
        lines = ["", f"CPU threads (torch.get_num_threads), the same in every run: {runs[0]['threads']}."]
    else:
        lines = ["", f"WARNING: the {sides} ran with different thread counts: " + "; ".join(
            f"{r['loop']} {r['threads']}" for r in runs[:len(loops)]) + "."]
    rate = f".{digits}f"
    return lines + ["", targets_line(summary), "",
                    f"Steady {unit}/s per run, window mean (from the median step): " + "; ".join(
                        f"{loop} " + ", ".join(f"{format(r[f'steady_{unit}_per_s'], rate)} "
                                               f"({format(r[f'median_step_{unit}_per_s'], rate)})"
                                               for r in runs if r["loop"] == loop) for loop in loops) + "."]


@dataclass
class Case:
    """One comparison: its sides (``loops``: name -> command prefix), each run in its own process."""
    name: str
    title: str
    overrides: List[str]  # recipe overrides for every side, besides the case's own settings

    loops: ClassVar[Dict[str, List[str]]] = {}

    @staticmethod
    def note(device: str) -> str:
        """What the case's tables mean, printed once above the cases of its kind."""
        raise NotImplementedError

    def command(self, loop: str, device: str, output_dir: Path, steps: Optional[int]) -> List[str]:
        raise NotImplementedError

    def env(self, base: Dict[str, str], probe_file: Optional[Path], steps: Optional[int]) -> Dict[str, str]:
        """The child's environment; ``probe_file`` is set for a measured run."""
        return dict(base)

    def measure(self, loop: str, steps: Optional[int], device: str, done: Finished) -> Dict:
        raise NotImplementedError

    def summarize(self, runs: List[Dict]) -> Dict:
        raise NotImplementedError

    def markdown(self, runs: List[Dict], summary: Dict) -> str:
        raise NotImplementedError


@dataclass
class LoopCase(Case):
    """Loop only: the same rows, batches, order, optimizer and schedule in the three loops; probed."""
    steps: int
    skip: int  # the first steps, left out of the steady-state window
    batch: int = 32
    max_length: int = 64
    threads: Optional[int] = None  # --threads: OMP_NUM_THREADS for all, and the framework's train.cpu_threads

    loops: ClassVar[Dict[str, List[str]]] = {
        "raw": [sys.executable, str(HERE / "raw_loop.py")],
        "framework": [sys.executable, str(RUN)],
        "Trainer": [sys.executable, str(HERE / "trainer_loop.py")],
    }
    METRICS: ClassVar[List[str]] = [
        "time_to_first_step_s", "steady_samples_per_s", "median_step_samples_per_s", "samples_per_cpu_s",
        "total_wall_s", "peak_memory_mib", "first_loss", "last_loss"]

    @staticmethod
    def note(device: str) -> str:
        return ("Loop only: fp32; the same recipe, rows, batches and order in the three loops; no clipping. Steady "
                "samples/s leaves out the first steps and the final work; total wall includes the final work (one "
                "eval pass + save_pretrained), which all three loops do. Peak memory: "
                + ("CUDA allocator peak. " if device == "gpu" else "process peak RSS. ")
                + "First and last losses agree exactly without dropout (tiny); with dropout (MiniLM) they differ a "
                "little, since each loop's RNG draws different dropout masks.")

    def recipe_overrides(self, backend: str, output_dir: Path, steps: int) -> List[str]:
        return [
            *self.overrides,
            f"backend={backend}",
            f"output_dir={output_dir}",
            "data.padding=dynamic",
            "data.group_by_length=false",
            f"data.max_length={self.max_length}",
            f"train.batch_size={self.batch}",
            f"train.max_steps={steps}",
            "train.max_grad_norm=null",
            "train.log_every=1000000000",
            # The framework sets its own thread count and overrides OMP_NUM_THREADS=1 (what a plain
            # `accelerate launch` sets): --threads reaches it as its own key. The probe checks the count.
            *([f"train.cpu_threads={self.threads}"] if self.threads else []),
        ]

    def command(self, loop: str, device: str, output_dir: Path, steps: Optional[int]) -> List[str]:
        return [*self.loops[loop], "--config", str(RECIPE), *self.recipe_overrides(device, output_dir, steps)]

    def env(self, base: Dict[str, str], probe_file: Optional[Path], steps: Optional[int]) -> Dict[str, str]:
        return probe_env(base, probe_file, steps, self.skip)

    def measure(self, loop: str, steps: Optional[int], device: str, done: Finished) -> Dict:
        return probe_measure(loop, steps, device, done, self.skip, "samples", self.batch, sides="loops")

    def summarize(self, runs: List[Dict]) -> Dict:
        per_loop = medians(runs, self.loops, self.METRICS)
        fw = per_loop["framework"]
        ratios = {f"framework/{other}": {
            "steady_samples_per_s": paired(runs, "steady_samples_per_s", "framework", other),
            "median_step_samples_per_s": paired(runs, "median_step_samples_per_s", "framework", other),
            "samples_per_cpu_s": paired(runs, "samples_per_cpu_s", "framework", other),
            "peak_memory": paired(runs, "peak_memory_mib", "framework", other),
        } for other in ("raw", "Trainer")}
        targets = {
            "steady samples/s >= 0.99 x raw": ratios["framework/raw"]["steady_samples_per_s"] >= 0.99,
            "peak memory <= 1.02 x raw": ratios["framework/raw"]["peak_memory"] <= 1.02,
            "steady samples/s > Trainer": ratios["framework/Trainer"]["steady_samples_per_s"] > 1,
            "time to first step < Trainer": fw["time_to_first_step_s"] < per_loop["Trainer"]["time_to_first_step_s"],
        }
        optimizers = {json.dumps(r["optimizer"], sort_keys=True) for r in runs}
        return {"medians": per_loop, "ratios": ratios, "targets": targets,
                "same_optimizer": len(optimizers) == 1, "same_threads": len({r["threads"] for r in runs}) == 1}

    def markdown(self, runs: List[Dict], summary: Dict) -> str:
        loops = self.loops
        repeats = len(runs) // len(loops)
        lines = [f"## {self.name}: {self.title}", "",
                 f"{self.steps} steps x batch {self.batch}, max_length {self.max_length}; steady window: steps "
                 f"{self.skip + 1}-{self.steps}; medians of {repeats} run(s) per loop.", "",
                 "| loop | time to first step (s) | steady samples/s | total wall (s) | peak memory (MiB) "
                 "| first loss | last loss |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {loop} | {m['time_to_first_step_s']:.2f} | {m['steady_samples_per_s']:.1f} | "
                  f"{m['total_wall_s']:.1f} | {m['peak_memory_mib']:.0f} | {m['first_loss']:.4f} | "
                  f"{m['last_loss']:.4f} |" for loop, m in summary["medians"].items()]
        lines += ["", "Ratios: the median over the rounds of each round's ratio (the loops run in turn in a round).",
                  "", "| ratio | steady samples/s | steady samples/s from the median step "
                  "| steady samples per CPU second | peak memory |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {name} | {r['steady_samples_per_s']:.3f} | {r['median_step_samples_per_s']:.3f} | "
                  f"{r['samples_per_cpu_s']:.3f} | {r['peak_memory']:.3f} |" for name, r in summary["ratios"].items()]
        if summary["same_optimizer"]:
            lines += ["", f"Optimizer, the same in every run: {json.dumps(runs[0]['optimizer'])}."]
        else:
            lines += ["", "WARNING: the loops' optimizers differ, so they did not do the same work: " + "; ".join(
                f"{r['loop']} {json.dumps(r['optimizer'])}" for r in runs[:len(loops)]) + "."]
        lines += probe_lines(runs, summary, loops, sides="loops", unit="samples", digits=1)
        return "\n".join(lines)


@dataclass
class JobCase(Case):
    """End to end: the recipe's whole job, each side started the way its users start it; not probed."""
    steps: Optional[int] = None  # the whole job (the warm-up alone stops after 2 steps)

    loops: ClassVar[Dict[str, List[str]]] = {
        "framework": [str(ACCELERATE), "launch", str(RUN)],
        "Trainer": [sys.executable, str(HERE / "trainer_job.py")],
        # The same work on both sides: no resumable checkpoint, only the final model (the framework's
        # recipe saves one every 2 minutes, the Trainer at the end of training).
        "framework, no checkpoints": [str(ACCELERATE), "launch", str(RUN), "checkpoint.every_minutes=null"],
        "Trainer, no checkpoints": [sys.executable, str(HERE / "trainer_job.py"), "--no-checkpoints"],
    }
    PAIRS: ClassVar[Dict[str, tuple]] = {  # name: (numerator, denominator); the first decides the target
        "Trainer / framework (as users get them)": ("Trainer", "framework"),
        "Trainer / framework, both without checkpoints (the same work)": ("Trainer, no checkpoints",
                                                                          "framework, no checkpoints"),
    }
    METRICS: ClassVar[List[str]] = ["total_wall_s", "train_and_eval_s", "rest_s", "steps", "eval_accuracy",
                                    "peak_rss_mib"]
    TARGET: ClassVar[str] = "end to end faster than the Trainer (Trainer wall / framework wall > 1)"

    @staticmethod
    def note(device: str) -> str:
        return ("End to end: each side as its users run it, on its own defaults, with the recipe's hyperparameters "
                "and the same train/eval rows; --threads does not apply. Total wall: launch to exit. Train + eval: "
                "each side's own clock (the framework's train.wall_seconds, whose epoch ends with its eval; the "
                "Trainer's train_runtime + eval_runtime). Rest: total minus that (start, imports, data, model, "
                "final save, exit). Peak RSS: the process tree's, host memory"
                + (" (the GPU's is not measured here)." if device == "gpu" else "."))

    def command(self, loop: str, device: str, output_dir: Path, steps: Optional[int]) -> List[str]:
        return [*self.loops[loop], f"output_dir={output_dir}", *self.overrides,
                *([f"train.max_steps={steps}"] if steps else [])]

    def env(self, base: Dict[str, str], probe_file: Optional[Path], steps: Optional[int]) -> Dict[str, str]:
        # As in a user's shell: each side picks its own threads (the framework under plain `accelerate
        # launch`, the Trainer script with torch's default) and the tokenizers their own parallelism.
        return {k: v for k, v in base.items() if k not in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}

    def measure(self, loop: str, steps: Optional[int], device: str, done: Finished) -> Dict:
        summary = json.loads((done.output_dir / "summary.json").read_text())
        train_and_eval = summary["train"]["wall_seconds"]  # the framework's: its epoch ends with the eval
        if loop.startswith("Trainer"):
            train_and_eval += summary["eval"]["wall_seconds"]  # trainer.evaluate(), after trainer.train()
        return {"loop": loop, "total_wall_s": done.wall, "train_and_eval_s": train_and_eval,
                "rest_s": done.wall - train_and_eval, "steps": summary["train"]["steps"],
                "eval_accuracy": summary["eval"]["accuracy"], "peak_rss_mib": done.peak_rss_bytes / MIB}

    def summarize(self, runs: List[Dict]) -> Dict:
        ratios = {name: {metric: paired(runs, metric, *pair)
                         for metric in ("total_wall_s", "train_and_eval_s", "peak_rss_mib")}
                  for name, pair in self.PAIRS.items() if set(pair) <= set(self.loops)}  # --job-sides
        first = ratios[next(iter(self.PAIRS))]
        return {"medians": medians(runs, self.loops, self.METRICS), "ratios": ratios,
                "targets": {self.TARGET: first["total_wall_s"] > 1}}

    def markdown(self, runs: List[Dict], summary: Dict) -> str:
        repeats = len(runs) // len(self.loops)
        overrides = f" Overrides on both sides: {' '.join(self.overrides)}." if self.overrides else ""
        lines = [f"## {self.name}: {self.title}", "",
                 "framework: `accelerate launch recipes/run.py output_dir=DIR`; Trainer: `python "
                 "benchmarks/trainer_job.py`; the sides without checkpoints add `checkpoint.every_minutes=null` "
                 f"and `--no-checkpoints`.{overrides} Medians of {repeats} run(s) per side, alternating.", "",
                 "| side | total wall (s) | train + eval (s) | rest (s) | steps | eval accuracy | peak RSS (MiB) |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {loop} | {m['total_wall_s']:.1f} | {m['train_and_eval_s']:.1f} | {m['rest_s']:.1f} | "
                  f"{m['steps']:.0f} | {m['eval_accuracy']:.4f} | {m['peak_rss_mib']:.0f} |"
                  for loop, m in summary["medians"].items()]
        lines += ["", "Trainer / framework, the median over the rounds of each round's ratio (above 1: the framework "
                  "is faster, or lighter):", "",
                  "| ratio | total wall | train + eval | peak RSS |", "| --- | ---: | ---: | ---: |",
                  *(f"| {name} | {r['total_wall_s']:.3f} | {r['train_and_eval_s']:.3f} | {r['peak_rss_mib']:.3f} |"
                    for name, r in summary["ratios"].items()), "",
                  "Per run, total wall (s) and eval accuracy: " + "; ".join(
                      f"{loop} " + ", ".join(f"{run['total_wall_s']:.1f} ({run['eval_accuracy']:.4f})"
                                             for run in runs if run["loop"] == loop) for loop in self.loops) + ".",
                  "", targets_line(summary)]
        return "\n".join(lines)


def targets_line(summary: Dict) -> str:
    return "Targets: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}"
                                   for name, ok in summary["targets"].items()) + "."


def make_cases(device: str, tiny_model: Path, threads: Optional[int]) -> Dict[str, Case]:
    # A MiniLM step takes about a second on a small CPU and milliseconds on a GPU: on the GPU more steps
    # make a steady window of seconds. All stay within one epoch (360 steps), so one evaluation.
    default_steps = 40 if device == "cpu" else 300
    return {
        "default": LoopCase("default", "all-MiniLM-L6-v2 (pretrained) on Rotten Tomatoes", [], default_steps, skip=5,
                            threads=threads),
        "tiny": LoopCase("tiny", "2-layer BERT, hidden 32, random init, no dropout, on Rotten Tomatoes",
                         [f"model.name_or_path={tiny_model}"], 300, skip=20, threads=threads),
        "default_job": JobCase("default_job", "the default recipe's whole job (MiniLM, Rotten Tomatoes, 1 epoch, "
                               "eval at the end), the framework vs the Trainer as a user gets it", []),
    }


# The --case groups; "loops" is the default (make bench).
CASE_GROUPS = {"loops": ["default", "tiny"], "all": ["default", "tiny", "default_job"]}


def build_tiny_model(folder: Path, vocab_size: int = 2000) -> None:
    """The tests' tiny random BERT, with a vocabulary of the corpus's most frequent words."""
    from transformers.utils import logging

    from framework.testing import SPECIAL_TOKENS, save_tiny_bert

    logging.disable_progress_bar()
    with bz2.open(ROOT / "assets" / "rotten_tomatoes_reviews.csv.bz2", "rt", newline="") as f:
        counts = Counter(word for row in csv.DictReader(f) for word in re.findall(r"\w+|[^\w\s]", row["text"].lower()))
    save_tiny_bert(folder, [word for word, _ in counts.most_common(vocab_size - len(SPECIAL_TOKENS))])


@dataclass
class Bench:
    device: str
    work: Path
    env: Dict[str, str]  # for every child, before the case's own changes

    def run(self, case: Case, loop: str, label: str, steps: Optional[int], measured: bool) -> Dict:
        """One training process; returns its measurements (nothing for an unmeasured warm-up)."""
        out = self.work / "runs" / label
        log, probe_file = self.work / f"{label}.log", self.work / f"{label}.probe.json"
        cmd = case.command(loop, self.device, out, steps)
        env = case.env(self.env, probe_file if measured else None, steps)
        with log.open("w") as f:
            env["BENCH_T0"] = repr(time.time())
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
            # The rusage of this child alone, with its own reaped children (the training process that
            # `accelerate launch` starts): ru_maxrss is the largest peak among them.
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.time() - float(env["BENCH_T0"])
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            sys.exit(f"{label} failed (exit {proc.returncode}): {' '.join(cmd)}\n{log.read_text()[-4000:]}")
        result = case.measure(loop, steps, self.device, Finished(wall, usage.ru_maxrss * 1024, out, probe_file)) \
            if measured else {}  # ru_maxrss: KiB on Linux
        shutil.rmtree(out)  # the saved model (90 MB for MiniLM) and checkpoints are not needed
        return result

    def rounds(self, case: Case, rounds: int, label: str = "", tag: str = "", word: str = "run") -> List[Dict]:
        """One unmeasured warm-up run of each side (2 steps), then ``rounds`` rounds that run the sides in turn;
        returns the measured runs. Progress goes to stderr, each line after ``tag`` and each round called
        ``word``; ``label`` starts the runs' labels (their folders and logs)."""
        for loop in case.loops:
            print(f"{tag}warm-up: {loop}", file=sys.stderr, flush=True)
            self.run(case, loop, f"{label}{loop}-warmup", steps=2, measured=False)
        runs = []
        for i in range(rounds):
            for loop in case.loops:
                print(f"{tag}{word} {i + 1}/{rounds}: {loop}", file=sys.stderr, flush=True)
                runs.append(self.run(case, loop, f"{label}{loop}-{i}", case.steps, measured=True))
        return runs


def add_device_and_threads(parser: argparse.ArgumentParser, threads_help: str) -> None:
    """The ``--device`` and ``--threads`` options (here and in compare_lm.py); ``threads_help``: what
    ``--threads`` reaches and its default in that script."""
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--threads", type=int, help=threads_help + ". On a machine shared with other work, 1 is "
                        "far less sensitive to the other load")


def child_env(device: str, threads: Optional[int]) -> Dict[str, str]:
    """Every child's environment, before its case's changes: hub and datasets offline, no tokenizers
    parallelism, OMP_NUM_THREADS=``threads`` when given, and one GPU with ``device`` gpu (the Trainer started
    without a launcher would spread over every visible GPU, DataParallel), none otherwise (the end-to-end sides
    pick their device themselves: let them find none)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] if device == "gpu" else ""
    return env


def revision() -> str:
    """The framework's commit, and whether the measured tree differs from it (it is measured as it is)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" + uncommitted changes" if git("status", "--porcelain", "--", "framework", "recipes") else "")


def machine(device: str, threads: Optional[int]) -> Dict[str, object]:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    info = {"cpu": names[0] if names else platform.processor(), "cores": os.cpu_count(),
            "threads_per_process": threads or "torch default", "framework_revision": revision(),
            "python": platform.python_version(),
            **{name: version(name) for name in ("torch", "transformers", "accelerate", "datasets")}}
    if device == "gpu":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device gpu, but torch sees no CUDA device")
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", "--rounds", type=int, default=5,
                        help="rounds: measured runs per side and case, the sides alternating in each (default 5)")
    parser.add_argument("--case", choices=["default", "tiny", "default_job", *CASE_GROUPS], default="loops",
                        help="loops (the default): default and tiny; all: those and default_job")
    add_device_and_threads(parser, "CPU threads per training process (OMP_NUM_THREADS) in the loop-only cases; "
                                   "default: torch's, one per core")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="a recipe override for every side of the chosen cases (after the case's own; the "
                             "loop-only cases' fixed settings still win), e.g. data.max_train_samples=256 for a "
                             "quick check of default_job")
    parser.add_argument("--job-sides", choices=["all", "as-users-get-them"], default="all",
                        help="default_job's sides: all four (the default), or only the two the target is on "
                             "(framework and Trainer, each with its checkpoints): half the time")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()
    if args.repeats < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--repeats and --threads must be at least 1")
    if any("=" not in override for override in args.overrides):
        parser.error("--set takes KEY=VALUE")

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = machine(args.device, args.threads)
    chosen = CASE_GROUPS.get(args.case, [args.case])
    env = child_env(args.device, args.threads)
    report = {"date": started, "device": args.device, "machine": info, "repeats": args.repeats, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="compare_loops-") as tmp:
        work = Path(tmp)
        env["HF_HOME"] = str(work / "hf_home")  # a fresh datasets cache, filled by the warm-up runs
        bench = Bench(args.device, work, env)
        cases = make_cases(args.device, work / "tiny-bert", args.threads)
        kinds = list(dict.fromkeys(type(cases[name]) for name in chosen))
        print("\n".join([
            f"# The framework vs a raw accelerate loop and transformers.Trainer ({args.device})", "",
            f"Date: {started}. Machine: {info['cpu']}, {info['cores']} cores"
            + (f", {info['gpu']}" if "gpu" in info else "")
            + f"; CPU threads per process: {info['threads_per_process']}."
            f" Framework {info['framework_revision']}; torch {info['torch']}, transformers {info['transformers']},"
            f" accelerate {info['accelerate']}.",
            *("\n" + kind.note(args.device) for kind in kinds),
        ]), flush=True)
        if "tiny" in chosen:
            build_tiny_model(work / "tiny-bert")
        for name in chosen:
            case = cases[name]
            case.overrides = [*case.overrides, *args.overrides]
            if isinstance(case, JobCase) and args.job_sides != "all":
                case.loops = {side: command for side, command in case.loops.items()
                              if side in next(iter(JobCase.PAIRS.values()))}
            runs = bench.rounds(case, args.repeats, label=f"{name}-", tag=f"[{name}] ")
            summary = case.summarize(runs)
            report["cases"][name] = {"settings": asdict(case), "runs": runs, **summary}
            print("\n" + case.markdown(runs, summary), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Compare this framework's training loop with a minimal accelerate loop and with transformers.Trainer.

    .venv/bin/python benchmarks/compare_loops.py [--repeats 5] [--case default|tiny|all] [--device cpu|gpu]
                                                 [--threads N] [--json results.json]

Three loops train the same model on the same examples, each in its own process:

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
picks: foreach on the CPU, fused on CUDA) and a linear schedule with the recipe's warmup ratio. The probe
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
(one round runs each loop once, back to back), and the targets are checked on them. On a CPU shared with other work, ``--threads 1``
keeps the numbers meaningful: with one OpenMP thread per core, every parallel op waits for the thread
that another process has descheduled, and steps get up to 100x slower in bursts.
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
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
RECIPE = ROOT / "recipes" / "text_classification.yaml"
LOOPS = {
    "raw": HERE / "raw_loop.py",
    "framework": ROOT / "recipes" / "run.py",
    "Trainer": HERE / "trainer_loop.py",
}
METRICS = ["time_to_first_step_s", "steady_samples_per_s", "median_step_samples_per_s", "samples_per_cpu_s",
           "total_wall_s", "peak_memory_mib", "first_loss", "last_loss"]
MIB = 2 ** 20


@dataclass
class Case:
    name: str
    title: str
    overrides: List[str]  # recipe overrides besides the common ones
    steps: int
    skip: int  # the first steps, left out of the steady-state window
    batch: int = 32
    max_length: int = 64

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
        ]


def make_cases(device: str, tiny_model: Path) -> Dict[str, Case]:
    # A MiniLM step takes about a second on a small CPU and milliseconds on a GPU: on the GPU more steps
    # make a steady window of seconds. All stay within one epoch (360 steps), so one evaluation.
    default_steps = 40 if device == "cpu" else 300
    return {
        "default": Case("default", "all-MiniLM-L6-v2 (pretrained) on Rotten Tomatoes", [], default_steps, skip=5),
        "tiny": Case("tiny", "2-layer BERT, hidden 32, random init, no dropout, on Rotten Tomatoes",
                     [f"model.name_or_path={tiny_model}"], 300, skip=20),
    }


def build_tiny_model(folder: Path, vocab_size: int = 2000) -> None:
    """The tests' tiny random BERT, with a vocabulary of the corpus's most frequent words."""
    from transformers.utils import logging

    from framework.testing import SPECIAL_TOKENS, save_tiny_bert

    logging.disable_progress_bar()
    with bz2.open(ROOT / "assets" / "rotten_tomatoes.csv.bz2", "rt", newline="") as f:
        counts = Counter(word for row in csv.DictReader(f) for word in re.findall(r"\w+|[^\w\s]", row["text"].lower()))
    save_tiny_bert(folder, [word for word, _ in counts.most_common(vocab_size - len(SPECIAL_TOKENS))])


@dataclass
class Bench:
    device: str
    work: Path
    env: Dict[str, str]  # for every child

    def run(self, loop: str, case: Case, label: str, steps: int, probe: bool) -> Dict:
        """One training process; returns its measurements (nothing for an unprobed warm-up)."""
        out = self.work / "runs" / label
        log, probe_file = self.work / f"{label}.log", self.work / f"{label}.probe.json"
        cmd = [sys.executable, str(LOOPS[loop]), "--config", str(RECIPE),
               *case.recipe_overrides(self.device, out, steps)]
        env = dict(self.env)
        if probe:
            env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(HERE / "probe"), env.get("PYTHONPATH")])),
                       BENCH_PROBE_OUT=str(probe_file), BENCH_STEPS=str(steps), BENCH_SKIP_STEPS=str(case.skip))
        with log.open("w") as f:
            env["BENCH_T0"] = repr(time.time())
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)  # the rusage of this child alone
            wall = time.time() - float(env["BENCH_T0"])
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            sys.exit(f"{label} failed (exit {proc.returncode}): {' '.join(cmd)}\n{log.read_text()[-4000:]}")
        shutil.rmtree(out)  # the saved model (90 MB for MiniLM) is not needed
        if not probe:
            return {}
        p = json.loads(probe_file.read_text())
        ends = p["step_ends"]
        if len(ends) != steps:
            sys.exit(f"{label}: {len(ends)} optimizer steps instead of {steps}; the loops did not do the same work")
        window = ends[case.skip - 1:]  # from the end of step `skip` to the end of the last step
        cpu = p["step_cpu_seconds"][case.skip - 1:]
        peak = p["cuda_peak_bytes"] if self.device == "gpu" else usage.ru_maxrss * 1024  # Linux: KiB
        return {
            "loop": loop,
            "time_to_first_step_s": ends[0],
            "steady_samples_per_s": (len(window) - 1) * case.batch / (window[-1] - window[0]),
            "median_step_samples_per_s": case.batch / statistics.median(b - a for a, b in zip(window, window[1:])),
            "samples_per_cpu_s": (len(cpu) - 1) * case.batch / (cpu[-1] - cpu[0]),
            "total_wall_s": wall,
            "peak_memory_mib": peak / MIB,
            "first_loss": p["first_loss"],
            "last_loss": p["last_loss"],
            "optimizer": p["optimizer"],
        }


def summarize(runs: List[Dict]) -> Dict:
    medians = {loop: {m: statistics.median(r[m] for r in runs if r["loop"] == loop) for m in METRICS}
               for loop in LOOPS}
    fw = medians["framework"]

    def paired(other: str, metric: str) -> float:
        """The median over rounds of framework/other, each from the two runs of one round: runs of a round
        are back to back, so a slow spell of the machine that spans a round cancels out of its ratio."""
        by_loop = {loop: [r[metric] for r in runs if r["loop"] == loop] for loop in ("framework", other)}
        return statistics.median(a / b for a, b in zip(by_loop["framework"], by_loop[other]))

    ratios = {f"framework/{other}": {
        "steady_samples_per_s": paired(other, "steady_samples_per_s"),
        "median_step_samples_per_s": paired(other, "median_step_samples_per_s"),
        "samples_per_cpu_s": paired(other, "samples_per_cpu_s"),
        "peak_memory": paired(other, "peak_memory_mib"),
    } for other in ("raw", "Trainer")}
    targets = {
        "steady samples/s >= 0.99 x raw": ratios["framework/raw"]["steady_samples_per_s"] >= 0.99,
        "peak memory <= 1.02 x raw": ratios["framework/raw"]["peak_memory"] <= 1.02,
        "steady samples/s > Trainer": ratios["framework/Trainer"]["steady_samples_per_s"] > 1,
        "time to first step < Trainer": fw["time_to_first_step_s"] < medians["Trainer"]["time_to_first_step_s"],
    }
    optimizers = {json.dumps(r["optimizer"], sort_keys=True) for r in runs}
    return {"medians": medians, "ratios": ratios, "targets": targets,
            "same_optimizer": len(optimizers) == 1}


def markdown(case: Case, runs: List[Dict], summary: Dict) -> str:
    repeats = len(runs) // len(LOOPS)
    lines = [f"## {case.name}: {case.title}", "",
             f"{case.steps} steps x batch {case.batch}, max_length {case.max_length}; steady window: steps "
             f"{case.skip + 1}-{case.steps}; medians of {repeats} run(s) per loop.", "",
             "| loop | time to first step (s) | steady samples/s | total wall (s) | peak memory (MiB) | first loss "
             "| last loss |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {loop} | {m['time_to_first_step_s']:.2f} | {m['steady_samples_per_s']:.1f} | "
              f"{m['total_wall_s']:.1f} | {m['peak_memory_mib']:.0f} | {m['first_loss']:.4f} | {m['last_loss']:.4f} |"
              for loop, m in summary["medians"].items()]
    lines += ["", "Ratios: the median over the rounds of each round's ratio (the loops run in turn in a round).", "",
              "| ratio | steady samples/s | steady samples/s from the median step | steady samples per CPU second "
              "| peak memory |",
              "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {name} | {r['steady_samples_per_s']:.3f} | {r['median_step_samples_per_s']:.3f} | "
              f"{r['samples_per_cpu_s']:.3f} | {r['peak_memory']:.3f} |" for name, r in summary["ratios"].items()]
    if summary["same_optimizer"]:
        lines += ["", f"Optimizer, the same in every run: {json.dumps(runs[0]['optimizer'])}."]
    else:
        lines += ["", "WARNING: the loops' optimizers differ, so they did not do the same work: " + "; ".join(
            f"{r['loop']} {json.dumps(r['optimizer'])}" for r in runs[:len(LOOPS)]) + "."]
    lines += ["", "Targets: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}"
                                        for name, ok in summary["targets"].items()) + ".", "",
              "Steady samples/s per run, window mean (from the median step): " + "; ".join(
                  f"{loop} " + ", ".join(f"{r['steady_samples_per_s']:.1f} ({r['median_step_samples_per_s']:.1f})"
                                         for r in runs if r["loop"] == loop) for loop in LOOPS) + "."]
    return "\n".join(lines)


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
    parser.add_argument("--repeats", type=int, default=5, help="measured runs per loop and case (default 5)")
    parser.add_argument("--case", choices=["default", "tiny", "all"], default="all")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--threads", type=int,
                        help="CPU threads per training process (OMP_NUM_THREADS); default: torch's, one per core. "
                             "On a machine shared with other work, 1 is far less sensitive to the other load")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()
    if args.repeats < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--repeats and --threads must be at least 1")

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = machine(args.device, args.threads)
    print("\n".join([
        f"# Training loops: raw accelerate vs framework vs transformers.Trainer ({args.device})", "",
        f"Date: {started}. Machine: {info['cpu']}, {info['cores']} cores"
        + (f", {info['gpu']}" if "gpu" in info else "") + f"; CPU threads per process: {info['threads_per_process']}."
        f" Framework {info['framework_revision']}; torch {info['torch']}, transformers {info['transformers']},"
        f" accelerate {info['accelerate']}.", "",
        "fp32; the same recipe, rows, batches and order in the three loops; no clipping. Steady samples/s "
        "leaves out the first steps and the final work; total wall includes the final work (one eval pass + "
        "save_pretrained), which all three loops do. Peak memory: "
        + ("CUDA allocator peak. " if args.device == "gpu" else "process peak RSS. ")
        + "First and last losses agree exactly without dropout (tiny); with dropout (MiniLM) they differ a "
        "little, since each loop's RNG draws different dropout masks.",
    ]), flush=True)

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if args.device == "gpu":
        # One GPU: Trainer started without a launcher would spread over every visible GPU (DataParallel).
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    report = {"date": started, "device": args.device, "machine": info, "repeats": args.repeats, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="compare_loops-") as tmp:
        work = Path(tmp)
        env["HF_HOME"] = str(work / "hf_home")  # a fresh datasets cache, filled by the warm-up runs
        bench = Bench(args.device, work, env)
        cases = make_cases(args.device, work / "tiny-bert")
        chosen = list(cases) if args.case == "all" else [args.case]
        if "tiny" in chosen:
            build_tiny_model(work / "tiny-bert")
        for name in chosen:
            case = cases[name]
            for loop in LOOPS:
                print(f"[{name}] warm-up: {loop}", file=sys.stderr, flush=True)
                bench.run(loop, case, f"{name}-{loop}-warmup", steps=2, probe=False)
            runs = []
            for i in range(args.repeats):
                for loop in LOOPS:
                    print(f"[{name}] run {i + 1}/{args.repeats}: {loop}", file=sys.stderr, flush=True)
                    runs.append(bench.run(loop, case, f"{name}-{loop}-{i}", case.steps, probe=True))
            summary = summarize(runs)
            report["cases"][name] = {"settings": {"title": case.title, "steps": case.steps, "skip": case.skip,
                                                  "batch": case.batch, "max_length": case.max_length},
                                     "runs": runs, **summary}
            print("\n" + markdown(case, runs, summary), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

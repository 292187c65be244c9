"""Each efficient-training option against the plain run, measured side by side in one invocation.

    .venv/bin/python benchmarks/options.py [--steps 30] [--repeats 1] [--json out.json]

Trains the default recipe for a fixed number of optimizer steps once per option (through the real CLI,
one process each, alternating the options when repeated) and prints samples per second and peak memory
relative to the plain run. Throughput is steady state, from the framework's own metrics.jsonl: the
training windows logged every LOG_EVERY steps, leaving out the first (warm-up, and torch.compile's
compilation); peak memory is the process peak RSS on the CPU (CUDA peak on a GPU). Local SGD only means
something with several processes: it is compared with plain DDP, both on 2 processes.
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "recipes" / "run.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")

# name -> (overrides, launch config; None: accelerate_configs/cpu.yaml, one process)
OPTIONS = {
    "plain (adamw, fp32)": ([], None),
    "gradient_checkpointing": (["train.gradient_checkpointing=true"], None),
    "precision bf16": (["precision=bf16"], None),
    "adafactor": (["optim.name=adafactor", "optim.lr=1e-4"], None),
    "adamw_8bit": (["optim.name=adamw_8bit"], None),
    "sgd (momentum)": (["optim.name=sgd", "optim.lr=0.05"], None),
    "lion": (["optim.name=lion", "optim.lr=3e-5"], None),
    "padding max_length": (["data.padding=max_length"], None),
    "torch.compile": (["train.compile=true", "data.padding=max_length"], None),
    "ddp, 2 processes": (["backend=cpu"], "cpu_ddp.yaml"),
    "local_sgd K=4, 2 processes": (["backend=cpu", "distributed.local_sgd_steps=4"], "cpu_ddp.yaml"),
}
LOG_EVERY = 5
# Each option against the plain run, except: compile (static shapes, one graph) against the same padding
# without compile, and local SGD against DDP on the same 2 processes.
BASELINE = {"torch.compile": "padding max_length", "ddp, 2 processes": None,
            "local_sgd K=4, 2 processes": "ddp, 2 processes"}


def run_once(name: str, steps: int, workdir: Path) -> dict:
    overrides, launch = OPTIONS[name]
    out = workdir / f"{len(list(workdir.iterdir()))}"
    args = [f"output_dir={out}", f"train.max_steps={steps}", f"train.log_every={LOG_EVERY}",
            "data.max_eval_samples=64", *overrides]
    cmd = [str(ACCELERATE), "launch", "--config_file", str(ROOT / "accelerate_configs" / (launch or "cpu.yaml")),
           str(RUN), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [r["samples_per_second"] for r in records if "samples_per_second" in r][1:]
    return {"samples_per_second": statistics.harmonic_mean(windows),  # windows of equal sample counts
            "peak_mib": summary["memory"]["peak_bytes"] / 2**20, "loss": summary["train"]["loss"],
            "optimizer_state_mib": summary["memory"]["optimizer_state_bytes"] / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="option names to run (default: all)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.steps < 2 * LOG_EVERY or args.steps % LOG_EVERY:
        parser.error(f"--steps must be a multiple of {LOG_EVERY}, at least {2 * LOG_EVERY}: the first window is left out")
    names = args.only or list(OPTIONS)
    results = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name in names:  # alternating options in every repeat cancels slow drift of the machine
                results[name].append(run_once(name, args.steps, Path(tmp)))
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()}

    print(f"# Training options, default recipe, {args.steps} steps, median of {args.repeats}")
    print(f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"{__import__('os').cpu_count()} cores, torch {__import__('torch').__version__}\n")
    print("| option | samples/s | peak MiB | baseline | samples/s vs baseline | peak vs baseline "
          "| optimizer state MiB | final loss |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    plain = "plain (adamw, fp32)"
    for name, m in medians.items():
        base_name = BASELINE.get(name, plain)
        base = medians.get(base_name) if base_name and base_name != name else None
        ratios = (f"{base_name} | {m['samples_per_second'] / base['samples_per_second']:.2f}x | "
                  f"{m['peak_mib'] / base['peak_mib']:.2f}x" if base else "- | - | -")
        print(f"| {name} | {m['samples_per_second']:.1f} | {m['peak_mib']:.0f} | {ratios} | "
              f"{m['optimizer_state_mib']:.1f} | {m['loss']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "results": results, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()

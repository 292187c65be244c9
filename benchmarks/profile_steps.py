"""Where a training step of the framework costs more than the Trainer's: op counts and phase times per step.

    .venv/bin/python benchmarks/profile_steps.py [--steps 40] [--trace 11 20] [--threads 1] [KEY=VALUE ...]

Runs the default recipe (with the overrides) for ``--steps`` steps on each side, one after the other: the
framework through its CLI (``recipes/run.py``, the live report off) and the Trainer as
``benchmarks/trainer_job.py`` (its own defaults). Both load ``benchmarks/step_probe`` (see its docstring),
which times each step's phases and traces steps ``--trace START END`` with torch.profiler. On a shared
machine compare the counts (op calls, which ops) and the shares more than the times: ``--threads 1``
(default) keeps each side off the other processes' cores as far as it can.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def run(side: str, out: Path, args) -> dict:
    probe = out / f"{side}.json"
    common = [f"output_dir={out / side}", f"train.max_steps={args.steps}", *args.overrides]
    cmd = ([sys.executable, str(ROOT / "recipes" / "run.py"), *common, "report.enabled=false",
            f"train.cpu_threads={args.threads}"] if side == "framework"
           else [sys.executable, str(HERE / "trainer_job.py"), *common])
    env = dict(os.environ, PYTHONPATH=str(HERE / "step_probe"), PROF_OUT=str(probe), OMP_NUM_THREADS=str(args.threads),
               PROF_START=str(args.trace[0]), PROF_END=str(args.trace[1]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{side} failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads(probe.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--trace", type=int, nargs=2, default=[11, 20], metavar=("START", "END"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="profile_steps-") as tmp:
        records = {side: run(side, Path(tmp), args) for side in ("framework", "Trainer")}
    ops = {side: {o["name"]: o for o in r["ops"]} for side, r in records.items()}
    print(f"steps {args.trace[0]}-{args.trace[1]} traced; per step, median (ms) after the first 2 steps:")
    for phase in ("between", "forward", "backward_step"):
        print(f"  {phase:14s}" + "".join(f"  {side} {statistics.median(r[phase][2:]) * 1e3:8.1f}"
                                         for side, r in records.items()))
    for side, table in ops.items():
        aten = [o for name, o in table.items() if name.startswith("aten::")]
        total = sum(o["self_us"] for o in table.values())
        print(f"{side}: {sum(o['count'] for o in aten)} aten calls ({len(aten)} ops), matrix products "
              f"{sum(table[m]['self_us'] for m in MATMULS if m in table) / total:.1%} of the op time")
    print("ops whose call counts differ (framework, Trainer):")
    for name in sorted(set(ops["framework"]) | set(ops["Trainer"])):
        counts = [ops[side].get(name, {}).get("count", 0) for side in ("framework", "Trainer")]
        if counts[0] != counts[1]:
            print(f"  {name[:70]:70s} {counts[0]:7d} {counts[1]:7d}")


if __name__ == "__main__":
    main()

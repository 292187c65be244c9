"""Streaming memory: the peak RSS of the same streamed run over a ~10 MB and a ~500 MB corpus.

The corpora are generated from Hamlet's paragraphs (assets/hamlet.txt) in a random order, as shards of
.txt files; the run is recipes/examples/causal_lm_from_scratch.yaml with ``data.streaming=true`` and the same ``train.max_steps``
over both. Each run is its own process, which reports its own peak RSS (``ru_maxrss``). Target: the large
corpus's peak at most 1.2x the small one's (memory must not grow with the corpus).

    .venv/bin/python benchmarks/stream_memory.py [--steps 30] [--json results.json]
"""

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARD_MB = 50


def generate(folder: Path, megabytes: int, seed: int) -> Path:
    """``megabytes`` of Hamlet's paragraphs, shuffled, in shards of at most SHARD_MB."""
    paragraphs = [p for p in (ROOT / "assets" / "hamlet.txt").read_text().split("\n\n") if p.strip()]
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    remaining, shard = megabytes * 2**20, 0
    while remaining > 0:
        size = min(remaining, SHARD_MB * 2**20)
        with (folder / f"shard_{shard:03d}.txt").open("w") as f:
            written = 0
            while written < size:
                text = "\n\n".join(rng.choices(paragraphs, k=1000)) + "\n\n"
                f.write(text)
                written += len(text)
        remaining -= written
        shard += 1
    return folder


def child(args) -> None:
    """One run in this process; prints its peak RSS in bytes."""
    sys.path.insert(0, str(ROOT))
    from framework.cli import main

    status = main(args)
    print(json.dumps({"status": status, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def run(corpus: Path, out: Path, steps: int) -> dict:
    args = ["--config", str(ROOT / "recipes" / "examples" / "causal_lm_from_scratch.yaml"), f"data.train_file={corpus}/*.txt",
            "data.streaming=true", f"train.max_steps={steps}", "checkpoint.every_minutes=null", f"output_dir={out}"]
    proc = subprocess.run([sys.executable, __file__, "--child", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the run failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = json.loads((out / "summary.json").read_text())
    return {**result, "train_seconds": summary["train"]["wall_seconds"], "eval_loss": summary["eval"]["loss"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sizes", type=int, nargs=2, default=[10, 500], metavar=("SMALL_MB", "LARGE_MB"))
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="stream_memory-") as tmp:
        for megabytes in options.sizes:
            corpus = generate(Path(tmp) / f"corpus_{megabytes}mb", megabytes, seed=megabytes)
            size = sum(p.stat().st_size for p in corpus.iterdir())
            results[f"{megabytes}mb"] = {"corpus_bytes": size, **run(corpus, Path(tmp) / f"run_{megabytes}mb", options.steps)}
            print(f"{size / 2**20:7.1f} MiB corpus: peak RSS {results[f'{megabytes}mb']['peak_rss_bytes'] / 2**20:.0f} MiB",
                  flush=True)
    small, large = (results[f"{m}mb"]["peak_rss_bytes"] for m in options.sizes)
    results["ratio"] = large / small
    print(f"peak RSS ratio (large / small corpus): {results['ratio']:.3f} (target <= 1.2)")
    if options.json:
        options.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Peak memory and steady tokens/s of a causal-LM training step: the chunked loss (framework/losses.py) vs
transformers' own loss (``model(input_ids, labels=...).loss``, full logits) and TRL's chunked log-prob kernel.

    .venv/bin/python benchmarks/chunked_loss.py [--rounds 3] [--steps 4] [--cases 50257x16x128,...]
        [--sides hf,chunked,trl,cce] [--cap-gib 4] [--max-gib 14] [--json results.json]

The model is the default causal_lm recipe's (recipes/examples/causal_lm_from_scratch.yaml: GPT-2, 4 layers, 128 wide, from scratch,
fp32) with the recipe's AdamW (torch's fused kernel), on random token blocks, every token a target. A case is
VOCAB x BATCH x LENGTH. Each (side, case) is measured in a fresh process (``--child``): 2 warm-up steps
(torch.compile's compilation for cce), then ``--steps`` timed steps (forward, loss, backward, clip, AdamW step, zero_grad), on the CPU under the
framework's allocator setting (large buffers kept on the heap, framework/backend/cpu.py), reporting its peak RSS
(``ru_maxrss``; on a GPU the CUDA allocator's peak) and the median step's tokens/s. The sides alternate within
each of ``--rounds`` rounds, and the ratios are of medians over rounds, side by side in one run:

- hf: the loss a user gets from transformers, ``model(input_ids=..., labels=...).loss``;
- chunked: the framework's path, ``losses.hidden_states`` then ``losses.linear_cross_entropy`` over
  ``train.loss_chunk_tokens`` (default 1024) tokens at a time, divided by the target count;
- trl: TRL's ``ChunkedLogProbFunction`` (trl/kernels/chunked_logprob.py, what its SFTTrainer's loss uses;
  torch tiles on the CPU) on the same hidden states;
- cce: Apple's Cut Cross-Entropy, its ``torch_compile`` implementation (``cut_cross_entropy/torch_compile.py``:
  the head's product and the cross-entropy in one ``torch.compile(dynamic=True)`` graph; its Triton kernel
  needs a GPU). Optional: skipped, with the reason printed, where ``cut_cross_entropy`` is not importable
  (``PYTHONPATH=DIR`` after ``pip install --target DIR --no-deps cut-cross-entropy`` is enough: the package's
  ``__init__`` imports Triton, so the module is loaded on its own; it needs only torch).

A parent process watches each child's resident memory and stops it above ``--max-gib`` (the machine is
shared; such a side is reported as over that cap, so its ratio is a bound).

Targets (at the default shape 50257x16x128): chunked peak <= 0.5x hf's, tokens/s >= 0.95x hf's. Then the
largest batch (at length 128, vocab 50257) whose peak stays under ``--cap-gib``, per side: doubling from 8,
then halving the interval between the last batch under the cap and the first over it down to 8 rows (2
steps each, the child stopped as soon as it passes the cap): target chunked >= 2x hf's.
"""

import argparse
import importlib.util
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("hf", "chunked", "trl", "cce")
DEFAULT_CASES = "50257x16x128,50257x8x1024,128256x16x128,128256x8x1024"


def cce_loss():
    """Cut Cross-Entropy's torch_compile implementation, or the reason it cannot be imported. Its package's
    ``__init__`` imports the Triton kernel (GPU only), so the package is registered without running it and
    the torch-only module is imported from it."""
    import types

    spec = importlib.util.find_spec("cut_cross_entropy")
    if spec is None:
        return None, "cut_cross_entropy is not importable (pip install --target DIR --no-deps cut-cross-entropy)"
    if "cut_cross_entropy" not in sys.modules:
        package = types.ModuleType("cut_cross_entropy")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["cut_cross_entropy"] = package
    from cut_cross_entropy.torch_compile import torch_compile_linear_cross_entropy

    return torch_compile_linear_cross_entropy, None


def child(side: str, vocab: int, batch: int, length: int, steps: int, chunk: int, warmup: int = 2) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from framework import losses

    from framework import backend

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":  # the framework's CPU allocator setting, on every side (framework/backend/cpu.py)
        backend.reuse_large_buffers()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_layer=4, n_head=4, n_embd=128, n_positions=max(length, 128))
    model = GPT2LMHeadModel(config).to(dev).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=2e-3, betas=(0.9, 0.95), fused=True)
    ids = torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(1)).to(dev)
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=losses.IGNORE)
    count = (targets != losses.IGNORE).sum()
    head = losses.output_head(model)
    cce = cce_loss()[0] if side == "cce" else None

    def loss():
        if side == "hf":
            return model(input_ids=ids, labels=ids).loss
        hidden, _ = losses.hidden_states(model, head, input_ids=ids)
        if side == "chunked":
            return losses.linear_cross_entropy(hidden, head, targets, chunk, select=True) / count
        if side == "cce":  # its mean over the target tokens, ignored ones dropped first (as the others)
            return cce(hidden, head.weight, targets)
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        mask = targets != losses.IGNORE
        logprobs = ChunkedLogProbFunction.apply(hidden[mask], head.weight, head.bias, targets[mask], 1.0,
                                                _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ())[0]
        return -logprobs.sum() / count

    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        value = loss()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": peak, "peak_kind": "cuda" if dev.type == "cuda" else "rss",
            "tokens_per_second": batch * length / statistics.median(times[warmup:]), "loss": float(value)}


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(side: str, vocab: int, batch: int, length: int, steps: int, chunk: int, max_bytes: float,
            warmup: int = 2) -> dict:
    """One side and case in a fresh process; stopped (``over_cap``) once its resident memory passes ``max_bytes``."""
    args = [sys.executable, __file__, "--child", side, *map(str, (vocab, batch, length, steps, chunk, warmup))]
    with subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        over = False
        while proc.poll() is None:
            if _rss(proc.pid) > max_bytes:
                over = True
                proc.kill()
                break
            time.sleep(0.02)
        out, err = proc.communicate()
    if over:
        return {"error": f"over the {gib(max_bytes)} cap", "over_cap": True}
    if proc.returncode != 0:
        tail = err.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"error": tail[0][-300:]}
    return json.loads(out.strip().splitlines()[-1])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def compare(cases, sides, rounds: int, steps: int, chunk: int, max_bytes: float) -> dict:
    results = {}
    for case in cases:
        vocab, batch, length = case
        runs = {side: [] for side in sides}
        for _ in range(rounds):
            for side in sides:
                if runs[side] and runs[side][-1].get("over_cap"):  # it will not fit the next round either
                    runs[side].append(runs[side][-1])
                    continue
                runs[side].append(measure(side, vocab, batch, length, steps, chunk, max_bytes))
        name = f"{vocab}x{batch}x{length}"
        summary = {}
        for side, rs in runs.items():
            ok = [r for r in rs if "error" not in r]
            summary[side] = ({"peak_bytes": statistics.median(r["peak_bytes"] for r in ok),
                              "tokens_per_second": statistics.median(r["tokens_per_second"] for r in ok),
                              "loss": ok[0]["loss"]} if ok else {"error": rs[0]["error"]})
        results[name] = summary
        line = [f"{name}:"]
        hf = summary.get("hf", {})
        for side, s in summary.items():
            if "error" in s:
                line.append(f"{side} failed ({s['error']})")
                continue
            if hf.get("error", "").startswith("over"):  # hf's peak is above the cap: the ratio is a bound
                s["peak_ratio_below"] = s["peak_bytes"] / max_bytes
            line.append(f"{side} peak {gib(s['peak_bytes'])} {s['tokens_per_second']:.0f} tok/s")
            if side != "hf" and "error" not in hf:
                s["peak_ratio"] = s["peak_bytes"] / hf["peak_bytes"]
                s["speed_ratio"] = s["tokens_per_second"] / hf["tokens_per_second"]
                line.append(f"(x{s['peak_ratio']:.2f} peak, x{s['speed_ratio']:.2f} tok/s of hf)")
            elif "peak_ratio_below" in s:
                line.append(f"(peak < x{s['peak_ratio_below']:.2f} of hf's)")
        print(" ".join(line), flush=True)
    return results


def largest_batch(sides, cap: float, chunk: int) -> dict:
    """Per side, the largest batch of 128 tokens at vocab 50257 whose peak stays under ``cap`` (to 8 rows)."""
    found = {}
    for side in sides:
        def fits(batch):
            r = measure(side, 50257, batch, 128, 1, chunk, cap, warmup=1)
            ok = "error" not in r and r["peak_bytes"] <= cap
            print(f"  {side} batch {batch}: " + (gib(r["peak_bytes"]) if "peak_bytes" in r else r["error"]), flush=True)
            return ok

        best, over = 0, 8
        while over <= 4096 and fits(over):
            best, over = over, over * 2
        while over - best > 8:
            middle = (best + over) // 16 * 8
            best, over = (middle, over) if fits(middle) else (best, middle)
        found[side] = best or None
    print(f"largest batch under {gib(cap)} (x128 tokens, vocab 50257): "
          + ", ".join(f"{s} {b}" for s, b in found.items())
          + (f"; chunked/hf x{found['chunked'] / found['hf']:.1f}" if found.get("hf") and found.get("chunked") else ""),
          flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--cap-gib", type=float, default=4.0, help="the largest batch under this peak (0: skip)")
    parser.add_argument("--max-gib", type=float, default=14.0, help="stop a side whose memory passes this")
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=7)
    args = parser.parse_args()
    if args.child:
        side, *numbers = args.child
        print(json.dumps(child(side, *map(int, numbers))))
        return
    sides = tuple(args.sides.split(","))
    if "cce" in sides and cce_loss()[1]:
        print(f"cce skipped: {cce_loss()[1]}", flush=True)
        sides = tuple(s for s in sides if s != "cce")
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c]
    start = time.perf_counter()
    results = {"cases": compare(cases, sides, args.rounds, args.steps, args.chunk, args.max_gib * 2**30)}
    if args.cap_gib:
        results["largest_batch"] = largest_batch(sides, args.cap_gib * 2**30, args.chunk)
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

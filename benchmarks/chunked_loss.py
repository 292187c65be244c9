"""Peak memory and steady tokens/s of a causal-LM training step: the chunked loss (framework/losses.py) vs
transformers' own loss (``model(input_ids, labels=...).loss``, full logits) and TRL's chunked log-prob kernel.

    .venv/bin/python benchmarks/chunked_loss.py [--rounds 3] [--steps 4] [--cases 50257x16x128,...]
        [--cap-gib 3] [--json results.json]

The model is the default causal_lm recipe's (recipes/causal_lm.yaml: GPT-2, 4 layers, 128 wide, from scratch,
fp32) with the recipe's AdamW (torch's fused kernel), on random token blocks, every token a target. A case is
VOCAB x BATCH x LENGTH. Each (side, case) is measured in a fresh process (``--child``): 2 warm-up steps,
then ``--steps`` timed steps (forward, loss, backward, clip, AdamW step, zero_grad), on the CPU under the
framework's allocator setting (large buffers kept on the heap, framework/device.py), reporting its peak RSS
(``ru_maxrss``; on a GPU the CUDA allocator's peak) and the median step's tokens/s. The sides alternate within
each of ``--rounds`` rounds, and the ratios are of medians over rounds, side by side in one run:

- hf: the loss a user gets from transformers, ``model(input_ids=..., labels=...).loss``;
- chunked: the framework's path, ``losses.hidden_states`` then ``losses.linear_cross_entropy`` over
  ``train.loss_chunk_tokens`` (default 1024) tokens at a time, divided by the target count;
- trl: TRL's ``ChunkedLogProbFunction`` (trl/kernels/chunked_logprob.py, what its SFTTrainer's loss uses;
  torch tiles on the CPU) on the same hidden states.

Targets (at the default shape 50257x16x128): chunked peak <= 0.5x hf's, tokens/s >= 0.95x hf's. Then the
largest batch (doubling from 16, at length 128, vocab 50257) whose peak stays under ``--cap-gib``, per side:
target chunked >= 2x hf's.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("hf", "chunked", "trl")
DEFAULT_CASES = "50257x16x128,50257x8x1024,128256x16x128,128256x8x1024"


def child(side: str, vocab: int, batch: int, length: int, steps: int, chunk: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from framework import losses

    from framework import device

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":  # the framework's CPU allocator setting, on every side (framework/device.py)
        device._reuse_large_buffers()
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

    def loss():
        if side == "hf":
            return model(input_ids=ids, labels=ids).loss
        hidden, _ = losses.hidden_states(model, head, input_ids=ids)
        if side == "chunked":
            return losses.linear_cross_entropy(hidden, head, targets, chunk, select=True) / count
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        mask = targets != losses.IGNORE
        logprobs = ChunkedLogProbFunction.apply(hidden[mask], head.weight, head.bias, targets[mask], 1.0,
                                                _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ())[0]
        return -logprobs.sum() / count

    times = []
    for step in range(2 + steps):
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
            "tokens_per_second": batch * length / statistics.median(times[2:]), "loss": float(value)}


def measure(side: str, vocab: int, batch: int, length: int, steps: int, chunk: int) -> dict:
    args = [sys.executable, __file__, "--child", side, str(vocab), str(batch), str(length), str(steps), str(chunk)]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"error": tail[0][-300:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def compare(cases, sides, rounds: int, steps: int, chunk: int) -> dict:
    results = {}
    for case in cases:
        vocab, batch, length = case
        runs = {side: [] for side in sides}
        for _ in range(rounds):
            for side in sides:
                runs[side].append(measure(side, vocab, batch, length, steps, chunk))
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
            line.append(f"{side} peak {gib(s['peak_bytes'])} {s['tokens_per_second']:.0f} tok/s")
            if side != "hf" and "error" not in hf:
                s["peak_ratio"] = s["peak_bytes"] / hf["peak_bytes"]
                s["speed_ratio"] = s["tokens_per_second"] / hf["tokens_per_second"]
                line.append(f"(x{s['peak_ratio']:.2f} peak, x{s['speed_ratio']:.2f} tok/s of hf)")
        print(" ".join(line), flush=True)
    return results


def largest_batch(sides, cap: float, chunk: int) -> dict:
    """Per side, the largest batch (16, 32, 64, ...) of 128 tokens at vocab 50257 whose peak stays under ``cap``."""
    found = {}
    for side in sides:
        batch, best = 16, None
        while batch <= 4096:
            r = measure(side, 50257, batch, 128, 1, chunk)
            if "error" in r or r["peak_bytes"] > cap:
                break
            best, batch = batch, batch * 2
        found[side] = best
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
    parser.add_argument("--cap-gib", type=float, default=3.0)
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=6)
    args = parser.parse_args()
    if args.child:
        side, *numbers = args.child
        print(json.dumps(child(side, *map(int, numbers))))
        return
    sides = tuple(args.sides.split(","))
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c]
    results = {"cases": compare(cases, sides, args.rounds, args.steps, args.chunk)}
    if args.cap_gib:
        results["largest_batch"] = largest_batch(sides, args.cap_gib * 2**30, args.chunk)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

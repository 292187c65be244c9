"""GRPO's generation against ``model.generate`` as TRL 1.16's ``GRPOTrainer`` calls it: the same model (the
recipe's, adapters included), the same batch (the first step's prompts, each ``grpo.num_generations`` times),
in one process, the sides alternated over rounds.

    .venv/bin/python benchmarks/generation.py [--config recipes/grpo.yaml] [--rounds 3] [--calls 2]
        [--sides framework,generator,TRL] [KEY=VALUE ...]

- framework: ``framework.tasks.online_rl.sampling.generate``, as the GRPO step calls it: greedy decoding of the warped scores
  plus each row's own Gumbel noise, keyed by (seed, epoch, prompt, completion);
- generator: ``framework.generator.Generator`` (static cache, one prefill of the distinct prompts, masked decode
  steps) with the same keyed sampling, one instance over the calls (its cache kept); ``compiled``: the same with
  its decode step compiled by inductor (compiled in the warm-up call, whose seconds are printed);
- TRL: ``model.generate(input_ids, attention_mask, generation_config=GenerationConfig(**generation_kwargs,
  disable_compile=True))`` with TRL's ``generation_kwargs`` (``do_sample=True``, the recipe's temperature, top-p
  and top-k, its stop tokens, min_p None, repetition penalty 1), on the same left-padded prompts.

All run under ``backend.generating`` (eval mode, no gradients) with the model's own generation defaults as
each side sets them. Each call's figures: the completion tokens kept (through each row's first stop token, as
every side keeps them), the decode steps (generate runs until every row has stopped: the batch's longest
completion), seconds, and the process's CPU seconds (on a shared machine, less disturbed by the other work than
the wall clock). Printed per side: tokens/s and milliseconds per decode step, each the total over its calls, the
CPU seconds a call, and the ratios against TRL and framework. TRL samples other tokens, so its completions (and
decode steps) differ, and the time per decode step is the comparison that does not depend on what was drawn; the
generator sides draw what framework draws (the count of completions that differ is printed). For the generator
sides, their prefill's seconds and their decode steps' milliseconds apart. Then the decode step's bounds at the
batch's rows: its FLOPs at the throughput of a large matrix product (the vector units' bound) and its bytes of
fp32 weights at the bandwidth of a large tensor copy, both measured here. Then one whole GRPO step's time on the
same prompts, and each side's call against it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the framework, from this clone
from framework import backend, train  # noqa: E402
from framework.recipe import load_config  # noqa: E402
from framework.tasks.online_rl import sampling  # noqa: E402
from framework.tasks.online_rl.generator import Generator  # noqa: E402
from framework.tasks.online_rl.rollout import generation_batch  # noqa: E402


def trl_generate(model, prompts, task, tokenizer):
    """TRL 1.16's ``_generate_single_turn`` without vLLM: left-padded prompts, ``GenerationConfig`` from its
    ``generation_kwargs``, completions cut after the first stop token."""
    from transformers import GenerationConfig

    s, g = task.sampling, task.settings
    config = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=list(s.stop_ids),
                              temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, min_p=None,
                              repetition_penalty=1.0, cache_implementation=None, disable_compile=True)
    input_ids, attention_mask = sampling.left_padded(prompts, s.pad_id)
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             generation_config=config)
    return sampling.cut_at_stops(out[:, input_ids.shape[1]:].tolist(), s.stop_ids)


def timed(generate) -> tuple:
    """(completion tokens, decode steps, seconds, the process's CPU seconds) of one call."""
    start, cpu = time.perf_counter(), time.process_time()
    completions = generate()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return sum(len(c) for c in completions), max(len(c) for c in completions), seconds, cpu


def decode_bounds(model: torch.nn.Module, rows: int) -> str:
    """The decode step's lower bounds at ``rows`` rows: each weight is read once a step (fp32) and multiplied
    with every row (2 FLOPs a weight a row; attention over the short cache is left out: under 1%), against the
    bandwidth of a 256 MiB copy and the throughput of a 2048^3 matrix product, the best of 5 each."""
    weights = sum(p.numel() for p in model.parameters())  # tied weights once: the head reads the embedding
    source = torch.randn(64 * 2**20)
    target = torch.empty_like(source)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    copy_seconds, product_seconds = [], []
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        copy_seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.mm(a, b)
        product_seconds.append(time.perf_counter() - start)
    bandwidth = 2 * source.numel() * 4 / min(copy_seconds)  # bytes read and written
    flops = 2 * 2048**3 / min(product_seconds)
    step_bytes, step_flops = 4 * weights, 2 * weights * rows
    return (f"decode step bounds at {rows} rows: {weights / 1e6:.1f}M weights, {step_bytes / 1e6:.0f} MB read at "
            f"{bandwidth / 1e9:.1f} GB/s (copy) = {1000 * step_bytes / bandwidth:.1f} ms; {step_flops / 1e9:.2f} "
            f"GFLOP at {flops / 1e9:.0f} GFLOP/s (2048^3 product) = {1000 * step_flops / flops:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "recipes" / "grpo.yaml"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2, help="calls of each side per round")
    parser.add_argument("--sides", default="framework,generator,TRL",
                        help="comma-separated, of framework, generator, compiled, TRL")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, [*args.overrides, "report.enabled=false", "checkpoint.every_minutes=null",
                                    f"output_dir={ROOT / 'runs' / 'benchmark_generation'}", "overwrite=true"])
    if cfg.task != "grpo":
        sys.exit("generation.py measures the grpo task's generation: pass a grpo recipe")
    run = train.setup(cfg)
    task = run.task
    loader = iter(run.data.train_dl)
    batches = [next(loader) for _ in range(cfg.train.gradient_accumulation_steps)]
    prompts, seeds = generation_batch(batches, task.settings.num_generations, task.seed)
    generators = {"generator": Generator(), "compiled": Generator(compile="inductor")}
    known = {
        "framework": lambda model: sampling.generate(model, prompts, seeds, task.sampling, synced=task.synced),
        "generator": lambda model: generators["generator"](model, prompts, seeds, task.sampling,
                                                           synced=task.synced).completions,
        "compiled": lambda model: generators["compiled"](model, prompts, seeds, task.sampling,
                                                         synced=task.synced).completions,
        "TRL": lambda model: trl_generate(model, prompts, task, run.tokenizer),
    }
    sides = {name: known[name] for name in args.sides.split(",")}
    totals = {name: [0, 0, 0.0, 0.0] for name in sides}
    drawn = {}  # each side's completions: every call of a side draws the same
    split = {name: [0.0, 0.0, 0] for name in sides if name in generators}  # prefill s, decode s, decode steps
    group = task.settings.num_generations
    print(f"{len(prompts)} rows ({len(prompts) // group} prompts x {group}), "
          f"prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, up to "
          f"{task.sampling.max_new_tokens} new tokens; torch threads {torch.get_num_threads()}")
    with backend.generating(run.accelerator, run.model, run.mesh) as model:
        for name, generate in sides.items():  # warm-up: first-call allocations, the compiled side's compilation
            start = time.perf_counter()
            drawn[name] = generate(model)
            print(f"warm-up call of {name}: {time.perf_counter() - start:.1f} s")
        if "framework" in drawn:
            print("completions unlike framework's: " + ", ".join(
                f"{name} {sum(a != b for a, b in zip(drawn[name], drawn['framework']))} of {len(prompts)}"
                for name in drawn if name != "framework"))
        for round_ in range(1, args.rounds + 1):
            order = list(sides) if round_ % 2 else list(reversed(sides))
            figures = {}
            for name in order:
                for _ in range(args.calls):
                    tokens, steps, seconds, cpu = timed(lambda: sides[name](model))
                    for i, value in enumerate((tokens, steps, seconds, cpu)):
                        totals[name][i] += value
                    if name in split:
                        timings = generators[name].timings
                        for i, value in enumerate((timings.prefill, timings.decode, timings.steps)):
                            split[name][i] += value
                    figures.setdefault(name, []).append(f"{tokens / seconds:.0f} tok/s, "
                                                        f"{1000 * seconds / steps:.0f} ms/step")
            print(f"round {round_}: " + "; ".join(f"{n}: {', '.join(f)}" for n, f in figures.items()))
        print(decode_bounds(model, len(prompts)))
    calls = args.rounds * args.calls
    rows = {name: (tokens / seconds, 1000 * seconds / steps, tokens / calls, cpu / calls)
            for name, (tokens, steps, seconds, cpu) in totals.items()}
    for name, (rate, per_step, mean_tokens, cpu) in rows.items():
        ratios = ", ".join(f"x{rate / rows[other][0]:.2f} tokens/s, x{per_step / rows[other][1]:.2f} ms/step vs {other}"
                           for other in ("TRL", "framework") if other in rows and other != name)
        detail = (f"; prefill {split[name][0] / calls:.2f} s, decode {1000 * split[name][1] / split[name][2]:.1f} ms "
                  "a step" if name in split else "")
        print(f"{name:9s}  {rate:8.1f} completion tokens/s  {per_step:7.1f} ms per decode step  "
              f"({mean_tokens:.0f} tokens, {cpu:.2f} CPU s a call{detail}){'  ' + ratios if ratios else ''}")
    # Where a whole step's time goes: the same prompts' step (generation, scoring, the updates), timed after one
    # untimed step (its completions differ as the weights move), against the generation's time measured above.
    run.model.train()
    run.train_step(run.context, batches)
    start = time.perf_counter()
    for _ in range(args.calls):
        run.train_step(run.context, batches)
    step_seconds = (time.perf_counter() - start) / args.calls
    print(f"one GRPO step on these prompts: {step_seconds:.2f} s (its generation: the generator's); a call of " + ", ".join(
        f"{name} {totals[name][2] / calls:.2f} s ({100 * totals[name][2] / calls / step_seconds:.0f}%)"
        for name in sides))


if __name__ == "__main__":
    main()

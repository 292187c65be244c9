"""GRPO's generation against ``model.generate`` as TRL 1.16's ``GRPOTrainer`` calls it: the same model (the
recipe's, adapters included), the same batch (the first step's prompts, each ``grpo.num_generations`` times),
in one process, the two sides alternated over rounds.

    .venv/bin/python benchmarks/generation.py [--config recipes/grpo.yaml] [--rounds 3] [--calls 2] [KEY=VALUE ...]

- framework: ``framework.tasks.online_rl.sampling.generate``, as the GRPO step calls it: greedy decoding of the warped scores
  plus each row's own Gumbel noise, keyed by (seed, epoch, prompt, completion);
- TRL: ``model.generate(input_ids, attention_mask, generation_config=GenerationConfig(**generation_kwargs,
  disable_compile=True))`` with TRL's ``generation_kwargs`` (``do_sample=True``, the recipe's temperature, top-p
  and top-k, its stop tokens, min_p None, repetition penalty 1), on the same left-padded prompts.

Both run under ``backend.generating`` (eval mode, no gradients) with the model's own generation defaults as
each side sets them. Each call's figures: the completion tokens kept (through each row's first stop token, as
both sides keep them), the decode steps (generate runs until every row has stopped: the batch's longest
completion), and seconds. Printed per side: tokens/s and milliseconds per decode step, each the total over its
calls, and their framework/TRL ratios; the two sides sample different tokens, so their completions (and decode
steps) differ, and the time per decode step is the comparison that does not depend on what was drawn. Then one
whole GRPO step's time on the same prompts, and generation's share of it.
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
    """(completion tokens, decode steps, seconds) of one call."""
    start = time.perf_counter()
    completions = generate()
    seconds = time.perf_counter() - start
    return sum(len(c) for c in completions), max(len(c) for c in completions), seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "recipes" / "grpo.yaml"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2, help="calls of each side per round")
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
    sides = {
        "framework": lambda model: sampling.generate(model, prompts, seeds, task.sampling, synced=task.synced),
        "TRL": lambda model: trl_generate(model, prompts, task, run.tokenizer),
    }
    totals = {name: [0, 0, 0.0] for name in sides}
    group = task.settings.num_generations
    print(f"{len(prompts)} rows ({len(prompts) // group} prompts x {group}), "
          f"prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, up to "
          f"{task.sampling.max_new_tokens} new tokens; torch threads {torch.get_num_threads()}")
    with backend.generating(run.accelerator, run.model, run.mesh) as model:
        for generate in sides.values():  # warm-up: first-call allocations
            generate(model)
        for round_ in range(1, args.rounds + 1):
            order = list(sides) if round_ % 2 else list(reversed(sides))
            figures = {}
            for name in order:
                for _ in range(args.calls):
                    tokens, steps, seconds = timed(lambda: sides[name](model))
                    for i, value in enumerate((tokens, steps, seconds)):
                        totals[name][i] += value
                    figures.setdefault(name, []).append(f"{tokens / seconds:.0f} tok/s, "
                                                        f"{1000 * seconds / steps:.0f} ms/step")
            print(f"round {round_}: " + "; ".join(f"{n}: {', '.join(f)}" for n, f in figures.items()))
    rows = {name: (tokens / seconds, 1000 * seconds / steps, tokens / (args.rounds * args.calls))
            for name, (tokens, steps, seconds) in totals.items()}
    for name, (rate, per_step, mean_tokens) in rows.items():
        print(f"{name:9s}  {rate:8.1f} completion tokens/s  {per_step:7.1f} ms per decode step  "
              f"({mean_tokens:.0f} tokens a call)")
    (ours, ours_step, _), (theirs, theirs_step, _) = rows["framework"], rows["TRL"]
    print(f"framework / TRL: tokens/s {ours / theirs:.2f}, time per decode step {ours_step / theirs_step:.2f}")
    # Where a whole step's time goes: the same prompts' step (generation, scoring, the updates), timed after one
    # untimed step (its completions differ as the weights move), against the generation's time measured above.
    run.model.train()
    run.train_step(run.context, batches)
    start = time.perf_counter()
    for _ in range(args.calls):
        run.train_step(run.context, batches)
    step_seconds = (time.perf_counter() - start) / args.calls
    generation_seconds = totals["framework"][2] / (args.rounds * args.calls)
    print(f"one GRPO step on these prompts: {step_seconds:.2f} s; their generation above {generation_seconds:.2f} s "
          f"a call, {100 * generation_seconds / step_seconds:.0f}% of it")


if __name__ == "__main__":
    main()

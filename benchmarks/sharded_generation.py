"""Generation under FSDP2 or DeepSpeed ZeRO-3 on 2 CPU processes: the weights gathered block by block in every
forward (each decode step gathers the whole model, a block at a time) against gathered once for the whole
generation (``backend.generating(gather_once=True)``, what online RL does where the memory plan says the weights
fit), on the same model, prompts and tokens, the sides alternated over rounds.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml --num_processes 2 \
        benchmarks/sharded_generation.py [--config recipes/grpo.yaml] [--rows 8] [--prompt 32] [--tokens 32] \
        [--rounds 3] [distributed.strategy=deepspeed distributed.deepspeed.zero_stage=3] [KEY=VALUE ...]

The recipe (recipes/grpo.yaml by default; its adapters off: ``peft=null``) names the model, and the framework
builds the Accelerator from it (``backend.build_accelerator``): FSDP2 (``distributed.strategy=fsdp``, the default
here) or ZeRO-3 as training shards them, in fp32, each process its share of the cores. The model generates greedily
through transformers' ``generate`` with ``min_new_tokens = max_new_tokens`` (every row and process decodes the same
steps, which block-by-block gathering needs: each gather is a collective). Each process gets its own prompts
(random token ids seeded by its rank). Printed by the first process: each side's seconds per call (the rounds'
median), tokens/s over both processes, FSDP2's all-gathers per call, and the ratio; the two sides' tokens are
checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the framework, from this clone
from framework import backend  # noqa: E402
from framework.recipe import load_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "recipes" / "grpo.yaml"))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, ["distributed.strategy=fsdp", "peft=null", *args.overrides])
    accelerator, _ = backend.build_accelerator(cfg, 1)
    if accelerator.num_processes != 2 or not (backend.is_fsdp2(accelerator) or backend.is_zero3(accelerator)):
        sys.exit("launch it on 2 processes under FSDP2 or ZeRO-3: accelerate launch --config_file "
                 "accelerate_configs/cpu_ddp.yaml --num_processes 2 benchmarks/sharded_generation.py "
                 "[distributed.strategy=deepspeed distributed.deepspeed.zero_stage=3]")
    model = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # prepared as training prepares it
    ids = torch.randint(10, model.config.vocab_size - 10, (args.rows, args.prompt),
                        generator=torch.Generator().manual_seed(accelerator.process_index))
    # a loader of the prompts too: DeepSpeed reads its micro-batch from one
    model, optimizer, _ = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(ids, batch_size=args.rows))
    # FSDP2's all-gathers (all_gather_single in torch 2.13, looked up on torch.distributed at each call). DeepSpeed's
    # are not counted (none reached this one: its backend keeps the functions it found when it started, we infer).
    all_gather = torch.distributed.all_gather_single
    gathers = []

    def counted(*a, **k):
        gathers.append(1)
        return all_gather(*a, **k)
    torch.distributed.all_gather_single = counted

    def call(gather_once: bool):
        gathers.clear()
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        with backend.generating(accelerator, model, backend.Mesh(), gather_once=gather_once) as generator:
            with torch.no_grad():
                out = generator.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                         pad_token_id=generator.config.eos_token_id or 0)
        accelerator.wait_for_everyone()
        return time.perf_counter() - start, len(gathers), out

    call(True), call(False)  # warm-up: first forwards, allocations
    seconds = {"block by block": [], "gathered once": []}
    tokens, counts = {}, {}
    for _ in range(args.rounds):
        for side in seconds:
            s, n, out = call(side == "gathered once")
            seconds[side].append(s)
            tokens[side], counts[side] = out, n
    torch.distributed.all_gather_single = all_gather
    same = torch.equal(tokens["block by block"], tokens["gathered once"])
    if accelerator.is_main_process:
        generated = 2 * args.rows * args.tokens
        print(f"{cfg.model.name_or_path}: {backend.strategy_name(accelerator, backend.Mesh())} on 2 CPU processes, "
              f"{args.rows} rows a process, prompts of {args.prompt} tokens, {args.tokens} new tokens, "
              f"{args.rounds} rounds alternated; {torch.get_num_threads()} threads a process")
        for side, s in seconds.items():
            median = statistics.median(s)
            gathered = "DeepSpeed's gathers not counted" if backend.is_zero3(accelerator) else \
                f"{counts[side]} all-gathers a call"
            print(f"  {side}: {median:.2f} s a call ({', '.join(f'{x:.2f}' for x in s)}), "
                  f"{generated / median:.1f} tokens/s, {gathered}")
        ratio = statistics.median(seconds["block by block"]) / statistics.median(seconds["gathered once"])
        print(f"  gathered once / block by block: {ratio:.2f}x the tokens/s; the same tokens: {same}")
    if not same:
        sys.exit("the two sides generated different tokens")
    accelerator.end_training()


if __name__ == "__main__":
    main()

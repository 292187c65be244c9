"""Generation under FSDP2 on 2 CPU processes: the weights gathered block by block in every forward (each decode
step all-gathers the whole model, one block at a time) against gathered once for the whole generation
(``backend.generating(gather_once=True)``, what online RL does where the memory plan says the weights fit), on the
same model, prompts and tokens, the sides alternated over rounds.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml --num_processes 2 \\
        benchmarks/fsdp_generation.py [--model assets/SmolLM2-135M-Instruct] [--rows 8] [--prompt 32] \\
        [--tokens 32] [--rounds 3]

The model is sharded as the framework's FSDP2 strategy shards it (its decoder layers wrapped), in fp32, and
generates greedily with ``min_new_tokens = max_new_tokens`` (every row and process decodes the same steps, which
block-by-block gathering needs: each gather is a collective). Each process gets its own prompts (random token ids,
seeded by its rank). Printed by the first process: each side's seconds per call (the rounds' median), tokens/s over
both processes, all-gathers per call, and the ratio; the two sides' tokens are checked equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the framework, from this clone
from framework import backend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "assets" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    layer = type(model.model.layers[0]).__name__
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=[layer], cpu_ram_efficient_loading=False)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    backend.fsdp2_on_cpu_processes(accelerator, plugin)
    if accelerator.num_processes != 2:
        sys.exit("launch it on 2 processes: accelerate launch --config_file accelerate_configs/cpu_ddp.yaml "
                 "--num_processes 2 benchmarks/fsdp_generation.py")
    # the launcher sets one thread a process; the framework gives each its share of the cores
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // accelerator.num_processes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # prepared as training prepares it
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(10, model.config.vocab_size - 10, (args.rows, args.prompt),
                        generator=torch.Generator().manual_seed(accelerator.process_index))
    all_gather = torch.distributed.all_gather_single  # FSDP2's all-gather (torch 2.13), looked up at each call
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
                                         pad_token_id=model.config.eos_token_id or 0)
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
        print(f"{model.config._name_or_path}: FSDP2 on 2 CPU processes, {args.rows} rows a process, prompts of "
              f"{args.prompt} tokens, {args.tokens} new tokens, {args.rounds} rounds alternated; "
              f"{torch.get_num_threads()} threads a process")
        for side, s in seconds.items():
            median = statistics.median(s)
            print(f"  {side}: {median:.2f} s a call ({', '.join(f'{x:.2f}' for x in s)}), "
                  f"{generated / median:.1f} tokens/s, {counts[side]} all-gathers a call")
        ratio = statistics.median(seconds["block by block"]) / statistics.median(seconds["gathered once"])
        print(f"  gathered once / block by block: {ratio:.2f}x the tokens/s; the same tokens: {same}")
    if not same:
        sys.exit("the two sides generated different tokens")
    accelerator.end_training()


if __name__ == "__main__":
    main()

"""Generating in the middle of training leaves training as it was: a tiny GPT-2 trained 6 steps with a greedy
generation inside ``backend.generating`` after step 3 ends with the very weights (bitwise) of the same 6 steps
without it. Dropout is on, so a model left in eval mode would train differently. ``fsdp``: on 2 CPU processes under
FSDP2 (launched by tests/test_fsdp.py, as tests/scripts/fsdp_contract.py), block by block and with the weights
gathered once (``gather_once``): the same tokens and weights, and one all-gather per FSDP module for the whole
generation instead of one per module and forward; ``plain``: one process (tests/test_backend.py)."""

import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def train(accelerator, generate_at: int, gather_once: bool = False):
    """(the final weights, the generated tokens, the all-gathers entering ``generating``, and during the generation
    inside it, and the FSDP modules)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from framework import backend

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                                        eos_token_id=0, loss_type="ForCausalLM"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    data = torch.Generator().manual_seed(1 + accelerator.process_index)
    out, gathers, entering = None, [], 0
    # FSDP2's all-gather (torch 2.13: torch.distributed.all_gather_single, looked up at each call).
    all_gather = torch.distributed.all_gather_single if torch.distributed.is_initialized() else None

    def counted(*args, **kwargs):
        gathers.append(1)
        return all_gather(*args, **kwargs)
    for step in range(1, 7):
        ids = torch.randint(0, 40, (2, 12), generator=data).to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == generate_at:
            if all_gather is not None:
                torch.distributed.all_gather_single = counted
            with backend.generating(accelerator, model, backend.Mesh(), gather_once=gather_once) as generator:
                entering = len(gathers)
                generator.eval()  # as a task's sample does; the context puts training mode back
                with torch.no_grad():
                    prompt = ids[:1, :4].to(generator.device)
                out = generator.generate(input_ids=prompt, max_new_tokens=5, do_sample=False,
                                             pad_token_id=0)
                assert out.shape == (1, 9), out.shape
            if all_gather is not None:
                torch.distributed.all_gather_single = all_gather
    assert model.training
    modules = sum(isinstance(m, FSDPModule) for m in model.modules())
    return ([p.full_tensor() if hasattr(p, "full_tensor") else p.detach().cpu().clone() for p in model.parameters()],
            out, entering, len(gathers) - entering, modules)


def main() -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from framework import backend

    if sys.argv[1] == "fsdp":
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["GPT2Block"],
                                                cpu_ram_efficient_loading=False)
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        assert backend.fsdp2_on_cpu_processes(accelerator, plugin) and accelerator.num_processes == 2
    else:
        accelerator = Accelerator(cpu=True)
    without = train(accelerator, generate_at=0)[0]
    with_generation, tokens, _, per_forward, modules = train(accelerator, generate_at=3)
    assert all(torch.equal(a, b) for a, b in zip(without, with_generation)), "generating changed the training"
    if sys.argv[1] == "fsdp":
        gathered, gathered_tokens, once, inside, _ = train(accelerator, generate_at=3, gather_once=True)
        assert all(torch.equal(a, b) for a, b in zip(without, gathered)), "generating gathered changed the training"
        assert torch.equal(tokens, gathered_tokens), (tokens, gathered_tokens)
        # At most one all-gather per FSDP module on entering (one holding no weights of its own gathers none), none
        # while generating; block by block, each of the 2 blocks gathers in each forward (a prefill and 4 decodes).
        assert 0 < once <= modules and inside == 0 and per_forward >= 2 * 5, (once, inside, modules, per_forward)
        print(f"all-gathers in a generation: {per_forward} block by block, {once} gathered once ({modules} FSDP "
              "modules)")
    if accelerator.is_main_process:
        print(f"generating mid-training kept the weights ({sys.argv[1]})")
    accelerator.end_training()


if __name__ == "__main__":
    main()

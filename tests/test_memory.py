"""The memory plan against hand-computed numbers and against what the optimizers really hold."""

from __future__ import annotations

import pytest
import torch

from framework import backend, memory
from framework.backend.layout import sharded_states
from framework.config import DistributedConfig, OptimConfig, RunConfig
from framework.optim import build_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")


def plan_of(model: torch.nn.Module, cfg: RunConfig, shards: int) -> dict:
    """The plan as train.py makes it: the recipe's states laid out over ``shards`` devices."""
    return memory.plan(model, cfg, backend.memory_layout(cfg, shards))

# The small model below, by hand:
#   Linear(64, 128): weight (128, 64) = 8192, bias 128; LayerNorm(128): 128 + 128; Linear(128, 4): (4, 128) = 512, 4
PARAMS = 8192 + 128 + 128 + 128 + 512 + 4  # 9092
VECTOR_ELEMENTS = 128 + 128 + 128 + 4  # 388
STATE = {
    "adamw": 8 * PARAMS,  # 72736: two fp32 moments
    # 8-bit only for tensors of 4096+ elements: the first weight, 1 byte per moment + two fp32 scales per
    # 256-element block; the others keep two fp32 moments.
    "adamw_8bit": (2 * 8192 + 2 * 4 * (8192 // 256)) + 8 * (PARAMS - 8192),  # 16640 + 7200 = 23840
    "paged_adamw_8bit": 23840,
    "lion": 4 * PARAMS,  # 36368: one fp32 momentum
    "sgd": 4 * PARAMS,  # momentum buffer
    # Row + column statistics for the matrices, a full second moment for the vectors.
    "adafactor": 4 * (128 + 64) + 4 * (4 + 128) + 4 * VECTOR_ELEMENTS,  # 768 + 528 + 1552 = 2848
}


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 4))


def tiny_bert(**overrides) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    settings = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    max_position_embeddings=32, num_labels=2)
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(**{**settings, **overrides}))


def recipe(**optim) -> RunConfig:
    cfg = RunConfig()
    cfg.optim = OptimConfig(**optim)
    return cfg


@pytest.mark.parametrize("name", list(STATE))
def test_single_device_plan_by_hand(name):
    plan = plan_of(small_model(), recipe(name=name), 1)
    assert (plan["parameters"], plan["trainable_parameters"]) == (PARAMS, PARAMS)
    assert (plan["weight_bytes"], plan["gradient_bytes"]) == (4 * PARAMS, 4 * PARAMS)
    assert plan["optimizer_state_bytes"] == STATE[name]
    assert plan["activation_bytes"] is None  # not a transformer: no estimate, and none in the total
    assert plan["total_bytes"] == 8 * PARAMS + STATE[name]


def test_sgd_without_momentum_has_no_state():
    assert plan_of(small_model(), recipe(name="sgd", momentum=0.0), 1)["optimizer_state_bytes"] == 0


def test_frozen_parameters_have_weights_but_no_gradients_or_state():
    model = small_model()
    model[0].requires_grad_(False)
    plan = plan_of(model, recipe(), 1)
    trainable = PARAMS - 8192 - 128
    assert (plan["trainable_parameters"], plan["weight_bytes"]) == (trainable, 4 * PARAMS)
    assert (plan["gradient_bytes"], plan["optimizer_state_bytes"]) == (4 * trainable, 8 * trainable)


def test_zero2_shards_gradients_and_state_over_4():
    cfg = recipe()
    cfg.distributed = DistributedConfig(strategy="deepspeed")
    cfg.distributed.deepspeed.zero_stage = 2
    plan = plan_of(small_model(), cfg, 4)
    assert (plan["weight_bytes"], plan["gradient_bytes"], plan["optimizer_state_bytes"]) == (36368, 9092, 18184)
    assert plan["sharded"] == ["gradients", "optimizer_state"]


def test_zero2_bf16_keeps_16_bit_copies_and_an_fp32_master():
    cfg = recipe()
    cfg.precision = "bf16"
    cfg.distributed = DistributedConfig(strategy="deepspeed")
    plan = plan_of(small_model(), cfg, 4)
    # weights 2 bytes; gradients 2 bytes / 4; Adam moments 8 + master weights 4 bytes, / 4
    assert (plan["weight_bytes"], plan["gradient_bytes"], plan["optimizer_state_bytes"]) == (18184, 4546, 27276)


def test_fsdp_full_shard_divides_everything_by_4():
    cfg = recipe()
    cfg.distributed = DistributedConfig(strategy="fsdp")
    plan = plan_of(small_model(), cfg, 4)
    assert (plan["weight_bytes"], plan["gradient_bytes"], plan["optimizer_state_bytes"]) == (9092, 9092, 18184)
    assert plan["total_bytes"] == 9092 + 9092 + 18184


def test_ddp_replicates_everything():
    cfg = recipe()
    cfg.distributed = DistributedConfig(strategy="ddp")
    plan = plan_of(small_model(), cfg, 4)
    assert (plan["weight_bytes"], plan["gradient_bytes"], plan["optimizer_state_bytes"]) == (36368, 36368, 72736)


@pytest.mark.parametrize("strategy, setting, value, sharded", [
    ("deepspeed", "zero_stage", 0, []),
    ("deepspeed", "zero_stage", 1, ["optimizer_state"]),
    ("deepspeed", "zero_stage", 3, ["gradients", "optimizer_state", "weights"]),
    ("fsdp", "sharding_strategy", "SHARD_GRAD_OP", ["gradients", "optimizer_state"]),
    ("fsdp", "sharding_strategy", "NO_SHARD", []),
])
def test_what_each_layout_shards(strategy, setting, value, sharded):
    distributed = DistributedConfig(strategy=strategy)
    setattr(getattr(distributed, strategy), setting, value)
    assert sorted(sharded_states(distributed)) == sharded


def test_offloaded_states_leave_the_device_total():
    cfg = recipe()
    cfg.distributed = DistributedConfig(strategy="deepspeed")
    cfg.distributed.deepspeed.offload_optimizer = "cpu"
    plan = plan_of(small_model(), cfg, 4)
    assert plan["offloaded"] == ["optimizer_state"]
    assert plan["total_bytes"] == 36368 + 9092
    cfg.distributed = DistributedConfig(strategy="fsdp")
    cfg.distributed.fsdp.offload_params = True
    assert plan_of(small_model(), cfg, 4)["total_bytes"] == 0


def test_the_launch_layout_overrides_the_recipe():
    cfg = recipe()
    plan = memory.plan(small_model(), cfg, backend.memory_layout(cfg, 4, DistributedConfig(strategy="fsdp")))
    assert plan["weight_bytes"] == 9092


@pytest.mark.parametrize("launched, setting, value, sharded, per_device", [
    ("FSDP", "fsdp.sharding_strategy", "SHARD_GRAD_OP", ["gradients", "optimizer_state"], (36368, 9092, 18184)),
    ("FSDP", "fsdp.sharding_strategy", "FULL_SHARD", ["gradients", "optimizer_state", "weights"], (9092, 9092, 18184)),
    ("DEEPSPEED", "deepspeed.zero_stage", 1, ["optimizer_state"], (36368, 36368, 18184)),
    ("DEEPSPEED", "deepspeed.zero_stage", 3, ["gradients", "optimizer_state", "weights"], (9092, 9092, 18184)),
])
def test_strategy_auto_plans_what_the_launch_config_sets_up(monkeypatch, launched, setting, value, sharded,
                                                            per_device):
    """As train.py calls it, plan(model, cfg, processes): strategy auto under an FSDP or DeepSpeed launch config
    (accelerate exports ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED) is that strategy, with the recipe's
    settings."""
    cfg = recipe()
    section, key = setting.split(".")
    setattr(getattr(cfg.distributed, section), key, value)
    assert plan_of(small_model(), cfg, 4)["sharded"] == []  # no such launch: nothing sharded
    monkeypatch.setenv(f"ACCELERATE_USE_{launched}", "true")
    plan = plan_of(small_model(), cfg, 4)
    assert cfg.distributed.strategy == "auto" and plan["sharded"] == sharded
    assert (plan["weight_bytes"], plan["gradient_bytes"], plan["optimizer_state_bytes"]) == per_device


def test_activation_estimate_by_hand():
    # b=4, s=16, h=32, i=64, a=2: b*s*h = 2048, b*s*i = 4096, b*a*s*s = 2048.
    # fp32, per layer: 4 * (8*2048 + 2*4096 + 2*2048) + (2*2048 + 2048) = 114688 + 6144 = 120832.
    config = tiny_bert().config
    assert memory.activation_estimate(config, 4, 16, 4, checkpointing=False) == 2 * 120832
    # bf16: 2 * 28672 + 6144 = 63488 per layer.
    assert memory.activation_estimate(config, 4, 16, 2, checkpointing=False) == 2 * 63488
    # Checkpointing: each layer's input (4 * 2048) plus one layer recomputed.
    assert memory.activation_estimate(config, 4, 16, 4, checkpointing=True) == 2 * 4 * 2048 + 120832
    assert memory.activation_estimate(object(), 4, 16, 4, checkpointing=False) is None


def test_activation_estimate_is_korthikanti_for_16_bit_and_4h():
    b, s, h, a = 8, 64, 32, 4
    config = tiny_bert(hidden_size=h, num_attention_heads=a, intermediate_size=4 * h, num_hidden_layers=1).config
    assert memory.activation_estimate(config, b, s, 2, checkpointing=False) == 34 * s * b * h + 5 * a * s * s * b


def test_plan_uses_the_recipe_batch_length_precision_and_checkpointing():
    cfg = recipe()
    cfg.train.batch_size, cfg.data.max_length, cfg.precision, cfg.train.gradient_checkpointing = 4, 16, "no", True
    model = tiny_bert()
    plan = plan_of(model, cfg, 1)
    assert plan["activation_bytes"] == 2 * 4 * 2048 + 120832
    assert plan["total_bytes"] == plan["weight_bytes"] + plan["gradient_bytes"] + plan["optimizer_state_bytes"] + \
        plan["activation_bytes"]
    cfg.train.gradient_checkpointing, cfg.precision = False, "bf16"
    assert plan_of(model, cfg, 1)["activation_bytes"] == 2 * 63488


def test_the_generations_kv_cache_by_hand_and_in_the_total():
    """A key and a value per layer, token and key-value head (grouped-query attention: 2 of 4 heads here); the
    total counts the larger of the cache (held while generating) and the update's activations."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    # 8 rows x 40 tokens x 3 layers x (key, value) x 2 heads x 16 wide x 4 bytes.
    assert memory.kv_cache_estimate(config, 8, 40, 4) == 8 * 40 * 3 * 2 * 2 * 16 * 4
    assert memory.kv_cache_estimate(config, 8, 40, 2) == 8 * 40 * 3 * 2 * 2 * 16 * 2
    assert memory.kv_cache_estimate(config, 0, 40, 4) == 0
    cfg = recipe()
    cfg.train.batch_size, cfg.data.max_length, cfg.precision = 4, 16, "no"
    model = tiny_bert()
    states = plan_of(model, cfg, 1)
    states = states["weight_bytes"] + states["gradient_bytes"] + states["optimizer_state_bytes"]
    for rows in (1, 10_000):  # a cache smaller than the activations, then a larger one
        plan = memory.plan(model, cfg, backend.memory_layout(cfg, 1),
                           memory.Workload(seq_length=16, generated_rows=rows, generated_length=24))
        assert plan["kv_cache_bytes"] == memory.kv_cache_estimate(model.config, rows, 24, 4)
        assert plan["total_bytes"] == states + max(plan["activation_bytes"], plan["kv_cache_bytes"])
    assert "generation's KV cache: " in memory.format_plan(plan)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_generation_gathers_the_whole_weights_once_where_they_fit(strategy):
    """Under FSDP2 and ZeRO-3 a generating task holds the whole weights during generation, beside its shard and the
    KV cache: the plan counts the gathered copy (the full weights less the shard) where the total with it fits the
    device, and otherwise plans block-by-block gathers (and leaves it out); a device of unknown size plans block by
    block. ZeRO-2 and DDP hold whole weights anyway."""
    cfg = recipe()
    cfg.distributed = DistributedConfig(strategy="fsdp" if strategy == "fsdp" else "deepspeed")
    cfg.distributed.deepspeed.zero_stage = 3
    cfg.train.batch_size, cfg.data.max_length, cfg.precision = 4, 16, "no"
    model = tiny_bert()
    workload = memory.Workload(seq_length=16, generated_rows=64, generated_length=24)

    def plan(device_bytes):
        return memory.plan(model, cfg, backend.memory_layout(cfg, 2), workload, device_bytes)

    unknown = plan(None)
    whole = sum(memory.weight_bytes(p) for p in model.parameters())
    assert unknown["gathered_weight_bytes"] == whole - unknown["weight_bytes"] > 0 and not unknown["gathers_weights"]
    states = unknown["weight_bytes"] + unknown["gradient_bytes"] + unknown["optimizer_state_bytes"]
    generation = unknown["kv_cache_bytes"] + unknown["gathered_weight_bytes"]
    assert unknown["total_bytes"] == states + max(unknown["activation_bytes"], unknown["kv_cache_bytes"])
    fits = plan(states + generation)
    assert fits["gathers_weights"] and fits["total_bytes"] == states + max(fits["activation_bytes"], generation)
    assert "gathered once per generation" in memory.format_plan(fits)
    tight = plan(states + generation - 1)
    assert not tight["gathers_weights"] and tight["total_bytes"] == unknown["total_bytes"]
    assert "gathered block by block in each forward" in memory.format_plan(tight)
    assert not memory.plan(model, cfg, backend.memory_layout(cfg, 2), memory.Workload(seq_length=16),
                           1 << 40)["gathered_weight_bytes"]  # a task that does not generate
    cfg.distributed = DistributedConfig(strategy="deepspeed")
    cfg.distributed.deepspeed.zero_stage = 2
    assert not memory.plan(model, cfg, backend.memory_layout(cfg, 2), workload, 1 << 40)["gathered_weight_bytes"]


def test_adamw_plan_is_within_5_percent_of_the_measured_state():
    model = tiny_bert()
    cfg = recipe(name="adamw", lr=1e-3)
    optimizer = build_optimizer(model, cfg.optim, "cpu")
    model(input_ids=torch.tensor([[2, 7, 9, 3]]), labels=torch.tensor([1])).loss.backward()
    optimizer.step()
    measured = memory.optimizer_state_bytes(optimizer)
    planned = plan_of(model, cfg, 1)["optimizer_state_bytes"]
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured)


@pytest.mark.parametrize("name", list(STATE))
def test_state_estimate_matches_the_optimizers_own_tensors(name):
    """Exact up to what the estimate leaves out on purpose: torch's 4-byte step counter and Adafactor's RMS
    per tensor, and bitsandbytes' two shared 256-entry quantization maps."""
    model = small_model()
    optimizer = build_optimizer(model, OptimConfig(name=name, lr=1e-3), "cpu")
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    extra = {"adamw": 4 * 6, "adafactor": 4 * 6, "adamw_8bit": 2 * 256 * 4, "paged_adamw_8bit": 2 * 256 * 4}
    assert memory.optimizer_state_bytes(optimizer) == STATE[name] + extra.get(name, 0)


def test_format_plan_is_short_and_in_mib():
    cfg = recipe()
    cfg.distributed = DistributedConfig(strategy="deepspeed")
    cfg.distributed.deepspeed.offload_optimizer = "cpu"
    text = memory.format_plan(plan_of(tiny_bert(), cfg, 4))
    lines = text.splitlines()
    assert lines[0].startswith("memory plan per device") and len(lines) == 7
    assert "gradients: " in text and "(sharded over 4 devices)" in lines[3]
    assert "optimizer state (adamw): " in lines[4] and "(sharded over 4 devices, on the host)" in lines[4]
    assert "activations: " in lines[5] and "batch 32 x 128 tokens" in lines[5]
    assert lines[6].startswith("  total on the device: ") and lines[6].endswith(" MiB")
    assert "unknown" in memory.format_plan(plan_of(small_model(), recipe(), 1))


def test_capacity_warning_only_when_the_plan_exceeds_the_device():
    plan = plan_of(tiny_bert(), recipe(), 1)
    assert memory.capacity_warning(plan, None) is None
    assert memory.capacity_warning(plan, plan["total_bytes"]) is None
    warning = memory.capacity_warning(plan, plan["total_bytes"] // 2)
    assert "per device, more than the device's" in warning and "(activations " in warning
    assert "train.batch_size" in warning and "train.gradient_checkpointing=true" in warning

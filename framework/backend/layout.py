"""How a strategy lays the training states out over the processes, for the memory plan: ``framework/memory.py``
counts the bytes from a ``MemoryLayout``; this says which states are split how many ways, which leave the device,
and what else the strategy changes about them."""

from __future__ import annotations

from typing import FrozenSet, Optional

from framework.backend.saving import local_shard
from framework.backend.selection import resolved_distributed
from framework.config import DistributedConfig, RunConfig
from framework.memory import MemoryLayout

STATES = frozenset({"weights", "gradients", "optimizer_state"})
# What each layout splits across processes (the rest is replicated on every device).
ZERO_SHARDED = {0: frozenset(), 1: frozenset({"optimizer_state"}),
                2: frozenset({"optimizer_state", "gradients"}), 3: STATES}
FSDP_SHARDED = {"FULL_SHARD": STATES, "HYBRID_SHARD": STATES,
                "SHARD_GRAD_OP": frozenset({"optimizer_state", "gradients"}), "NO_SHARD": frozenset()}


def sharded_states(distributed: DistributedConfig) -> FrozenSet[str]:
    """Which of weights, gradients and optimizer state the strategy splits across processes."""
    if distributed.strategy == "deepspeed":
        return ZERO_SHARDED[distributed.deepspeed.zero_stage]
    if distributed.strategy == "fsdp":
        return FSDP_SHARDED[distributed.fsdp.sharding_strategy]
    if distributed.strategy == "xla_fsdp" or distributed.tensor_parallel:
        return STATES
    return frozenset()


def offloaded_states(distributed: DistributedConfig) -> FrozenSet[str]:
    """Which states the strategy keeps in host memory instead of on the device. FSDP's parameter offload
    moves gradients along and steps the optimizer on the CPU."""
    if distributed.strategy == "deepspeed":
        z = distributed.deepspeed
        moved = {"optimizer_state"} if z.offload_optimizer != "none" else set()
        if z.offload_params != "none":
            moved.add("weights")
        return frozenset(moved)
    if distributed.strategy == "fsdp" and distributed.fsdp.offload_params:
        return STATES
    return frozenset()


def memory_layout(cfg: RunConfig, shards: int, distributed: Optional[DistributedConfig] = None) -> MemoryLayout:
    """The layout of the recipe's states over ``shards`` devices. ``distributed`` defaults to the recipe's with the
    strategy resolved the way the run resolves it (``resolved_distributed``: strategy auto under an FSDP or
    DeepSpeed launch config is that strategy, with the recipe's settings)."""
    d = distributed or resolved_distributed(cfg)
    fsdp = d.strategy == "fsdp"
    return MemoryLayout(
        shards=shards, sharded=sharded_states(d), offloaded=offloaded_states(d),
        half_copies=d.strategy == "deepspeed" and cfg.precision in ("fp16", "bf16"),
        first_chunk=fsdp and d.fsdp.version == 2,
        gathers_for_generation=(fsdp and d.fsdp.version == 2) or d.strategy == "deepspeed",
        local_piece=local_shard if d.tensor_parallel else None,
        activation_checkpointing=fsdp and d.fsdp.activation_checkpointing)

"""Questions about what the run got, asked instead of matching accelerate's distributed type by name: XLA or
not, tensor parallelism, how the processes split the data and the states."""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

if TYPE_CHECKING:
    from accelerate import Accelerator


def tensor_parallel_size(accelerator: Accelerator) -> int:
    """How many processes share each model by tensor parallelism (1 without it)."""
    config = getattr(accelerator, "parallelism_config", None)
    return config.tp_size if config is not None and config.tp_enabled else 1


def is_tensor_parallel(accelerator: Accelerator) -> bool:
    """Whether each model is split over several processes by tensor parallelism."""
    return tensor_parallel_size(accelerator) > 1


def is_fsdp2(accelerator: Accelerator) -> bool:
    """Whether FSDP2 (torch's ``fully_shard``) shards the model: its parameters are DTensors."""
    return getattr(accelerator, "is_fsdp2", False)


def has_dtensor_parameters(accelerator: Accelerator) -> bool:
    """Whether the parameters are DTensors, each process holding its shard (FSDP2, tensor parallelism)."""
    return is_fsdp2(accelerator) or is_tensor_parallel(accelerator)


def is_zero3(accelerator: Accelerator) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the parameters: a weight is whole only inside its own module's forward
    (DeepSpeed's hooks gather it there), so nothing may read one outside it (the chunked loss's head)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None) if accelerator.distributed_type == "DEEPSPEED" else None
    return plugin is not None and plugin.zero_stage == 3


def shards_parameters(accelerator: Accelerator) -> bool:
    """Whether the strategy (FSDP, DeepSpeed) places and shards the model itself in ``prepare``: its weights are
    not whole on every process, and a model built beside it is not sharded alike."""
    return accelerator.distributed_type in ("FSDP", "DEEPSPEED")


def data_parallel(accelerator: Accelerator) -> Tuple[int, int]:
    """(this process's data-parallel rank, the number of data-parallel replicas): the processes of a tensor-
    parallel group read the same data."""
    tp = tensor_parallel_size(accelerator)
    return accelerator.process_index // tp, accelerator.num_processes // tp


def parameter_shards(accelerator: Accelerator) -> int:
    """Over how many processes the sharded states are split: all of them, or under HSDP a replica's."""
    config = getattr(accelerator, "parallelism_config", None)
    return config.dp_shard_size if config is not None and is_fsdp2(accelerator) else \
        accelerator.num_processes


def needs_static_shapes(accelerator: Accelerator) -> bool:
    """XLA compiles one graph per input shape: batches there must come in a few fixed shapes."""
    return on_xla(accelerator)


def on_xla(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == "XLA"


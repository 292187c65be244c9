"""The model's states gathered for saving and for metrics: full state dicts from shards (FSDP, DeepSpeed, tensor
parallelism, XLA SPMD), checkpoints, and the bytes this process holds of sharded tensors."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Dict, Iterable, Optional

import torch

from framework.backend import xla_spmd
from framework.backend.topology import has_dtensor_parameters, is_tensor_parallel, on_xla

if TYPE_CHECKING:
    from accelerate import Accelerator


def state_dict_for_save(accelerator: Accelerator, model: torch.nn.Module,
                        mesh: xla_spmd.Mesh) -> Dict[str, torch.Tensor]:
    """The full state dict, on the CPU. Every process must call it (FSDP and DeepSpeed gather collectively);
    XLA tensors must come to the host before safetensors can write them (sharded ones assembled from their
    shards)."""
    if mesh.shard_parameters:
        inner = accelerator.unwrap_model(model)
        return _without_tied_copies(inner, mesh.state_dict(inner))
    state_dict = accelerator.get_state_dict(model)
    if on_xla(accelerator):  # each tensor its own host copy: tied weights are no longer one tensor
        state_dict = {name: tensor.cpu() for name, tensor in state_dict.items()}
    if state_dict is not None and (has_dtensor_parameters(accelerator) or on_xla(accelerator)
                                   or accelerator.distributed_type == "DEEPSPEED"):  # ZeRO-3: None but on the first
        state_dict = _without_tied_copies(accelerator.unwrap_model(model), state_dict)
    if is_tensor_parallel(accelerator):  # DTensor shards, gathered whole on every process
        state_dict = {name: tensor.full_tensor() if _is_dtensor(tensor) else tensor
                      for name, tensor in state_dict.items()}
    return state_dict


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


@contextmanager
def saving_gathered(model: torch.nn.Module):
    """``save_pretrained`` of a tensor-parallel model on the main process alone, from its gathered state dict:
    transformers ends such a save with a barrier of every process (``barrier_after_gathered_checkpoint_save``,
    for saves that every process makes), which the other processes would never join. Its distributed config is
    set aside while saving (config.json never holds it anyway)."""
    config = model.config
    distributed = getattr(config, "distributed_config", None)
    config.distributed_config = None
    try:
        yield
    finally:
        config.distributed_config = distributed


def gather_for_metrics(accelerator: Accelerator, outputs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """accelerate's ``gather_for_metrics`` over the data-parallel processes; under tensor parallelism every
    process evaluated the same batches, so its own outputs are already all of them (gathering would count each
    example once per process)."""
    if is_tensor_parallel(accelerator):
        return outputs
    return accelerator.gather_for_metrics(outputs)


def _without_tied_copies(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The state dict without the second name of a tied weight (GPT-2's lm_head.weight, the embedding's). FSDP2,
    tensor parallelism and DeepSpeed gather each name into its own tensor, so save_pretrained, which finds ties by shared
    storage, wrote both (a model/ that differed from DDP's by a redundant copy of the embedding); xla_fsdp's host
    copies too."""
    first: Dict[int, str] = {}
    copies = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        name = name.replace(xla_spmd.PREFIX, "")  # under xla_fsdp, the names without the wrappers'
        if first.setdefault(id(p), name) != name:
            copies.add(name)
    return {name: tensor for name, tensor in state_dict.items() if name not in copies}


def held_bytes(accelerator: Accelerator, mesh: xla_spmd.Mesh) -> Optional[Callable[[Iterable[torch.Tensor]], int]]:
    """Where the states are sharded, a function giving the bytes this process (the first device under xla_fsdp)
    holds of some tensors, read from their shards; None where every process holds them whole."""
    if has_dtensor_parameters(accelerator):
        return _local_shard_bytes
    return mesh.held_bytes


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (FSDP2's, tensor parallelism's) or of a ZeRO-3 parameter (its
    ``ds_tensor``: the parameter itself is an empty placeholder between forwards); any other tensor whole."""
    if _is_dtensor(tensor):
        return tensor.to_local()
    return getattr(tensor, "ds_tensor", tensor)


def _local_shard_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this process's shards of these tensors."""
    return sum(t.numel() * t.element_size() for t in map(local_shard, tensors))


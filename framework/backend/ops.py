"""What the training loop does on the device each step: placing the model, clipping gradients, the device scalars
it accumulates and reads, the transfers to the host."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, List, Optional

import torch

from framework.backend import xla_spmd
from framework.backend.build import fsdp2_wrap_classes
from framework.backend.topology import is_fsdp2, is_tensor_parallel, on_xla, shards_parameters

if TYPE_CHECKING:
    from accelerate import Accelerator


def clip_gradients(accelerator: Accelerator, model: torch.nn.Module, max_norm: Optional[float]) -> torch.Tensor:
    """Scale the gradients down to a global 2-norm of at most ``max_norm`` (None: only measure it), as accelerate's
    ``clip_grad_norm_``; returns the norm before clipping (a device scalar, the same on every process). Where the
    gradients are plain tensors in host memory (the CPU: one process, or DDP over gloo) the multiplication is
    skipped when its factor is 1: torch multiplies by ``min(1, max_norm / (norm + 1e-6))`` unconditionally, so
    that an accelerator never waits for the host to read the norm, a read that costs nothing on the CPU, and
    multiplying by 1 changes no bit. One pass over every gradient fewer at the steps that do not clip; the
    factor is computed as torch computes it, so the result is bitwise the same (a non-finite norm still
    multiplies)."""
    from accelerate.utils import DistributedType

    if (accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU)
            or accelerator.device.type != "cpu" or is_tensor_parallel(accelerator)):
        norm = accelerator.clip_grad_norm_(model.parameters(), float("inf") if max_norm is None else max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2 and TP: a DTensor
    accelerator.unscale_gradients()
    parameters = list(model.parameters())
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    if max_norm is not None and not bool(max_norm / (norm + 1e-6) >= 1.0):
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


def place_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """Move the model to its device before the optimizer is built over its parameters: fused optimizers
    check the device, and on XLA the parameters must already be device tensors. FSDP and DeepSpeed place
    (and shard) the model themselves in prepare(); FSDP2 is told which of its blocks to shard one by one."""
    if shards_parameters(accelerator):
        fsdp2_wrap_classes(accelerator, model)
        return model
    model = model.to(accelerator.device)
    # On XLA, moving a module makes new parameter objects, which unties shared weights (GPT-2's embedding and
    # output layer trained as two matrices, measured); transformers models tie them again.
    if on_xla(accelerator) and hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def check_optimizer_parameters(accelerator: Accelerator, model: torch.nn.Module, optimizer) -> None:
    """After ``prepare`` under FSDP2 (whose optimizer accelerate points at the shards by data pointer): the
    optimizer holds each trained parameter of the model once, or the run stops here, naming the first that is not."""
    if not is_fsdp2(accelerator):
        return
    held = Counter(id(p) for group in optimizer.optimizer.param_groups for p in group["params"])
    for name, param in model.named_parameters():
        if param.requires_grad and held[id(param)] != 1:
            raise RuntimeError(f"FSDP2: the optimizer holds {name} {held[id(param)]} times after prepare "
                               "(once expected): accelerate mapped its parameters to the wrong shards")


def unwrap(accelerator: Accelerator, model: torch.nn.Module, mesh: xla_spmd.Mesh) -> torch.nn.Module:
    """The model without accelerate's wrappers (DDP, ...) nor the XLA FSDP wrapper."""
    return mesh.unwrap(accelerator.unwrap_model(model))


def run_pending(accelerator: Accelerator) -> None:
    """On XLA, execute the lazily traced ops now, so what is read next is already computed (and what is traced
    next starts a new graph); nothing elsewhere."""
    if on_xla(accelerator):
        import torch_xla

        torch_xla.sync()


def zero_scalar(accelerator: Accelerator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A one-element zero placed on the device as data. XLA turns a 0-dim zero into a traced constant,
    which would be one more graph to compile; a transferred 1-element tensor stays plain device data."""
    return torch.zeros(1, dtype=dtype).to(accelerator.device)


def total_over_processes(accelerator: Accelerator, count):
    """The sum of ``count`` over the processes: an int (the same on every process) is multiplied, a device
    tensor is all-reduced on the device (no host sync; on XLA it joins the step's graph)."""
    if isinstance(count, int):
        return count * accelerator.num_processes
    return accelerator.reduce(count, reduction="sum") if accelerator.num_processes > 1 else count


def read_scalar(accelerator: Accelerator, tensor: torch.Tensor, reduction: str) -> float:
    """Host sync: the value of a device scalar, reduced over processes. On XLA the pending step graph runs
    first (the same graph as every other step), so the read only transfers data and compiles nothing."""
    run_pending(accelerator)
    if accelerator.num_processes > 1:
        tensor = accelerator.reduce(tensor, reduction=reduction)
    return tensor.item()


def to_host(accelerator: Accelerator, tensors: List[torch.Tensor]) -> list:
    """Device tensors as NumPy arrays after a single sync (on XLA, joining them on the device would
    compile yet another graph; a tensor sharded under SPMD is assembled from its shards, since its ``.cpu()``
    compiles a graph every time)."""
    run_pending(accelerator)
    if on_xla(accelerator):
        return [xla_spmd.on_host(t).numpy() for t in tensors]
    return [t.cpu().numpy() for t in tensors]


def preemption_check_interval(accelerator: Accelerator, log_every: int) -> int:
    """Optimizer steps between checks for a stop signal. One process just reads a flag every step; several
    must agree on the step (an all-reduce and a host read), so they check only when they log anyway."""
    return 1 if accelerator.num_processes == 1 else log_every



def any_process(accelerator: Accelerator, *flags: bool) -> List[bool]:
    """Each flag, true when it is true on any process. With several processes this is an all-reduce and a
    host read, so the loop asks only at log steps; one process just reads its own flags."""
    if accelerator.num_processes == 1:
        return list(flags)
    summed = accelerator.reduce(torch.tensor([float(f) for f in flags], device=accelerator.device), reduction="sum")
    return [bool(v) for v in summed.tolist()]

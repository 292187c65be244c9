"""Generating (a short sample, the harness) in the middle of training or after it, and back to training exactly."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from framework.backend import xla_spmd
from framework.backend.ops import unwrap
from framework.backend.topology import is_fsdp2, is_zero3, on_xla

if TYPE_CHECKING:
    from accelerate import Accelerator


GENERATE_REGISTERED = "_framework_fsdp_generate"  # set on an FSDP2 root whose generate() runs its forward hooks
GATHERED = "_framework_weights_gathered"  # True on a model while ``generating(gather_once=True)`` holds its weights


def weights_gathered(model: torch.nn.Module) -> bool:
    """Whether ``model``'s sharded weights are whole for the generation under way (its forwards gather nothing)."""
    return getattr(model, GATHERED, False)


@contextmanager
def generating(accelerator: Accelerator, model: torch.nn.Module, mesh: xla_spmd.Mesh,
               static_shapes: bool = False, gather_once: bool = False) -> Iterator[torch.nn.Module]:
    """The model to generate with, as a context: on exit the trained model is as training left it (on its device,
    sharded as it was, in its training mode), so training can go on bitwise as if nothing had been generated.

    - XLA, ``static_shapes`` (the caller generates with fixed shapes: online RL's generator): the model itself, on
      its device (under xla_spmd replicated on every device; under xla_fsdp sharded, each wrapped block's weights
      gathered by the compiled graph as in training).
    - XLA otherwise: a copy on the host CPU. Generating token by token makes a new shape, so a new compiled graph,
      per token (minutes even for a tiny model); moving the model itself there and back would make new parameter
      objects, leaving the optimizer's behind. Under xla_fsdp the copy is assembled from the shards.
    - FSDP2: ``generate`` registered as a forward of the root (torch's ``register_fsdp_forward_method``), so that
      it gathers the weights the root holds outside the wrapped blocks (embeddings, final norm) and reshards them
      after, as the root's forward does: a peft model's ``generate()`` bypasses that forward (it calls the inner
      model's), and before the first training step the root would not be initialised (each block a root of its
      own, which FSDP refuses). Each block gathers its own weights in its forward, a collective: processes
      generating different numbers of tokens must do it in lockstep (``sampling.generate(synced=True)``).
      ``gather_once`` (where the memory plan says the whole weights fit: its ``gathers_weights``): every module's
      weights gathered once instead, kept whole through the generation's forwards, then sharded again
      (``_gathered``): no collective per token, so no lockstep either.
    - DeepSpeed ZeRO-3: each module gathers its weights in its forward, in lockstep as FSDP2's blocks do; with
      ``gather_once`` every weight gathered once and DeepSpeed's hooks off while generating
      (``_zero3_gathered``, TRL's ``unwrap_model_for_generation``).
    - Tensor parallelism, DDP, one process: the model itself (without accelerate's wrappers).
    Every process must enter it: sharded models gather collectively."""
    if mesh.shard_parameters and not static_shapes:
        yield mesh.host_model(accelerator.unwrap_model(model))
        return
    inner = unwrap(accelerator, model, mesh)
    if on_xla(accelerator) and not static_shapes:
        yield _host_copy(inner)
        return
    training = inner.training
    try:
        if gather_once and is_fsdp2(accelerator):
            with _gathered(inner):
                yield generation_ready(accelerator, inner)
        elif gather_once and is_zero3(accelerator):
            with _zero3_gathered(model, inner):
                yield generation_ready(accelerator, inner)
        else:
            yield generation_ready(accelerator, inner)
    finally:
        inner.train(training)


@contextmanager
def _gathered(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2: each FSDP module's weights all-gathered once (``unshard``) and kept whole after its forwards
    (``set_reshard_after_forward(False)``, as torch's docs suggest for evaluation), then sharded again with each
    module's resharding as it was. The root is initialised first (what its first forward would do), so that what
    is restored is what training runs with; FSDP2 keeps that setting in its private state (torch 2.13)."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]  # the root first
    modules[0]._get_fsdp_state()._lazy_init()
    states = [m._get_fsdp_state() for m in modules]
    before = [(state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups])
              for state in states]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    setattr(model, GATHERED, True)
    try:
        yield
    finally:
        setattr(model, GATHERED, False)
        for m, state, (auto, infos) in zip(modules, states, before):
            m.reshard()
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info


@contextmanager
def _zero3_gathered(engine, model: torch.nn.Module) -> Iterator[None]:
    """DeepSpeed ZeRO-3: every weight of ``engine`` (the DeepSpeedEngine; ``model`` the module inside it) gathered
    once (``GatheredParameters``) and DeepSpeed's forward and backward hooks removed while generating, so that no
    forward gathers or releases a weight; the hooks registered again after, their recorded trace invalidated. As
    TRL 1.16's ``unwrap_model_for_generation`` (``remove_hooks``, ``add_hooks``), on DeepSpeed's own attributes."""
    import deepspeed  # the deepspeed extra: only a ZeRO-3 run, which has it, comes here

    offload = getattr(engine.optimizer, "parameter_offload", None) or engine.optimizer
    with deepspeed.zero.GatheredParameters(list(engine.parameters())):
        for param in [*offload.module.parameters(), *offload.module.ds_external_parameters()]:
            param.ds_active_sub_modules.clear()
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        setattr(model, GATHERED, True)
        try:
            yield
        finally:
            setattr(model, GATHERED, False)
            coordinator = getattr(offload, "param_coordinator", None)
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()
            offload._register_deepspeed_module(offload.module)


def generation_ready(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (unwrapped) with its ``generate``, where it has one, able to run: under FSDP2 registered, once, as
    a forward of the root (``generating``'s docstring). For what generates outside ``generating``: a task's
    evaluation. (What only calls the model, a classifier's sample, goes through the root's forward anyway.)"""
    if is_fsdp2(accelerator) and hasattr(model, "generate") and not getattr(model, GENERATE_REGISTERED, False):
        register_fsdp_forward_method(model, "generate")
        setattr(model, GENERATE_REGISTERED, True)
    return model


def _host_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the model whose parameters and buffers are host copies of its own (shared ones stay shared): each
    tensor is transferred once, and nothing is copied on the device."""
    memo = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(tensor) not in memo:
            host = tensor.detach().to("cpu")
            memo[id(tensor)] = torch.nn.Parameter(host, tensor.requires_grad) if isinstance(
                tensor, torch.nn.Parameter) else host
    return copy.deepcopy(model, memo)

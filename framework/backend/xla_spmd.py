"""XLA SPMD, for the backend: one process drives every XLA device through a device mesh with a
``data`` and an ``fsdp`` axis (``distributed.strategy`` xla_spmd or xla_fsdp).

- xla_spmd: each batch is split over every device; the parameters stay replicated and the compiler adds the
  gradient all-reduce (a [N, 1] mesh).
- xla_fsdp: the parameters, so also their gradients and the optimizer state, are sharded over the fsdp axis by
  torch_xla's ``SpmdFullyShardedDataParallel`` (what the Trainer's ``xla_fsdp_v2`` uses), each transformer block
  wrapped on its own; each batch is split over both axes. A [1, N] mesh (the default) shards everything N ways;
  a [D, F] mesh keeps D replicas of F-way shards (hybrid sharding).

accelerate 1.15 has no XLA FSDP of its own (its FSDP plugin never applies on XLA): the model is wrapped here
before ``accelerator.prepare``, which then treats it as any XLA model. Checkpoints and ``model/`` are written from
the shards assembled on the host: a ``.cpu()`` of a sharded tensor would compile a graph per tensor, every save.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from framework.config import RunConfig
from framework.errors import UserError

AXES = ("data", "fsdp")
PREFIX = "_orig_module."  # what the FSDP wrapper adds to the names of the parameters it holds


class Mesh:
    """The devices one process drives and how a run splits over them; ``Mesh()`` is the run without SPMD (one
    device, nothing split)."""

    def __init__(self, shape: Tuple[int, int] = (1, 1), xla_mesh=None, shard_parameters: bool = False):
        self.data, self.fsdp = shape
        self.xla_mesh, self.shard_parameters = xla_mesh, shard_parameters

    @property
    def devices(self) -> int:
        """The devices a batch is split over (and counts as per device)."""
        return self.data * self.fsdp

    @property
    def parameter_shards(self) -> int:
        """How many ways each parameter (and its gradient and optimizer state) is split."""
        return self.fsdp if self.shard_parameters else 1

    @property
    def extra_graphs(self) -> int:
        """Compiled graphs the sharding adds to a run's (the compile watch's expectation): xla_fsdp compiles up to
        2 more than one device (measured: the classifier's runs, online RL's, none after the first evaluation)."""
        return 2 if self.shard_parameters else 0

    def describe(self) -> Optional[str]:
        if self.xla_mesh is None:
            return None
        if not self.shard_parameters:
            return f"xla spmd (batch sharded over {self.devices} devices)"
        return (f"xla fsdp (parameters, gradients and optimizer state sharded over {self.fsdp} devices, batch over "
                f"{self.devices}; mesh data {self.data} x fsdp {self.fsdp})")

    def _batch_spec(self, tensor: torch.Tensor) -> tuple:
        return (AXES,) + (None,) * (tensor.dim() - 1)

    def shard_loader(self, loader):
        """The loader, sending each batch to the devices already split along its first dimension (torch_xla's
        device loader takes the sharding): marking a tensor that is on the device copies it through the host."""
        if self.xla_mesh is not None and hasattr(loader, "_parallel_loader_kwargs"):  # an MpDeviceLoader
            loader._parallel_loader_kwargs["input_sharding"] = _BatchSharding(self)
        return loader

    def shard_batch(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Split every batch tensor over the devices along its first (batch) dimension, where the loader did not."""
        if self.xla_mesh is not None:
            import torch_xla
            import torch_xla.distributed.spmd as xs

            for tensor in batch.values():  # online RL's prompt batches hold lists too
                if torch.is_tensor(tensor) and not torch_xla._XLAC._get_xla_sharding_spec(tensor):
                    xs.mark_sharding(tensor, self.xla_mesh, self._batch_spec(tensor))
        return batch

    def shard_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Under xla_fsdp, the model (already on the XLA device, its tied weights tied again) with every transformer
        block (the model's ``_no_split_modules``) and then the rest sharded over the fsdp axis."""
        if not self.shard_parameters:
            return model
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        blocks = set(getattr(model, "_no_split_modules", None) or ())
        classes = {type(m) for m in model.modules() if type(m).__name__ in blocks}
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes) if classes else None
        return SpmdFullyShardedDataParallel(model, mesh=self.xla_mesh, shard_output=self._shard_output,
                                            auto_wrap_policy=policy)

    def _shard_output(self, output, mesh) -> None:
        """Every wrapped module's output sharded along the batch, which makes the compiler gather each block's
        parameters for its computation (the FSDP algorithm): a block's hidden states, the model's logits."""
        import torch_xla.distributed.spmd as xs

        tensor = output if torch.is_tensor(output) else output[0] if isinstance(output, tuple) else output.logits
        xs.mark_sharding(tensor, mesh, self._batch_spec(tensor))

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model inside the FSDP wrapper (whose blocks stay wrapped: use ``state_dict`` for plain names)."""
        return model.module if self.shard_parameters else model

    def state_dict(self, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
        """The full state dict on the host under the model's own names, assembled from the shards."""
        return {name.replace(PREFIX, ""): on_host(t) for name, t in model.state_dict().items()}

    def host_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """A plain copy of the model on the host CPU (generation): the wrapped one only runs sharded."""
        inner = self.unwrap(model)
        copy = type(inner)(inner.config)
        copy.load_state_dict(self.state_dict(model))
        return copy.eval()

    @property
    def held_bytes(self) -> Optional[Callable[[Iterable[torch.Tensor]], int]]:
        """Under xla_fsdp, a function giving the bytes the first device holds of some tensors (their shards)."""
        return _device_bytes if self.shard_parameters else None

    def attach(self, accelerator, optimizer) -> None:
        """Checkpoints through ``accelerator.save_state``/``load_state`` without a compile per tensor: the weights
        and the optimizer state are assembled on the host before accelerate writes them, and the optimizer state
        loaded back (replicated) is sharded like its parameters again."""
        if not self.shard_parameters:
            return

        def host_weights(models, weights, output_dir) -> None:
            for i, model in enumerate(models):
                weights[i] = {name: on_host(t) for name, t in model.state_dict().items()}

        accelerator.register_save_state_pre_hook(host_weights)
        state_dict, load_state_dict = optimizer.state_dict, optimizer.load_state_dict

        def host_state_dict():
            return _map_tensors(state_dict(), on_host)

        def load_and_shard(saved) -> None:
            import torch_xla

            load_state_dict(saved)
            for group in optimizer.optimizer.param_groups:
                for p in group["params"]:
                    sharding = torch_xla._XLAC._get_xla_op_sharding(p)
                    for value in optimizer.optimizer.state.get(p, {}).values():
                        if sharding and torch.is_tensor(value) and value.shape == p.shape:
                            torch_xla._XLAC._xla_mark_sharding(value, sharding)

        optimizer.state_dict, optimizer.load_state_dict = host_state_dict, load_and_shard


class _BatchSharding:
    """What torch_xla's device loader asks of its ``input_sharding`` (a ShardingSpec's ``xla_spec``), for tensors of
    any rank: each split along its first dimension over the whole mesh."""

    minibatch = False

    def __init__(self, mesh: Mesh):
        self.mesh, self.specs = mesh, {}

    def xla_spec(self, tensor: torch.Tensor):
        import torch_xla.distributed.spmd as xs

        rank = tensor.dim()
        if rank not in self.specs:
            self.specs[rank] = xs.ShardingSpec(self.mesh.xla_mesh, self.mesh._batch_spec(tensor))
        return self.specs[rank].xla_spec(tensor)


def _device_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the first device holds of these tensors, read from their shards (a tensor without a sharding is
    whole on every device; a shard's padding, for a dimension the devices do not divide, counts)."""
    import torch_xla

    held = 0
    for t in tensors:
        if t.device.type != "xla" or not torch_xla._XLAC._get_xla_sharding_spec(t):
            held += t.numel() * t.element_size()
            continue
        for data, where in torch_xla._XLAC._get_local_shards([t])[0]:
            if int(where.split(":")[-1]) == 0:
                held += data.numel() * data.element_size()
    return held


def on_host(t):
    """A tensor on the host: an XLA tensor sharded under SPMD assembled from its shards (its ``.cpu()`` would
    compile a graph, every time), others copied."""
    import torch_xla

    if not torch.is_tensor(t) or t.device.type != "xla":
        return t
    if not torch_xla._XLAC._get_xla_sharding_spec(t):
        return t.cpu()
    torch_xla._XLAC._xla_wait_device_ops(devices=[])  # its shards are read directly: the graph making them is done
    shards = torch_xla._XLAC._get_local_shards([t])[0]
    places = torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]
    full = torch.empty(t.shape, dtype=t.dtype)
    for (data, _), (_, index) in zip(shards, places):
        if index is Ellipsis:  # replicated
            return data.clone()
        full[tuple(index)] = data[tuple(slice(0, i.stop - i.start) for i in index)]  # without the padding
    return full


def _map_tensors(obj, fn):
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return fn(obj)


def start(cfg: RunConfig) -> Mesh:
    """The mesh for the recipe's strategy, SPMD switched on: call before the XLA runtime starts (before the
    Accelerator exists). ``Mesh()`` for any other strategy."""
    strategy = cfg.distributed.strategy
    if strategy not in ("xla_spmd", "xla_fsdp"):
        return Mesh()
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    devices = xr.global_runtime_device_count()
    shape = tuple(cfg.distributed.mesh or ((devices, 1) if strategy == "xla_spmd" else (1, devices)))
    if shape[0] * shape[1] != devices:
        raise UserError(f"distributed.mesh: {list(shape)} covers {shape[0] * shape[1]} devices, but there are "
                        f"{devices}; use a [data, fsdp] shape whose product is {devices}")
    return Mesh(shape, xs.Mesh(np.arange(devices), shape, AXES), shard_parameters=strategy == "xla_fsdp")

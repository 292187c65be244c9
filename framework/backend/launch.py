"""What the launch really started, checked against the recipe, and said in the plan: the backend, the strategy and
the fallbacks by design."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from framework.backend import xla_spmd
from framework.backend.cpu import cpu_threads
from framework.backend.selection import resolved_distributed
from framework.backend.topology import is_tensor_parallel, on_xla, tensor_parallel_size
from framework.config import RunConfig
from framework.errors import UserError

if TYPE_CHECKING:
    from accelerate import Accelerator


def check_launch(cfg: RunConfig, accelerator: Accelerator) -> None:
    """What the launch started must be what the recipe asked for."""
    got = backend_name(accelerator)
    if cfg.backend not in ("auto", got):
        raise UserError(f"backend: the recipe asks for {cfg.backend} but the run got {got} "
                        f"({accelerator.distributed_type.value}); check the launch config")
    if cfg.precision != accelerator.mixed_precision:
        raise UserError(f"precision: the recipe asks for {cfg.precision} but accelerate set up "
                        f"{accelerator.mixed_precision} on {accelerator.device}; choose a precision the device supports")
    # What the launcher started (torchrun and the DeepSpeed launcher export these; the TPU launcher does not)
    # must be what accelerate set up: otherwise every launched process trains on its own, all into the same
    # output_dir.
    world, local = (int(os.environ.get(name) or 0) for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    if (world and world != accelerator.num_processes) or local > accelerator.num_processes:
        started = f"{world} processes ({local} on this machine)" if world else f"{local} processes on this machine"
        raise UserError(f"backend: the launch started {started} but accelerate "
                        f"set up {accelerator.num_processes} ({accelerator.distributed_type.value} on "
                        f"{accelerator.device}); use backend=cpu to train several CPU processes, or launch one "
                        "process per GPU or XLA device")
    if "ACCELERATE_USE_CPU" in os.environ and "MASTER_ADDR" in os.environ and "WORLD_SIZE" not in os.environ:
        # accelerate's simple launcher sets MASTER_ADDR for a multi-process config it then starts as one
        # process (distributed_type MULTI_CPU without mpirun).
        raise UserError("the launch config asks for several processes but only one was started; on the CPU use "
                        "--config_file accelerate_configs/cpu_ddp.yaml (MULTI_GPU with use_cpu: true)")
    expected = cfg.distributed.num_processes
    if expected and expected != accelerator.num_processes:
        raise UserError(f"distributed.num_processes: the recipe expects {expected} processes but the launch "
                        f"started {accelerator.num_processes}; pass --num_processes {expected} to accelerate launch")


def backend_name(accelerator: Accelerator) -> str:
    if on_xla(accelerator):
        return "xla"
    return "gpu" if accelerator.device.type == "cuda" else accelerator.device.type


def strategy_name(accelerator: Accelerator, mesh: xla_spmd.Mesh) -> str:
    kind = accelerator.distributed_type
    if kind == "FSDP":
        config = getattr(accelerator, "parallelism_config", None)
        if config is not None and config.dp_replicate_size > 1:
            return (f"fsdp (version 2, HSDP: {config.dp_replicate_size} replicas x {config.dp_shard_size} "
                    "shards)")
        return f"fsdp (version {accelerator.state.fsdp_plugin.fsdp_version})"
    if kind == "DEEPSPEED":
        return f"deepspeed (ZeRO stage {accelerator.state.deepspeed_plugin.zero_stage})"
    if is_tensor_parallel(accelerator):
        return f"tensor parallel ({tensor_parallel_size(accelerator)} processes)"
    if mesh.describe():
        return mesh.describe()
    if accelerator.num_processes > 1:
        return "xla data parallel" if on_xla(accelerator) else "ddp"
    return "single process"


def notes(cfg: RunConfig, accelerator: Accelerator) -> List[str]:
    """Where the run falls back by design: said in the plan, never silent."""
    said = []
    if cfg.backend == "auto" and backend_name(accelerator) == "cpu":
        said.append("backend auto: no GPU or XLA device found, training on the CPU")
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launched and launched != cfg.precision:
        said.append(f"precision {cfg.precision} comes from the recipe; the launch config's {launched} is not used")
    if cfg.distributed.strategy == "ddp" and accelerator.num_processes == 1:
        said.append("distributed.strategy ddp with one process: no data parallelism (launch more processes)")
    d = resolved_distributed(cfg)
    if d.strategy == "fsdp" and accelerator.distributed_type != "FSDP":
        said.append("distributed.strategy fsdp without a distributed launch: accelerate trains one plain process "
                    "(launch with accelerate launch --config_file accelerate_configs/fsdp.yaml)")
    return said


def describe(cfg: RunConfig, accelerator: Accelerator, mesh: xla_spmd.Mesh) -> Dict[str, object]:
    """What the run actually got, for the plan and summary.json."""
    return {
        "backend": backend_name(accelerator),
        "device": str(accelerator.device),
        "num_processes": accelerator.num_processes,
        "strategy": strategy_name(accelerator, mesh),
        "precision": accelerator.mixed_precision,
        "cpu_threads": _threads_said(cfg, accelerator),
    }


def _threads_said(cfg: RunConfig, accelerator: Accelerator) -> Optional[str]:
    """The CPU thread count and where it came from, e.g. "2 (auto: 2 cores / 1 process; ...)"."""
    if accelerator.device.type != "cpu":
        return None
    return f"{torch.get_num_threads()} ({cpu_threads(cfg)[1]})"


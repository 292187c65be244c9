"""Which backend and strategy the recipe and the launch ask for, and the combinations refused before anything is
built. The recipe says what it wants (``backend``, ``precision``, ``distributed``); ``accelerate launch`` says what
it started (processes, FSDP/DeepSpeed plugins through the environment). When the two cannot agree the run refuses
with a UserError.

accelerate is imported by no module of this package at import time: ``select_backend`` must run before that."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Optional, Tuple

import torch

from framework.backend.hardware import cpu_flags
from framework.config import DistributedConfig, RunConfig
from framework.errors import UserError


XLA_INSTALL = "install it with `pip install -e '.[xla]'` (or `make install-xla`)"


def select_backend(cfg: RunConfig) -> None:
    """Call before accelerate is imported. With torch_xla installed accelerate always picks XLA, even when
    asked for the CPU; USE_TORCH_XLA=0 is its documented switch to train natively instead. DeepSpeed, imported
    on the CPU (by a run under it, or by a library that imports it wherever it is installed; accelerate's
    unwrapping no longer does outside DeepSpeed: ``build._deepspeed_unwrapped_only_under_it``), warns that it fell
    back to the CPU: where the run trains on the CPU it is told so instead."""
    if cfg.backend in ("cpu", "gpu"):
        os.environ["USE_TORCH_XLA"] = "0"
    if on_cpu(cfg):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def has_xla() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def _launched_with(name: str) -> bool:
    return os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() in ("1", "true", "yes")


def _launched_strategy() -> Optional[str]:
    """fsdp or deepspeed when the launch config set one up (accelerate passes it on in the environment)."""
    return "fsdp" if _launched_with("FSDP") else "deepspeed" if _launched_with("DEEPSPEED") else None


def strategy(cfg: RunConfig) -> str:
    """``distributed.strategy`` with auto resolved to what the launch set up: fsdp or deepspeed under such
    a launch config, else auto (data parallel when several processes, else one process)."""
    if cfg.distributed.strategy == "auto":
        return _launched_strategy() or "auto"
    return cfg.distributed.strategy


def _launched_zero_stage() -> Optional[int]:
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    return int(stage) if stage else None


def resolved_distributed(cfg: RunConfig) -> DistributedConfig:
    """The recipe's ``distributed`` section with the strategy resolved (see ``strategy``) and DeepSpeed's ZeRO
    stage (the recipe's, else the launch config's, else 2): what the checks, the plugins and the memory plan go by."""
    ds = cfg.distributed.deepspeed
    stage = ds.zero_stage if ds.zero_stage is not None else _launched_zero_stage()
    return dataclasses.replace(cfg.distributed, strategy=strategy(cfg),
                               deepspeed=dataclasses.replace(ds, zero_stage=2 if stage is None else stage))


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How the run's processes will share the work, as the recipe and the launch say before anything is built: what
    a task's and the adapters' checks refuse combinations by (``Task.check``)."""

    name: str  # distributed.strategy, auto resolved to what the launch config set up
    fsdp_version: int
    zero_stage: int  # DeepSpeed's ZeRO stage (the recipe's, else the launch config's, else 2)
    tensor_parallel: int  # processes sharing each model by tensor parallelism (1: none)
    xla: bool  # the backend is XLA: batches in static shapes

    @property
    def shards_parameters(self) -> bool:
        """FSDP or DeepSpeed places and shards the model itself: its weights are not whole on every process."""
        return self.name in ("fsdp", "deepspeed")

    @property
    def fsdp2(self) -> bool:
        return self.name == "fsdp" and self.fsdp_version == 2

    @property
    def zero3(self) -> bool:
        return self.name == "deepspeed" and self.zero_stage == 3


def planned_strategy(cfg: RunConfig) -> Strategy:
    """The run's ``Strategy`` from the recipe and the launch (the environment ``accelerate launch`` sets)."""
    resolved = resolved_distributed(cfg)
    return Strategy(resolved.strategy, resolved.fsdp.version, resolved.deepspeed.zero_stage,
                    resolved.tensor_parallel or 1, cfg.backend == "xla" or _auto_xla(cfg))


def _strategy_key(cfg: RunConfig) -> str:
    """How messages name the strategy: the recipe's value, and where auto took it from."""
    chosen = strategy(cfg)
    return chosen if chosen == cfg.distributed.strategy else f"{chosen} (auto, from the launch config)"


def _auto_xla(cfg: RunConfig) -> bool:
    """Whether backend auto gets XLA: torch_xla is installed, not switched off (USE_TORCH_XLA=0), and there
    is no CUDA device."""
    xla = has_xla() and os.environ.get("USE_TORCH_XLA", "1").lower() not in ("0", "false", "no")
    return cfg.backend == "auto" and xla and not torch.cuda.is_available()


def auto_precision(cfg: RunConfig) -> Tuple[str, str]:
    """What ``precision: auto`` is on this machine, and why: bf16 where the device computes it natively and it pays
    (a GPU with bf16, a TPU, a CPU with AMX tiles: there bf16 matrix products ran 5x fp32 and the default recipe
    1.38x faster, docs/benchmarks.md), else no."""
    if cfg.backend == "xla" or _auto_xla(cfg):
        device = os.environ.get("PJRT_DEVICE", "")
        return ("bf16", "a TPU computes bf16 natively") if device.upper() == "TPU" else \
            ("no", f"XLA on {device or 'an unnamed device'}, not a TPU")
    if not on_cpu(cfg):
        return ("bf16", "the GPU computes bf16") if torch.cuda.is_bf16_supported() else \
            ("no", "the GPU has no bf16")
    if "amx_bf16" in cpu_flags():
        return "bf16", "the CPU has AMX: bf16 matrix products measured 5x fp32"
    return "no", "the CPU has no AMX: bf16 is not faster than fp32 there"


def auto_means_cpu(cfg: RunConfig) -> bool:
    """backend auto on a machine where accelerate finds neither torch_xla nor CUDA. The Accelerator must then
    be asked for the CPU explicitly: under a multi-process launcher (torchrun sets LOCAL_RANK) it would
    otherwise set up an independent single-process run in every launched process."""
    return cfg.backend == "auto" and not _auto_xla(cfg) and not torch.cuda.is_available()


def on_cpu(cfg: RunConfig) -> bool:
    """Whether the run trains on the CPU: asked for, or no CUDA device (XLA aside)."""
    return cfg.backend == "cpu" or not torch.cuda.is_available()


def check(cfg: RunConfig) -> None:
    """Refuse, before anything is built, the combinations that cannot work here."""
    backend, precision, strategy_ = cfg.backend, cfg.precision, strategy(cfg)
    cuda = torch.cuda.is_available()
    xla = backend == "xla" or _auto_xla(cfg)
    if backend == "xla" and not has_xla():
        raise UserError(f"backend: xla needs torch_xla, which is not installed; {XLA_INSTALL}")
    if backend == "gpu" and not cuda:
        raise UserError("backend: gpu, but torch sees no CUDA device; use backend=cpu or backend=auto")
    if precision == "fp16" and xla:
        raise UserError("precision: fp16 is not supported on XLA; use precision=bf16")
    if precision == "fp16" and (backend == "cpu" or not (cuda or xla)):
        raise UserError("precision: fp16 needs a GPU; use precision=bf16 (autocast) on the CPU, or precision=no")
    if precision == "fp8":
        if not cuda:
            raise UserError("precision: fp8 needs an fp8-capable GPU (Hopper or newer); use bf16 or no")
        if not any(importlib.util.find_spec(m) for m in ("transformer_engine", "torchao", "msamp")):
            raise UserError("precision: fp8 needs transformer_engine, torchao or msamp installed; "
                            "install one (e.g. `pip install torchao`) or use precision=bf16")
    if strategy_ in ("xla_spmd", "xla_fsdp") and not (xla and has_xla()):
        raise UserError(f"distributed.strategy: {strategy_} needs backend=xla and torch_xla; {XLA_INSTALL}")
    cpu = on_cpu(cfg)
    ds, launched_stage = cfg.distributed.deepspeed, _launched_zero_stage()
    if strategy_ == "deepspeed" and None not in (ds.zero_stage, launched_stage) and ds.zero_stage != launched_stage:
        raise UserError(f"distributed.deepspeed.zero_stage: {ds.zero_stage}, but the launch config sets ZeRO stage "
                        f"{launched_stage}; set distributed.deepspeed.zero_stage={launched_stage} or null (the launch "
                        "config's), or launch with a config of that stage")
    if strategy_ == "deepspeed" and cpu and (ds.offload_optimizer != "none" or ds.offload_params != "none"):
        key = "offload_optimizer" if ds.offload_optimizer != "none" else "offload_params"
        raise UserError(f"distributed.deepspeed.{key}: offloading to the host needs a GPU to offload from (on CPU "
                        "processes everything is in host memory already); set it to none")
    if strategy_ == "fsdp" and cpu and cfg.distributed.fsdp.version == 1:
        raise UserError("distributed.fsdp.version: 1 (FlatParameter FSDP) needs CUDA GPUs (accelerate sets it up "
                        "on CPU processes only as plain data parallel); use distributed.fsdp.version=2, which "
                        "runs on CPU processes")
    if strategy_ == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise UserError(f"distributed.strategy: {_strategy_key(cfg)} needs the deepspeed package; "
                        "`pip install deepspeed`")
    if strategy_ == "fsdp" and cfg.distributed.fsdp.version == 2 and \
            cfg.distributed.fsdp.sharding_strategy in ("NO_SHARD", "HYBRID_SHARD"):
        raise UserError(f"distributed.fsdp.sharding_strategy: {cfg.distributed.fsdp.sharding_strategy} needs "
                        "distributed.fsdp.version=1 (FSDP2 offers FULL_SHARD and SHARD_GRAD_OP; its hybrid "
                        "sharding is distributed.fsdp.replicas)")
    if cfg.distributed.fsdp.replicas > 1 and (strategy_ != "fsdp" or cfg.distributed.fsdp.version != 2):
        raise UserError("distributed.fsdp.replicas: HSDP is FSDP2's; set distributed.strategy=fsdp with "
                        "distributed.fsdp.version=2, or remove the key")
    if cfg.distributed.local_sgd_steps and (xla or strategy_ in ("fsdp", "deepspeed", "xla_spmd", "xla_fsdp")):
        where = "XLA" if xla else strategy_
        raise UserError(f"distributed.local_sgd_steps: accelerate's LocalSGD does not support {where} "
                        "(only plain data parallel on CPUs and GPUs); remove the key or use strategy=ddp")
    tensor_parallel_problem = _tensor_parallel_problem(cfg, strategy_, xla)
    if tensor_parallel_problem:
        raise UserError(tensor_parallel_problem)
    if cfg.train.on_nonfinite == "skip" and (xla or precision == "fp16" or strategy_ == "deepspeed"):
        why = ("on XLA it would read the device in every step (a graph cut)" if xla else "fp16's grad scaler already "
               "skips steps whose gradients overflow" if precision == "fp16" else "DeepSpeed's engine steps inside "
               "the backward, before the framework sees the gradient norm")
        raise UserError(f"train.on_nonfinite: skip is not available here: {why}; use train.on_nonfinite=stop")
    if cfg.train.compile and xla:
        raise UserError("train.compile: XLA already compiles the model's graphs; remove train.compile on XLA")
    launched = _launched_strategy()
    if launched and strategy_ != launched:
        raise UserError(f"distributed.strategy: the recipe asks for {strategy_} but the launch config sets up "
                        f"{launched}; use a matching --config_file or set distributed.strategy={launched}")


def _tensor_parallel_problem(cfg: RunConfig, strategy_: str, xla: bool) -> Optional[str]:
    """What ``distributed.tensor_parallel`` cannot be combined with (accelerate 1.15, transformers 5.24)."""
    if not cfg.distributed.tensor_parallel:
        return None
    key = "distributed.tensor_parallel"
    if xla:
        return f"{key}: tensor parallelism runs on CPU processes (gloo) and GPUs, not on XLA; remove the key"
    if strategy_ not in ("auto", "ddp"):
        # Tried on 4 processes of the tiny Llama: every process failed in accelerate's prepare, as the message says.
        return (f"{key}: tensor parallelism with strategy {_strategy_key(cfg)} is not available: 2D TP x FSDP2 "
                "needs accelerate's FSDP2 x TP preparation, which (accelerate 1.15 and 1.16) imports a class "
                "transformers 5 removed (ReplicateParallel); use distributed.strategy=auto or ddp (TP alone)")
    if cfg.peft is not None:
        return (f"{key}: peft's LoRA layers wrap the linear layers the tensor-parallel plan shards (their A and B "
                "matrices would stay whole, outside the plan); remove the peft section or the key")
    if cfg.distributed.local_sgd_steps:
        return f"{key}: local SGD averages whole models over processes; remove distributed.local_sgd_steps"
    return None


def model_checkpointing(cfg: RunConfig) -> bool:
    """Whether the model's own gradient checkpointing is wanted (FSDP does it through its plugin instead)."""
    return cfg.train.gradient_checkpointing and strategy(cfg) != "fsdp"


"""The one place that knows backends: recipe + launch -> Accelerator, and what the run really got.

The recipe says what it wants (``backend``, ``precision``, ``distributed``); ``accelerate launch`` says
what it started (processes, FSDP/DeepSpeed plugins through the environment). When the two cannot
agree the run refuses with a UserError; where it falls back by design the plan says so.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from framework import xla_spmd
from framework.config import DistributedConfig, RunConfig
from framework.errors import UserError

if TYPE_CHECKING:
    from accelerate import Accelerator

# accelerate is imported inside the functions that need it: select_backend() must run before that import.

XLA_INSTALL = "install it with `pip install -e '.[xla]'` (or `make install-xla`)"


def select_backend(cfg: RunConfig) -> None:
    """Call before accelerate is imported. With torch_xla installed accelerate always picks XLA, even when
    asked for the CPU; USE_TORCH_XLA=0 is its documented switch to train natively instead."""
    if cfg.backend in ("cpu", "gpu"):
        os.environ["USE_TORCH_XLA"] = "0"


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


def resolved_distributed(cfg: RunConfig) -> DistributedConfig:
    """The recipe's ``distributed`` section with the strategy resolved (see ``strategy``): what the checks,
    the plugins and the memory plan go by."""
    return dataclasses.replace(cfg.distributed, strategy=strategy(cfg))


def _strategy_key(cfg: RunConfig) -> str:
    """How messages name the strategy: the recipe's value, and where auto took it from."""
    chosen = strategy(cfg)
    return chosen if chosen == cfg.distributed.strategy else f"{chosen} (auto, from the launch config)"


def _auto_xla(cfg: RunConfig) -> bool:
    """Whether backend auto gets XLA: torch_xla is installed, not switched off (USE_TORCH_XLA=0), and there
    is no CUDA device."""
    xla = has_xla() and os.environ.get("USE_TORCH_XLA", "1").lower() not in ("0", "false", "no")
    return cfg.backend == "auto" and xla and not torch.cuda.is_available()


def _auto_means_cpu(cfg: RunConfig) -> bool:
    """backend auto on a machine where accelerate finds neither torch_xla nor CUDA. The Accelerator must then
    be asked for the CPU explicitly: under a multi-process launcher (torchrun sets LOCAL_RANK) it would
    otherwise set up an independent single-process run in every launched process."""
    return cfg.backend == "auto" and not _auto_xla(cfg) and not torch.cuda.is_available()


def _on_cpu(cfg: RunConfig) -> bool:
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
    on_cpu = _on_cpu(cfg)
    if strategy_ == "deepspeed" and on_cpu:
        fix = ("use strategy=fsdp (FSDP2 runs on CPU processes) or strategy=ddp here"
               if strategy_ == cfg.distributed.strategy else
               "launch with accelerate_configs/fsdp.yaml or accelerate_configs/cpu_ddp.yaml here")
        raise UserError(f"distributed.strategy: {_strategy_key(cfg)} needs CUDA GPUs (accelerate would silently "
                        f"train plain data-parallel on the CPU); {fix}")
    if strategy_ == "fsdp" and on_cpu and cfg.distributed.fsdp.version == 1:
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
        return (f"{key}: tensor parallelism shards every process's model on its own mesh; with strategy "
                f"{_strategy_key(cfg)} (2D TP x FSDP) it is not supported here; use distributed.strategy=auto")
    if cfg.peft is not None:
        return (f"{key}: peft's LoRA layers wrap the linear layers the tensor-parallel plan shards (their A and B "
                "matrices would stay whole, outside the plan); remove the peft section or the key")
    if cfg.distributed.local_sgd_steps:
        return f"{key}: local SGD averages whole models over processes; remove distributed.local_sgd_steps"
    c = cfg.checkpoint
    if c.every_steps or c.every_epoch or c.every_minutes or c.resume not in ("auto", "never"):
        return (f"{key}: accelerate's save_state cannot checkpoint a tensor-parallel model (safetensors fails on "
                "its DTensor weights, and torch.save would write only the main process's shards); remove "
                "checkpoint.every_steps, every_epoch, every_minutes and resume")
    return None


def model_checkpointing(cfg: RunConfig) -> bool:
    """Whether the model's own gradient checkpointing is wanted (FSDP does it through its plugin instead)."""
    return cfg.train.gradient_checkpointing and strategy(cfg) != "fsdp"


def _plugins(cfg: RunConfig) -> dict:
    """The Accelerator's plugin arguments: the compiler, and FSDP or DeepSpeed with the recipe's settings
    (also under strategy auto, when the launch config set FSDP or DeepSpeed up)."""
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin, TorchDynamoPlugin

    plugins = {}
    if cfg.train.compile:
        plugins["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor")
    d = resolved_distributed(cfg)
    if d.strategy == "fsdp":
        f = d.fsdp
        wrap = {"transformer": "transformer_based_wrap", "size": "size_based_wrap", "none": "no_wrap"}
        # train.gradient_checkpointing under FSDP means FSDP's own activation checkpointing of each block.
        checkpointing = f.activation_checkpointing or cfg.train.gradient_checkpointing
        offload = f.offload_params
        if offload and f.version == 2:
            from torch.distributed.fsdp import CPUOffloadPolicy

            # Pinned (page-locked) host memory exists for transfers to an accelerator: CPU processes have none
            # (pin_memory raised "Cannot access accelerator device"), and their shards are in host memory anyway.
            offload = CPUOffloadPolicy(pin_memory=not _on_cpu(cfg))
        options = dict(fsdp_version=f.version, auto_wrap_policy=wrap[f.auto_wrap_policy],
                       activation_checkpointing=checkpointing, cpu_offload=offload,
                       cpu_ram_efficient_loading=f.cpu_ram_efficient_loading, min_num_params=f.min_num_params,
                       state_dict_type=f"{f.state_dict.upper()}_STATE_DICT")
        if f.version == 2:
            options["reshard_after_forward"] = f.sharding_strategy == "FULL_SHARD"
        else:
            options["sharding_strategy"] = f.sharding_strategy
        plugins["fsdp_plugin"] = FullyShardedDataParallelPlugin(**options)
    elif d.strategy == "deepspeed":
        z = d.deepspeed
        plugins["deepspeed_plugin"] = DeepSpeedPlugin(
            zero_stage=z.zero_stage, offload_optimizer_device=z.offload_optimizer, offload_param_device=z.offload_params,
            gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
            gradient_clipping=cfg.train.max_grad_norm or 0.0, zero3_save_16bit_model=True)
    return plugins


def fsdp2_on_cpu_processes(accelerator: Accelerator, plugin) -> bool:
    """accelerate's own FSDP2 path on CPU processes (gloo): the one switch this project sets in accelerate's
    state. Returns whether it was needed.

    ``Accelerator(fsdp_plugin=...)`` makes the run ``DistributedType.FSDP`` only for the device kinds
    ``AcceleratorState.__init__`` lists (MULTI_GPU, MULTI_XPU, MULTI_NPU, ...; accelerate 1.15); CPU processes
    keep ``MULTI_CPU`` and the plugin is dropped: the run would train plain data parallel. Nothing else in that
    path is device-bound: ``fsdp2_prepare_model`` calls torch's ``fully_shard`` over a device mesh of the run's
    device type, the state dicts are DTensor's and torch.distributed.checkpoint's, and gloo has every collective
    FSDP2 uses (all-gather, reduce-scatter, broadcast). So this does for MULTI_CPU exactly what
    ``AcceleratorState`` does for the listed kinds: set the mixed-precision policy on the plugin, keep the
    plugin, and say FSDP in both shared states. It changes nothing when accelerate already set FSDP up (on
    GPUs, or a later accelerate that lists the CPU), and it runs before ``prepare`` reads any of it; the
    Accelerator's remaining construction read the distributed type only for fp8 and fp16, which the CPU
    refuses anyway. tests/test_fsdp.py checks each of these assumptions against the installed accelerate."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.MULTI_CPU or plugin is None or plugin.fsdp_version != 2:
        return False
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


def _hybrid_shard(accelerator: Accelerator, replicas: int) -> None:
    """HSDP: accelerate's ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=processes / replicas), set
    up as ``Accelerator(parallelism_config=...)`` does (its device mesh, then its own validation), but after the
    FSDP2 switch: given to the constructor, its validation would see CPU processes as MULTI_CPU and refuse them.
    ``prepare`` then shards each replica over the mesh's dp_shard dimension (``fsdp2_prepare_model``)."""
    from accelerate.parallelism_config import ParallelismConfig

    processes = accelerator.num_processes
    if processes % replicas:
        raise UserError(f"distributed.fsdp.replicas: {replicas} does not divide the {processes} processes; "
                        f"launch a multiple of {replicas} processes or change the key")
    config = ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=processes // replicas)
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh(accelerator.device.type)
    config._validate_accelerator(accelerator)


def _tensor_parallel(accelerator: Accelerator, size: int) -> None:
    """accelerate's ParallelismConfig(tp_size=size), set up after construction as ``_hybrid_shard`` does: given to
    the Accelerator, its validation (``_validate_accelerator``) refuses CPU processes by their distributed type
    (MULTI_CPU is not among its "multi device" kinds), although nothing of TP is device-bound: DTensor's
    collectives run over gloo. With the mesh set, ``prepare`` takes accelerate's TP path (``_prepare_tp``; the
    model is not wrapped in DDP) and its data loaders give every process of the tp dimension the same batches.
    The model itself is sharded by ``tensor_parallel_model``."""
    from accelerate.parallelism_config import ParallelismConfig

    processes = accelerator.num_processes
    if size != processes:
        raise UserError(f"distributed.tensor_parallel: {size}, but the launch started {processes} process(es); tensor "
                        f"parallelism spans every process here: launch {size} processes or set the key to "
                        f"{processes}")
    config = ParallelismConfig(tp_size=size)
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh(accelerator.device.type)


def tensor_parallel_size(accelerator: Accelerator) -> int:
    """How many processes share each model by tensor parallelism (1 without it)."""
    config = getattr(accelerator, "parallelism_config", None)
    return config.tp_size if config is not None and config.tp_enabled else 1


def data_parallel(accelerator: Accelerator) -> Tuple[int, int]:
    """(this process's data-parallel rank, the number of data-parallel replicas): the processes of a tensor-
    parallel group read the same data."""
    tp = tensor_parallel_size(accelerator)
    return accelerator.process_index // tp, accelerator.num_processes // tp


def tensor_parallel_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The model sharded by transformers' own tensor-parallel path: ``prepare_distribute_model`` (its device mesh
    over the process group accelerate started) and ``maybe_distribute_model``, what ``from_pretrained(...,
    tp_plan="auto")`` does after building the model; here after any loading, so a model built from a config
    shards too. Each parameter is cut from the process's whole copy (``distribute_tensor(src_data_rank=None)``),
    which is the same on every process (same seed, same checkpoint). Unchanged without tensor parallelism."""
    size = tensor_parallel_size(accelerator)
    if size == 1:
        return model
    from transformers.distributed import DistributedConfig

    if not getattr(model, "tp_plan", None):
        raise UserError(f"distributed.tensor_parallel: {type(model).__name__} has no tensor-parallel plan in "
                        "transformers (Llama-style models have one: base_model_tp_plan); remove the key")
    if getattr(model.config, "tie_word_embeddings", False):
        raise UserError("distributed.tensor_parallel: the model ties its output layer to its embedding, which the "
                        "plan shards as two parameters (the tie would break); set tie_word_embeddings: false in "
                        "model.config, or remove the key")
    try:
        config, _, mesh = type(model).prepare_distribute_model(DistributedConfig(tp_size=size))
        return type(model).maybe_distribute_model(model, config, mesh)
    except ValueError as e:  # a size the plan cannot split (heads, key/value heads)
        raise UserError(f"distributed.tensor_parallel: {str(e).splitlines()[0]}") from None


def parameter_shards(accelerator: Accelerator) -> int:
    """Over how many processes the sharded states are split: all of them, or under HSDP a replica's."""
    config = getattr(accelerator, "parallelism_config", None)
    return config.dp_shard_size if config is not None and getattr(accelerator, "is_fsdp2", False) else \
        accelerator.num_processes


def _process_group_kwargs(cfg: RunConfig) -> list:
    """The process group's timeout, when the recipe sets one (``distributed.timeout_minutes``)."""
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    minutes = cfg.distributed.timeout_minutes
    return [InitProcessGroupKwargs(timeout=timedelta(minutes=minutes))] if minutes else []


def build_accelerator(cfg: RunConfig) -> Tuple[Accelerator, xla_spmd.Mesh]:
    """The Accelerator for the recipe and launch, and the SPMD mesh one process drives (``Mesh()`` without SPMD)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

    check(cfg)
    mesh = xla_spmd.start(cfg)  # before the XLA runtime starts
    plugins = _plugins(cfg)
    try:
        accelerator = Accelerator(
            cpu=cfg.backend == "cpu" or _auto_means_cpu(cfg),
            mixed_precision=cfg.precision,
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=cfg.train.gradient_accumulation_steps,
                # The loop consumes whole accumulation windows per epoch, so no partial window at the end.
                sync_with_dataloader=False,
            ),
            # A seeded sampler whose order depends only on (seed, epoch): the same on every process and
            # reproducible on resume.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            # The loop steps the scheduler once per optimizer step, whatever the number of processes.
            step_scheduler_with_optimizer=False,
            log_with=cfg.report_to or None,
            project_dir=cfg.output_dir,
            kwargs_handlers=_process_group_kwargs(cfg),
            **plugins,
        )
    except (ValueError, ImportError, RuntimeError) as e:  # a precision the device lacks, a tracker not installed
        raise UserError(f"the launch settings and the recipe disagree: {str(e).splitlines()[0]}") from None
    fsdp2_on_cpu_processes(accelerator, plugins.get("fsdp_plugin"))
    if getattr(accelerator, "is_fsdp2", False) and cfg.distributed.fsdp.replicas > 1:
        _hybrid_shard(accelerator, cfg.distributed.fsdp.replicas)
    if cfg.distributed.tensor_parallel:
        _tensor_parallel(accelerator, cfg.distributed.tensor_parallel)
    _check_launch(cfg, accelerator)
    if _on_xla(accelerator):
        _masks_without_host_reads()
        _xla_loaders_with_dataset()
    elif accelerator.device.type == "cpu":
        torch.set_num_threads(cpu_threads(cfg)[0])
        _reuse_large_buffers()
    return accelerator, mesh


# glibc's mallopt parameters, and the mmap threshold while large buffers are reused (None: they are not).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_GLIBC_DEFAULT_MMAP_MAX = 32 << 20
_HEAP_UP_TO = 1 << 30  # the mmap threshold while large buffers are reused
_libc = None


def _reuse_large_buffers() -> bool:
    """Keep a step's large CPU buffers for the next step instead of returning them to the kernel.

    glibc serves allocations above its mmap threshold (at most 32 MiB by default) with fresh pages and unmaps
    them on free, so every step's large activations (a language model's logits: hundreds of MiB) are
    page-faulted and zeroed by the kernel anew. Serving them from the heap, and keeping up to 2 GiB of freed
    heap, reuses them: measured here, the causal_lm recipe's step took 1.66 s instead of 2.57 s (kernel time
    0.15 s instead of 1.49 s). Evaluation turns this off (``large_buffers_unmapped``). Returns whether the C
    library took the settings (glibc on Linux)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        if libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_UP_TO) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31):
            _libc = libc
            return True
    except (OSError, AttributeError):  # not glibc (musl, ...)
        pass
    return False


@contextmanager
def large_buffers_unmapped():
    """Large buffers from fresh pages again, for a loop that keeps small results between its large buffers
    (evaluation gathers each batch's outputs): the heap would serve those from the freed large chunks, so
    the next batch's logits no longer fit there and the heap grows by a batch's logits every batch (an
    evaluation of 2826 blocks of the causal_lm recipe reached 24 GiB and was killed; 3.6 GiB with this)."""
    if _libc is None:
        yield
        return
    _libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_MMAP_MAX)
    try:
        yield
    finally:
        _libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_UP_TO)


def cpu_threads(cfg: RunConfig) -> Tuple[int, str]:
    """Threads for CPU compute in this process, and where the number comes from (for the plan).

    ``train.cpu_threads: N`` sets N. auto respects an OMP_NUM_THREADS above 1 (a deliberate
    ``--num_cpu_threads_per_process``) and otherwise divides the cores this process may run on by the
    processes on this machine: plain ``accelerate launch`` sets OMP_NUM_THREADS=1, which would leave all
    but one core idle."""
    if cfg.train.cpu_threads != "auto":
        return cfg.train.cpu_threads, "train.cpu_threads"
    pin = "set train.cpu_threads to pin it"
    omp = os.environ.get("OMP_NUM_THREADS", "")
    omp_threads = int(omp) if omp.isdigit() else 0
    if omp_threads > 1:
        return omp_threads, f"auto: OMP_NUM_THREADS={omp_threads} respected; {pin}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    overridden = "; OMP_NUM_THREADS=1 overridden" if omp_threads == 1 else ""
    processes = "1 process" if local == 1 else f"{local} processes"
    return max(1, cores // local), f"auto: {cores} cores / {processes}{overridden}; {pin}"


def _check_launch(cfg: RunConfig, accelerator: Accelerator) -> None:
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
    if _on_xla(accelerator):
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
    if tensor_parallel_size(accelerator) > 1:
        return f"tensor parallel ({tensor_parallel_size(accelerator)} processes)"
    if mesh.describe():
        return mesh.describe()
    if accelerator.num_processes > 1:
        return "xla data parallel" if kind == "XLA" else "ddp"
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
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    d = resolved_distributed(cfg)
    if d.strategy == "fsdp" and accelerator.distributed_type != "FSDP":
        said.append("distributed.strategy fsdp without a distributed launch: accelerate trains one plain process "
                    "(launch with accelerate launch --config_file accelerate_configs/fsdp.yaml)")
    if d.strategy == "deepspeed" and stage and int(stage) != d.deepspeed.zero_stage:
        said.append(f"ZeRO stage {d.deepspeed.zero_stage} comes from the recipe (distributed.deepspeed.zero_stage); "
                    f"the launch config's stage {stage} is not used")
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


def _masks_without_host_reads() -> None:
    """transformers reads the attention mask on the host (``padding_mask.all()``) to skip building it when
    nothing is padded. On XLA that read is a host sync in the middle of every forward, cutting the step's
    graph in two; register mask builders that always build the mask instead (same results)."""
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    def without_skips(build):
        def build_always(*args, **kwargs):
            kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
            return build(*args, **kwargs)

        return build_always

    AttentionMaskInterface.register("sdpa", without_skips(sdpa_mask))
    AttentionMaskInterface.register("eager", without_skips(eager_mask))


def _xla_loaders_with_dataset() -> None:
    """accelerate's ``save_state``/``load_state`` read ``dataloader.dataset``, which its XLA loader wrapper
    (``MpDeviceLoaderWrapper``, accelerate 1.15) lacks: every checkpoint on XLA raised AttributeError. The
    wrapper gets the wrapped loader's dataset."""
    from accelerate.data_loader import MpDeviceLoaderWrapper

    if not hasattr(MpDeviceLoaderWrapper, "dataset"):
        MpDeviceLoaderWrapper.dataset = property(lambda self: self._loader.dataset)


def clip_gradients(accelerator: Accelerator, model: torch.nn.Module, max_norm: float) -> None:
    """Scale the gradients down to a global 2-norm of at most ``max_norm``: accelerate's ``clip_grad_norm_``.
    Where they are plain tensors in host memory (the CPU: one process, or DDP over gloo) the multiplication is
    skipped when its factor is 1: torch multiplies by ``min(1, max_norm / (norm + 1e-6))`` unconditionally, so
    that an accelerator never waits for the host to read the norm, a read that costs nothing on the CPU, and
    multiplying by 1 changes no bit. One pass over every gradient fewer at the steps that do not clip; the
    factor is computed as torch computes it, so the result is bitwise the same (a non-finite norm still
    multiplies)."""
    from accelerate.utils import DistributedType

    if (accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU)
            or accelerator.device.type != "cpu" or tensor_parallel_size(accelerator) > 1):
        accelerator.clip_grad_norm_(model.parameters(), max_norm)
        return
    accelerator.unscale_gradients()
    parameters = list(model.parameters())
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    if not bool(max_norm / (norm + 1e-6) >= 1.0):
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)


def save_state(accelerator: Accelerator, folder: str) -> None:
    """``accelerator.save_state``, on XLA in torch's format: accelerate loads a safetensors checkpoint through
    safetensors' ``load_model``, which reads storage pointers that XLA tensors do not have (resume failed)."""
    accelerator.save_state(folder, safe_serialization=not _on_xla(accelerator))


def place_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """Move the model to its device before the optimizer is built over its parameters: fused optimizers
    check the device, and on XLA the parameters must already be device tensors. FSDP and DeepSpeed place
    (and shard) the model themselves in prepare()."""
    if accelerator.distributed_type in ("FSDP", "DEEPSPEED"):
        return model
    model = model.to(accelerator.device)
    # On XLA, moving a module makes new parameter objects, which unties shared weights (GPT-2's embedding and
    # output layer trained as two matrices, measured); transformers models tie them again.
    if _on_xla(accelerator) and hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def unwrap(accelerator: Accelerator, model: torch.nn.Module, mesh: xla_spmd.Mesh) -> torch.nn.Module:
    """The model without accelerate's wrappers (DDP, ...) nor the XLA FSDP wrapper."""
    return mesh.unwrap(accelerator.unwrap_model(model))


def for_generation(accelerator: Accelerator, model: torch.nn.Module, mesh: xla_spmd.Mesh) -> torch.nn.Module:
    """The model to generate a short sample with, once training is over. On XLA the model moves to the host
    CPU: generating token by token makes a new shape, so a new compiled graph, per token (minutes even for a
    tiny model); a sharded model is copied there whole. Call it last: on XLA the model is on the CPU afterwards."""
    if mesh.shard_parameters:
        return mesh.host_model(accelerator.unwrap_model(model))
    model = unwrap(accelerator, model, mesh)
    if getattr(accelerator, "is_fsdp2", False):
        # The weights FSDP2's root holds outside the wrapped blocks (embeddings, final norm) are gathered by the
        # root's own forward, which a peft model's generate() bypasses (it calls the inner model's): gathered
        # here instead, once; each block still gathers its own.
        model.unshard()
    return model.to("cpu") if _on_xla(accelerator) else model


def needs_static_shapes(accelerator: Accelerator) -> bool:
    """XLA compiles one graph per input shape: batches there must come in a few fixed shapes."""
    return _on_xla(accelerator)


def _on_xla(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == "XLA"


def _run_pending_graph(accelerator: Accelerator) -> None:
    """On XLA, execute the lazily traced ops now, so what is read next is already computed."""
    if _on_xla(accelerator):
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
    _run_pending_graph(accelerator)
    if accelerator.num_processes > 1:
        tensor = accelerator.reduce(tensor, reduction=reduction)
    return tensor.item()


def to_host(accelerator: Accelerator, tensors: List[torch.Tensor]) -> list:
    """Device tensors as NumPy arrays after a single sync (on XLA, joining them on the device would
    compile yet another graph; a tensor sharded under SPMD is assembled from its shards, since its ``.cpu()``
    compiles a graph every time)."""
    _run_pending_graph(accelerator)
    if _on_xla(accelerator):
        return [xla_spmd.on_host(t).numpy() for t in tensors]
    return [t.cpu().numpy() for t in tensors]


def preemption_check_interval(accelerator: Accelerator, log_every: int) -> int:
    """Optimizer steps between checks for a stop signal. One process just reads a flag every step; several
    must agree on the step (an all-reduce and a host read), so they check only when they log anyway."""
    return 1 if accelerator.num_processes == 1 else log_every


def xla_stats(accelerator: Accelerator) -> Optional[Dict[str, float]]:
    """Compilation and execution counters from torch_xla.debug.metrics; None off XLA."""
    if not _on_xla(accelerator):
        return None
    compiles, compile_seconds = _xla_metric("CompileTime")
    executions, execute_seconds = _xla_metric("ExecuteTime")
    return {"compiles": compiles, "compile_seconds": compile_seconds, "executions": executions,
            "execute_seconds": execute_seconds, "transfers_to_host": _xla_metric("TransferFromDeviceTime")[0]}


def _xla_metric(name: str) -> tuple:
    """(count, total seconds) of a torch_xla timing metric; reading it touches no device."""
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return (data[0], data[1] / 1e9) if data else (0, 0.0)


class CompileWatch:
    """Warns once when XLA keeps compiling after the first steps: each compile stalls the run for seconds.
    Also counts the transfers to the host made inside training steps, outside the loop's deliberate host
    work (logging, evaluating, saving: ``host_work``); each is a stall that cuts the step's graph, and
    the count should stay 0."""

    def __init__(self, accelerator: Accelerator, expected: int):
        self.accelerator, self.expected = accelerator, expected
        self.last: Optional[int] = None
        self.warning: Optional[str] = None
        self.transfers_in_steps = 0
        self._mark: Optional[int] = None

    def begin(self) -> None:
        """Training starts: transfers count from here."""
        self._mark = self._transfers()

    def _transfers(self) -> Optional[int]:
        return _xla_metric("TransferFromDeviceTime")[0] if _on_xla(self.accelerator) else None

    @contextmanager
    def host_work(self):
        """Wraps the loop's deliberate host reads; transfers between two such blocks happened in the steps."""
        count = self._transfers()
        if count is not None and self._mark is not None:
            self.transfers_in_steps += count - self._mark
        try:
            yield
        finally:
            self._mark = self._transfers()

    def check(self, step: int) -> Optional[str]:
        """Call at log points; returns the warning the first time it applies."""
        stats = xla_stats(self.accelerator)
        if stats is None or self.warning:
            return None
        grew = self.last is not None and stats["compiles"] > self.last
        self.last = stats["compiles"]
        if grew and stats["compiles"] > self.expected:
            self.warning = (f"XLA has compiled {stats['compiles']} graphs by step {step} and is still compiling "
                            f"(about {self.expected} expected): likely a new input shape each time (dynamic padding, "
                            "a varying batch size; see data.padding and data.pad_buckets) or a host sync inside "
                            "the step (.item(), printing a tensor, a Python branch on a tensor value)")
            return self.warning
        return None


def state_dict_for_save(accelerator: Accelerator, model: torch.nn.Module,
                        mesh: xla_spmd.Mesh) -> Dict[str, torch.Tensor]:
    """The full state dict, on the CPU. Every process must call it (FSDP and DeepSpeed gather collectively);
    XLA tensors must come to the host before safetensors can write them (sharded ones assembled from their
    shards)."""
    if mesh.shard_parameters:
        return mesh.state_dict(accelerator.unwrap_model(model))
    state_dict = accelerator.get_state_dict(model)
    if _on_xla(accelerator):
        state_dict = {name: tensor.cpu() for name, tensor in state_dict.items()}
    if getattr(accelerator, "is_fsdp2", False):
        state_dict = _without_tied_copies(accelerator.unwrap_model(model), state_dict)
    if tensor_parallel_size(accelerator) > 1:  # DTensor shards, gathered whole on every process
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
    if tensor_parallel_size(accelerator) > 1:
        return outputs
    return accelerator.gather_for_metrics(outputs)


def _without_tied_copies(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The state dict without the second name of a tied weight (GPT-2's lm_head.weight, the embedding's). FSDP2
    gathers each name into its own tensor, so save_pretrained, which finds ties by shared storage, wrote both
    (a model/ that differed from DDP's by a redundant copy of the embedding)."""
    first: Dict[int, str] = {}
    copies = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            copies.add(name)
    return {name: tensor for name, tensor in state_dict.items() if name not in copies}


def held_bytes(accelerator: Accelerator, mesh: xla_spmd.Mesh) -> Optional[Callable[[Iterable[torch.Tensor]], int]]:
    """Where the states are sharded, a function giving the bytes this process (the first device under xla_fsdp)
    holds of some tensors, read from their shards; None where every process holds them whole."""
    if getattr(accelerator, "is_fsdp2", False) or tensor_parallel_size(accelerator) > 1:
        return _local_shard_bytes
    return mesh.held_bytes


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (FSDP2's, tensor parallelism's); any other tensor whole."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def _local_shard_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this process's shards of these tensors."""
    return sum(t.numel() * t.element_size() for t in map(local_shard, tensors))


def _device_name(accelerator: Accelerator) -> str:
    """The device's model, as its vendor names it: CUDA's device name, or the XLA device kind (``TPU v5 lite``)."""
    if accelerator.device.type == "cuda":
        return torch.cuda.get_device_name(accelerator.device)
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    try:
        return xm.xla_device_kind(accelerator.device)
    except RuntimeError:  # SPMD's one virtual device has no kind: the runtime's devices do
        if xr.device_type() == "TPU":
            import torch_xla.tpu

            return f"TPU {torch_xla.tpu.get_tpu_type()}"  # v4, v5litepod, v5p, v6e
        return xr.device_type()


def peak_flops(accelerator: Accelerator) -> Tuple[Optional[float], str]:
    """One device's peak FLOP/s in the precision its matrix products run in, and where the figure comes from
    (said in the plan). On the CPU it is measured (a short matrix-product probe with this process's threads);
    elsewhere it comes from ``flops.PEAK_TFLOPS`` by the device's name; None for a device the table lacks."""
    from framework import flops

    precision = accelerator.mixed_precision
    if accelerator.device.type == "cpu":
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        value, size = flops.measure_matmul_peak(dtype)
        return value, (f"measured: {str(dtype).replace('torch.', '')} {size}x{size} matrix products, "
                       f"{torch.get_num_threads()} threads")
    name = _device_name(accelerator)
    row = flops.chip(name)
    if precision == "no":  # fp32 products run on tensor cores as TF32 only when torch allows it
        tf32 = accelerator.device.type == "cuda" and torch.backends.cuda.matmul.fp32_precision == "tf32"
        precision = "tf32" if tf32 else "fp32"
    value = flops.table_peak(row, precision) if row else None
    if value is None:
        return None, f"no peak FLOP/s known for {name} in {precision} (framework/flops.py PEAK_TFLOPS): no MFU"
    return value, f"{row} {precision}, datasheet (dense)"


class Trace:
    """A profiler trace of this process, recording from its creation until ``stop()``, which writes it into
    ``folder`` and returns the Chrome trace written. torch.profiler (host ops, and CUDA kernels on a GPU) writes
    ``folder/name.json``; on XLA torch_xla's profiler writes the host and device timeline (tracing, compiling,
    the executed HLO ops) into ``folder/plugins/profile/<time>/``: ``<host>.xplane.pb`` for TensorBoard's profile
    plugin and ``<host>.trace.json.gz``, the Chrome trace."""

    def __init__(self, accelerator: Accelerator, folder: Path, name: str):
        self.folder, self.name, self.xla = folder, name, _on_xla(accelerator)
        folder.mkdir(parents=True, exist_ok=True)
        if self.xla:
            import torch_xla.debug.profiler as xp

            xp.start_trace(str(folder))
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if accelerator.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.start()

    def range(self, name: str):
        """A named range on the trace's timeline (an optimizer step). Not on XLA: torch_xla's ranges must not
        hold a graph execution, and the step's graph runs when the next batch arrives."""
        return nullcontext() if self.xla else torch.profiler.record_function(name)

    def stop(self) -> Path:
        if self.xla:
            import torch_xla.debug.profiler as xp

            xp.stop_trace()
            return max(self.folder.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
        self.profiler.stop()
        path = self.folder / f"{self.name}.json"
        self.profiler.export_chrome_trace(str(path))
        return path


def total_memory_bytes(accelerator: Accelerator) -> Optional[int]:
    """The device's memory when it is known (CUDA); None elsewhere."""
    if accelerator.device.type == "cuda":
        return int(torch.cuda.get_device_properties(accelerator.device).total_memory)
    return None


def peak_memory_bytes(accelerator: Accelerator) -> int:
    """Peak memory of this process: the CUDA allocator's peak on GPU, else the process peak RSS."""
    if accelerator.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(accelerator.device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB

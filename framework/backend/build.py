"""The Accelerator for the recipe and the launch: its plugins, and what this project sets in accelerate's state after
construction (FSDP2 on CPU processes, HSDP's and tensor parallelism's meshes, XLA's patches)."""

from __future__ import annotations

import importlib
import inspect
import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional, Tuple

import torch

from framework.backend import xla_spmd
from framework.backend.cpu import cpu_threads, reuse_large_buffers
from framework.backend.launch import check_launch
from framework.backend.selection import auto_means_cpu, check, on_cpu, resolved_distributed
from framework.backend.topology import is_fsdp2, is_zero3, on_xla, tensor_parallel_size
from framework.config import RunConfig
from framework.errors import UserError

if TYPE_CHECKING:
    from accelerate import Accelerator


def _plugins(cfg: RunConfig, accumulation: Optional[int] = None) -> dict:
    """The Accelerator's plugin arguments: the compiler, and FSDP or DeepSpeed with the recipe's settings
    (also under strategy auto, when the launch config set FSDP or DeepSpeed up); ``accumulation``: the
    micro-batches of one weight update (default: ``train.gradient_accumulation_steps``)."""
    accumulation = accumulation or cfg.train.gradient_accumulation_steps
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
            offload = CPUOffloadPolicy(pin_memory=not on_cpu(cfg))
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
        plugin = DeepSpeedPlugin(
            zero_stage=z.zero_stage, offload_optimizer_device=z.offload_optimizer, offload_param_device=z.offload_params,
            gradient_accumulation_steps=accumulation,
            gradient_clipping=cfg.train.max_grad_norm or 0.0, zero3_save_16bit_model=True)
        # Set in the config itself: the plugin leaves a falsy clipping out of it, and accelerate's prepare then
        # fills the missing key with 1.0, so train.max_grad_norm: null clipped every step at 1 (0 is DeepSpeed's off).
        plugin.deepspeed_config["gradient_clipping"] = cfg.train.max_grad_norm or 0.0
        plugins["deepspeed_plugin"] = plugin
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


def deepspeed_on_cpu_processes(cfg: RunConfig) -> bool:
    """accelerate's own DeepSpeed path on CPU processes (gloo), set up before the Accelerator. Returns whether it was
    needed (``distributed.strategy: deepspeed`` on the CPU).

    accelerate (1.15) makes a run ``DistributedType.DEEPSPEED`` only where ``PartialState`` starts DeepSpeed's
    process group (``ACCELERATE_USE_DEEPSPEED``, a launched process, not ``cpu``), and ``AcceleratorState`` keeps
    the plugin only ``not cpu``; a CPU launch (``use_cpu``, or ``Accelerator(cpu=True)``) instead trains plain data
    parallel with the plugin dropped. DeepSpeed itself runs on CPU processes: its CPU accelerator (``DS_ACCELERATOR
    =cpu``) and gloo. So this starts the shared state as a DeepSpeed launch does, over gloo, with the CPU flag of the
    launch cleared; the Accelerator built next (``cpu=False``) takes its plugin. One thing DeepSpeed compiles on the
    way: ``deepspeed.comm.torch.TorchBackend`` JIT-builds its shared-memory all-reduce op (``build_shm_op``) at
    start, which needs a compiler and 2 minutes, and serves its inference all-reduce only: it is skipped. The
    optimizer is the framework's own torch optimizer (DeepSpeed's compiled ones are never asked for).
    tests/test_deepspeed.py checks each assumption against the installed accelerate and DeepSpeed."""
    if resolved_distributed(cfg).strategy != "deepspeed" or not on_cpu(cfg):
        return False
    from datetime import timedelta

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    if "ACCELERATE_USE_CPU" in os.environ:  # a CPU launch config's use_cpu: it would drop the plugin
        os.environ["ACCELERATE_USE_CPU"] = "false"
    if "LOCAL_RANK" not in os.environ:  # not launched (python recipes/run.py): a process group of one, as torchrun's
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    from accelerate.state import PartialState

    # By its module's name: the attribute deepspeed.comm.torch is torch itself (deepspeed.comm imports torch).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    minutes = cfg.distributed.timeout_minutes
    PartialState(backend="gloo", **({"timeout": timedelta(minutes=minutes)} if minutes else {}))
    return True


@contextmanager
def loading_whole_models(accelerator: Accelerator) -> Iterator[None]:
    """Models loaded or built in this block are whole on every process. Under DeepSpeed ZeRO-3, transformers builds
    every model (``from_pretrained``, ``from_config``) inside ``deepspeed.zero.Init`` whenever accelerate's DeepSpeed
    config is registered (its ``HfDeepSpeedConfig``, set whatever ``zero3_init_flag`` says), and that partitioning
    is collective, while the main process loads first (filling the caches) and the others wait at a barrier: ZeRO-3
    hung there. The engine partitions the whole model when ``prepare`` builds it instead; the config is registered
    again afterwards (saving reads it)."""
    if not is_zero3(accelerator):
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


def whole_on_every_process(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """The parameters a pretrained checkpoint lacks (a classifier's new head), made real on every process with the
    first process's values. Under FSDP's CPU-RAM-efficient loading transformers leaves them on the meta device on
    every other process (the first process's weights are broadcast in ``prepare``), and accelerate (1.15) maps the
    optimizer's parameters to FSDP2's shards by data pointer, which is 0 for all of them: the optimizer of process
    1 held the head's bias twice and its weight not at all (the toy regression's checkpoint ended in KeyError: 16
    in torch's get_state_dict; a 2-class head trained one row on the first process only)."""
    if accelerator.num_processes == 1 or accelerator.distributed_type != "FSDP":
        return
    from accelerate.utils import broadcast, gather_object  # in the function, as build_accelerator imports accelerate

    mine = [name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    made = {}  # tied parameters stay one
    for name in sorted(set(gather_object(mine))):
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = getattr(module, attribute)
        if param.is_meta:
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                     requires_grad=param.requires_grad)
            param = made[id(param)]
            setattr(module, attribute, param)
        param.data.copy_(broadcast(param.data.to(accelerator.device), from_process=0))


def fsdp2_wrap_classes(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """The block classes FSDP2's transformer wrap policy shards one by one: the model's ``_no_split_modules`` less
    those that hold its input or output embeddings. accelerate (1.15) shards those embeddings as units of their own
    after the blocks, so a block holding them would have them sharded twice: BERT's ``BertEmbeddings`` (a
    no-split module around the word embeddings) ended the default classifier under fsdp.yaml with a TypeError
    inside ``fully_shard``. Unchanged without FSDP2's transformer wrap, or where the classes were already set."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or plugin.fsdp_version != 2 or plugin.transformer_cls_names_to_wrap is not None:
        return
    policy = plugin.auto_wrap_policy
    if getattr(policy, "func", policy) is not transformer_auto_wrap_policy:
        return
    embeddings = [getattr(get(), "weight", None) for get in
                  (getattr(model, "get_input_embeddings", lambda: None), getattr(model, "get_output_embeddings", lambda: None))]
    holders = {type(m).__name__ for m in model.modules()
               if any(w is not None and any(w is p for p in m.parameters()) for w in embeddings)}
    plugin.transformer_cls_names_to_wrap = [c for c in (getattr(model, "_no_split_modules", None) or []) if c not in holders]


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
    tied = getattr(model.config, "tie_word_embeddings", False)
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if tied:  # the plan names both the embedding's and the output layer's weight: each must be a parameter of its own
        output.weight = torch.nn.Parameter(output.weight.detach().clone())
    try:
        config, _, mesh = type(model).prepare_distribute_model(DistributedConfig(tp_size=size))
        model = type(model).maybe_distribute_model(model, config, mesh)
    except ValueError as e:  # a size the plan cannot split (heads, key/value heads)
        raise UserError(f"distributed.tensor_parallel: {str(e).splitlines()[0]}") from None
    if tied:
        # The plan shards the embedding (embedding_rowwise) and the output layer (colwise) by vocabulary alike:
        # tied again, both use the embedding's shard, one matrix as before.
        if output.weight.placements != embedding.weight.placements:
            raise UserError("distributed.tensor_parallel: the model ties its output layer to its embedding, which "
                            "the plan shards differently; set tie_word_embeddings: false, or remove the key")
        output.weight = embedding.weight
    return model


def _process_group_kwargs(cfg: RunConfig) -> list:
    """The process group's timeout, when the recipe sets one (``distributed.timeout_minutes``)."""
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    minutes = cfg.distributed.timeout_minutes
    return [InitProcessGroupKwargs(timeout=timedelta(minutes=minutes))] if minutes else []


def _no_deepspeed() -> bool:
    return False


def _deepspeed_unwrapped_only_under_it(accelerator: Accelerator) -> None:
    """accelerate (1.15) imports DeepSpeed in every ``unwrap_model`` where it is installed, to recognise its engine:
    2.4 s of imports (mlflow, through its autotuner) in each process of a run that does not use it, measured in
    the profile of a tiny run (14 s in all), and DeepSpeed's "Setting accelerator to CPU" warning. A run not under
    DeepSpeed has no engine to unwrap, so its unwrapping does not ask; the next run in the same process, if under
    DeepSpeed, asks again."""
    from accelerate.utils import imports, other

    deepspeed = accelerator.distributed_type == "DEEPSPEED"
    other.is_deepspeed_available = imports.is_deepspeed_available if deepspeed else _no_deepspeed


def build_accelerator(cfg: RunConfig, accumulation: int) -> Tuple[Accelerator, xla_spmd.Mesh]:
    """The Accelerator for the recipe and launch, and the SPMD mesh one process drives (``Mesh()`` without SPMD);
    ``accumulation``: the micro-batches of one weight update (``Task.micro_batches_per_update``)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

    check(cfg)
    mesh = xla_spmd.start(cfg)  # before the XLA runtime starts
    plugins = _plugins(cfg, accumulation)
    deepspeed_on_cpu = deepspeed_on_cpu_processes(cfg)
    try:
        accelerator = Accelerator(
            cpu=(cfg.backend == "cpu" or auto_means_cpu(cfg)) and not deepspeed_on_cpu,
            mixed_precision=cfg.precision,
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=accumulation,
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
    _deepspeed_unwrapped_only_under_it(accelerator)
    if is_fsdp2(accelerator) and cfg.distributed.fsdp.replicas > 1:
        _hybrid_shard(accelerator, cfg.distributed.fsdp.replicas)
    if cfg.distributed.tensor_parallel:
        _tensor_parallel(accelerator, cfg.distributed.tensor_parallel)
    check_launch(cfg, accelerator)
    if on_xla(accelerator):
        _masks_without_host_reads()
        _xla_loaders_with_dataset()
    elif accelerator.device.type == "cpu":
        torch.set_num_threads(cpu_threads(cfg)[0])
        reuse_large_buffers()
    return accelerator, mesh


def release(accelerator: Accelerator, finished: bool) -> None:
    """After the run, once the caller dropped its own references: free what the Accelerator prepared while the
    interpreter is whole, and for a ``finished`` run end its trackers and process groups (a run that stopped keeps
    its groups: another process may still be inside a collective, and destroying them would turn its clean exit
    into a traceback). DeepSpeed's engine keeps itself and the model alive through its gradient hooks (a cycle
    through C++ that no collection sees), its world group in ``deepspeed.utils.groups``, and under ZeRO-3 the model
    on its forward stack and in its coordinator's cache: all of it, gloo's threads too, used to be torn down during
    the interpreter's shutdown, where on CI a finished ZeRO-2 run's second process aborted (SIGABRT, "terminate
    called without an active exception", after "done"). ``free_memory`` destroys the engine (hooks removed; it asks
    the process group its rank, so it comes first); the collection then frees the model and the groups that were
    only the model's. tests/test_deepspeed.py checks that nothing of the engine is left after a run."""
    import gc

    from accelerate.utils import DistributedType

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    accelerator.free_memory()
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        importlib.import_module("deepspeed.utils.groups")._WORLD_GROUP = None
        # ZeRO-3 puts the model on its forward stack when it builds the engine and never takes it off, and its
        # parameter coordinator's class-wide cache keeps every coordinator (and through it the model).
        importlib.import_module("deepspeed.runtime.zero.parameter_offload").FWD_MODULE_STACK.clear()
        coordinator = importlib.import_module("deepspeed.runtime.zero.partitioned_param_coordinator")
        cached = coordinator.PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
        inspect.getclosurevars(cached).nonlocals["func"].cache_clear()  # under DeepSpeed's NVTX wrapper
    if finished:
        accelerator.end_training()
    if distributed:  # in one process without groups nothing waits for the collection
        gc.collect()


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


"""The one place that knows backends: recipe + launch -> Accelerator, what the run really got, and what training
does differently on each. Callers write ``from framework import backend`` and ``backend.X(...)``; each concern is
a module of its own:

- selection: the backend and strategy asked for, and the combinations refused before anything is built
- build: the Accelerator, its plugins, and what is set in accelerate's state after construction
- topology: questions about what the run got (XLA, tensor parallelism, sharded states, data-parallel ranks)
- layout: how a strategy splits and offloads the states, for the memory plan
- cpu: CPU threads and the allocator
- launch: the launch checked against the recipe, and the plan's text about it
- ops: the per-step device work (placing the model, clipping, device scalars, host reads)
- generation: generating in the middle of training and back
- compiles: XLA's compilations watched
- saving: gathering state dicts
- states: a checkpoint's training state, in a form any topology loads (DCP)
- hardware: the device's name, peak FLOP/s and memory
- tracing: profiler traces
- xla_spmd: XLA SPMD's device mesh
"""

from framework.backend.build import (build_accelerator, fsdp2_on_cpu_processes, loading_whole_models, release,
                                    tensor_parallel_model, whole_on_every_process)
from framework.backend.compiles import CompileWatch, xla_stats
from framework.backend.cpu import cpu_threads, large_buffers_unmapped, reuse_large_buffers
from framework.backend.generation import generating, generation_ready, weights_gathered
from framework.backend.hardware import peak_flops, peak_memory_bytes, total_memory_bytes
from framework.backend.layout import MemoryLayout, memory_layout
from framework.backend.launch import backend_name, describe, notes, strategy_name
from framework.backend.ops import (any_process, check_optimizer_parameters, clip_gradients, place_model,
                                   preemption_check_interval, read_scalar, run_pending, to_host, total_over_processes,
                                   unwrap, zero_scalar)
from framework.backend.saving import (gather_for_metrics, held_bytes, local_shard, saving_gathered,
                                      state_dict_for_save)
from framework.backend.selection import (Strategy, auto_precision, check, has_xla, model_checkpointing, planned_strategy,
                                        resolved_distributed, select_backend, strategy)
from framework.backend.topology import (data_parallel, has_dtensor_parameters, is_fsdp2, is_tensor_parallel, is_zero3, needs_static_shapes, on_xla,
                                        parameter_shards, shards_parameters, tensor_parallel_size)
from framework.backend.states import (load as load_states, load_model as load_model_states, portable as portable_states,
                                      save as save_states)
from framework.backend.tracing import Trace
from framework.backend.xla_spmd import Mesh

__all__ = [
    "CompileWatch", "MemoryLayout", "load_model_states", "load_states", "portable_states", "save_states", "Mesh", "Strategy", "Trace", "any_process", "auto_precision", "backend_name", "build_accelerator", "check", "check_optimizer_parameters", "clip_gradients", "cpu_threads",
    "data_parallel", "describe", "fsdp2_on_cpu_processes", "gather_for_metrics", "generating", "generation_ready", "has_dtensor_parameters", "has_xla", "is_fsdp2", "is_tensor_parallel", "is_zero3", "weights_gathered",
    "held_bytes", "large_buffers_unmapped", "loading_whole_models", "whole_on_every_process", "local_shard", "memory_layout", "model_checkpointing", "needs_static_shapes", "notes",
    "on_xla", "parameter_shards", "peak_flops", "peak_memory_bytes", "place_model", "planned_strategy", "preemption_check_interval",
    "read_scalar", "release", "run_pending", "resolved_distributed", "reuse_large_buffers", "saving_gathered", "select_backend", "shards_parameters",
    "state_dict_for_save", "strategy", "strategy_name", "tensor_parallel_model", "tensor_parallel_size", "to_host",
    "total_memory_bytes", "total_over_processes", "unwrap", "xla_stats", "zero_scalar",
]

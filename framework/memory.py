"""Memory accounting: the plan (what a run will need per device, estimated before training) and what it held
(parameters, weights, gradients, optimizer state and the measured peak, after training).

The plan counts weights, gradients and optimizer state from the model's real shapes, divides what the strategy
shards by the number of processes, and adds a rough activation estimate. It leaves out the CUDA context,
allocator fragmentation, communication buffers (DDP buckets, FSDP all-gathers) and temporaries, so it is a
floor for the peak, good for seeing which part dominates and whether a run cannot fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence

import torch

from framework.config import OptimConfig, RunConfig

MIB = 2**20
# bitsandbytes keeps 32-bit state for tensors smaller than this, and one fp32 scale per block of the rest.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256

def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

def _quant_state(p: torch.Tensor):
    """bitsandbytes' 4-bit weights (QLoRA) pack two values per byte and keep their scales aside."""
    return getattr(p, "quant_state", None) if type(p).__name__ == "Params4bit" else None

def parameter_count(p: torch.Tensor) -> int:
    return p.numel() * 2 if _quant_state(p) is not None else p.numel()

def weight_bytes(p: torch.Tensor) -> int:
    """The bytes a weight holds: its data, and for 4-bit weights their block scales too."""
    state = _quant_state(p)
    if state is None:
        return _tensor_bytes(p)
    scales = [state.absmax] + ([state.state2.absmax, state.offset] if state.nested else [])
    return _tensor_bytes(p) + sum(_tensor_bytes(t) for t in scales)

def _optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The optimizer's own state tensors (moments, quantization scales, ...), each once: a tensor shared by
    several parameters (bitsandbytes' quantization maps) is one."""
    return list({id(v): v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)}.values())

def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's own state tensors."""
    return sum(_tensor_bytes(t) for t in _optimizer_state_tensors(optimizer))

def measured(model: torch.nn.Module, optimizer: torch.optim.Optimizer, peak_bytes: int,
             held: Optional[Callable[[Iterable[torch.Tensor]], int]] = None) -> Dict[str, object]:
    """What the run held: parameter counts, the bytes of the weights, gradients (one per trainable weight) and
    optimizer state, all unsharded, and the peak. ``held``: where the states are sharded, the bytes one device
    holds of some tensors, read from their shards; then ``per_device`` has those figures too."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    result = {
        "parameters": sum(parameter_count(p) for p in params),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "weight_bytes": sum(weight_bytes(p) for p in params),
        "gradient_bytes": sum(_tensor_bytes(p) for p in trainable),
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "peak_bytes": peak_bytes,
    }
    if held is not None:
        result["per_device"] = {"weight_bytes": held(params), "gradient_bytes": held(trainable),
                                "optimizer_state_bytes": held(_optimizer_state_tensors(optimizer))}
    return result

# ---------------------------------------------------------------- the plan

def optimizer_state_estimate(params: Iterable[torch.Tensor], cfg: OptimConfig) -> int:
    """Bytes of optimizer state for these (trainable) parameters, from their shapes; states are fp32."""
    return sum(_state_bytes(tuple(p.shape), cfg) for p in params)

def _state_bytes(shape: tuple, cfg: OptimConfig) -> int:
    n = math.prod(shape)
    if cfg.name == "adamw":  # two moments
        return 8 * n
    if cfg.name in ("adamw_8bit", "paged_adamw_8bit"):  # two uint8 moments + one fp32 scale each per block
        return 8 * n if n < BNB_MIN_8BIT_SIZE else 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)
    if cfg.name == "lion":  # one momentum
        return 4 * n
    if cfg.name == "sgd":
        return 4 * n if cfg.momentum > 0 else 0
    if cfg.name == "adafactor":  # no first moment; a matrix's second moment factored into row and column sums
        if len(shape) >= 2:
            return 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1])
        return 4 * n
    raise ValueError(f"no state estimate for optimizer {cfg.name}")

@dataclass(frozen=True)
class MemoryLayout:
    """What the memory plan needs to know of the strategy: the backend's ``memory_layout`` says it."""

    shards: int  # how many ways the sharded states are split (the processes; under xla_fsdp the mesh's fsdp axis)
    sharded: FrozenSet[str]  # of weights, gradients, optimizer_state: those split over the shards
    offloaded: FrozenSet[str]  # those kept in host memory instead of on the device
    half_copies: bool  # DeepSpeed under bf16/fp16: 16-bit weights and gradients, an fp32 master in the optimizer state
    first_chunk: bool  # FSDP2: each parameter cut on dimension 0 into torch.chunk's pieces, the first process's largest
    gathers_for_generation: bool  # FSDP2, DeepSpeed: sharded weights can be gathered whole for a generation
    # Tensor parallelism: the model is already sharded; this process's piece of a parameter. None otherwise.
    local_piece: Optional[Callable[[torch.Tensor], torch.Tensor]]
    activation_checkpointing: bool  # the strategy checkpoints activations itself (FSDP's activation_checkpointing)

def activation_estimate(model_config: object, batch_size: int, seq_length: int, element_bytes: int,
                        checkpointing: bool) -> Optional[int]:
    """Rough bytes of activations kept for backward by a transformer encoder; None without a transformer config.

    Per layer, with b batch, s sequence length, h hidden size, i intermediate size, a heads and E bytes per
    element (4 in fp32, 2 under bf16/fp16 autocast), after Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models"), generalized to any i and E:

        E * (8*b*s*h + 2*b*s*i + 2*b*a*s*s) + (2*b*s*h + b*a*s*s)   (the last term: 1-byte dropout masks)

    which is their 34*b*s*h + 5*b*a*s*s bytes for E=2 and i=4h. The s*s terms assume attention
    probabilities are stored (eager attention); fused attention kernels keep far less, so long sequences
    are overestimated. With gradient checkpointing only each layer's input (E*b*s*h) is kept, plus one layer
    recomputed in backward. Embeddings, the head and the loss are left out. For all-MiniLM-L6-v2 (6 layers,
    h=384) at batch 32 x 64 tokens in fp32 it gives 378 MiB, where the tensors autograd saved came to 441 MiB.
    """
    h = getattr(model_config, "hidden_size", None)
    layers = getattr(model_config, "num_hidden_layers", None)
    heads = getattr(model_config, "num_attention_heads", None)
    if not (h and layers and heads):
        return None
    i = getattr(model_config, "intermediate_size", None) or 4 * h
    b, s, a, e = batch_size, seq_length, heads, element_bytes
    per_layer = e * (8 * b * s * h + 2 * b * s * i + 2 * b * a * s * s) + (2 * b * s * h + b * a * s * s)
    if checkpointing:
        return layers * e * b * s * h + per_layer
    return layers * per_layer

def kv_cache_estimate(model_config: object, rows: int, length: int, element_bytes: int) -> int:
    """Bytes of the key and value cache of ``rows`` sequences of ``length`` tokens generated at once: per layer
    and token, a key and a value of every key-value head (grouped-query attention: fewer than the heads)."""
    layers = getattr(model_config, "num_hidden_layers", None) or 0
    heads = getattr(model_config, "num_attention_heads", None) or 0
    if not (layers and heads and rows):
        return 0
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return rows * length * layers * 2 * kv_heads * head_dim * element_bytes


def logit_estimate(model_config: object, batch_size: int, seq_length: int, chunk: Optional[int] = None,
                   autocast: bool = False) -> int:
    """Bytes of a language model's logits, the largest activation at large vocabularies: batch x length x
    vocabulary, fp32 (the loss upcasts them) and once more for the log-softmax the loss keeps for backward.
    With a chunked loss (``chunk`` tokens at a time, framework/losses.py): one chunk's logits, fp32 (turned
    into their gradient in place), under 16-bit ``autocast`` with the head's 16-bit output and gradient beside
    them, plus what it keeps for backward: the gradient of the hidden states and of the head's weight (fp32,
    vocabulary x hidden)."""
    vocab, tokens = getattr(model_config, "vocab_size", 0), batch_size * seq_length
    if chunk is None:
        return 2 * 4 * tokens * vocab
    hidden = getattr(model_config, "hidden_size", 0)
    return (8 if autocast else 4) * min(chunk, tokens) * vocab + 4 * tokens * hidden + 4 * vocab * hidden

@dataclass
class Workload:
    """What a task puts through the device besides the trained model's states (``Task.workload``)."""

    seq_length: Optional[int] = None  # tokens per row; default data.max_length
    sequences: int = 1  # rows per example (a preference pair's two)
    token_logits: bool = False  # language models: logits over the vocabulary for every token
    logits_chunk: Optional[int] = None  # with token_logits: tokens whose logits are held at once (the chunked loss)
    frozen: Sequence[torch.nn.Module] = ()  # models held beside it (DPO's reference: their weights, replicated)
    generated_rows: int = 0  # sequences generated at once in a step (GRPO's completions), each holding a KV cache
    generated_length: int = 0  # the longest each of them gets: prompt and completion, in tokens
    generated_by: str = ""  # the recipe key of the completions' length, which a cache too large for the device names

def plan(model: torch.nn.Module, cfg: RunConfig, layout: MemoryLayout, workload: Workload = Workload(),
         device_bytes: Optional[int] = None) -> Dict[str, object]:
    """The memory one device needs for this recipe, in bytes: weights, gradients and optimizer state after
    sharding as the strategy lays them out (``layout``: ``backend.memory_layout``), activations for a full
    ``train.batch_size`` x ``workload.sequences`` x ``workload.seq_length`` batch, with ``token_logits``
    (language models) the logits of every token, the weights of the task's frozen models, and their total
    on the device (offloaded states excluded). Call it on the model as loaded, before ``accelerator.prepare``
    shards it.

    Under accelerate's autocast the weights, gradients and optimizer state stay fp32; DeepSpeed with bf16
    or fp16 instead keeps 16-bit weights and gradients and an fp32 master copy in the optimizer state.

    A task that generates under FSDP2 or ZeRO-3 gathers the whole weights once per generation where the plan with
    them fits the device's memory (``device_bytes``; None: not known, so not), else block by block in each forward
    (``gathers_weights``; ``gathered_weight_bytes``: what the gathered copy adds to a device's shard).
    """
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    trainable_count = sum(p.numel() for p in trainable)
    half_copies, shards = layout.half_copies, layout.shards
    full = _state_bytes_of(params, trainable, cfg, half_copies)
    sharded, offloaded = layout.sharded, layout.offloaded
    if layout.local_piece:
        # The model is already sharded (tensor parallelism): this process's pieces, exactly; the norms and any
        # layer outside the plan stay whole on every process.
        local = [layout.local_piece(p) for p in params]
        per_device = _state_bytes_of(local, [t for t, p in zip(local, params) if p.requires_grad], cfg, half_copies)
    elif layout.first_chunk and shards > 1:
        # FSDP2 splits every parameter on its first dimension into torch.chunk's pieces, the first process's
        # the largest: that process's bytes, exactly (what summary.json's per_device reads from its shards).
        first = _state_bytes_of([_first_chunk(p, shards) for p in params],
                                [_first_chunk(p, shards) for p in trainable], cfg, half_copies)
        per_device = {k: first[k] if k in sharded else v for k, v in full.items()}
    else:
        per_device = {k: math.ceil(v / shards) if k in sharded else v for k, v in full.items()}
    checkpointing = cfg.train.gradient_checkpointing or layout.activation_checkpointing
    seq_length = workload.seq_length or cfg.data.max_length
    sequences, token_logits, logits_chunk = workload.sequences, workload.token_logits, workload.logits_chunk
    config = getattr(model, "config", None)
    rows = cfg.train.batch_size * sequences
    activations = activation_estimate(config, rows, seq_length, 4 if cfg.precision == "no" else 2, checkpointing)
    logits = logit_estimate(config, rows, seq_length, logits_chunk, cfg.precision != "no") if token_logits else 0
    frozen_bytes = sum(weight_bytes(p) for m in workload.frozen for p in m.parameters())
    # Generation holds its cache without gradients, before the update's forward keeps its activations: the larger.
    kv_cache = kv_cache_estimate(config, workload.generated_rows, workload.generated_length,
                                 4 if cfg.precision == "no" else 2)
    states = sum(v for k, v in per_device.items() if k not in offloaded) + frozen_bytes
    gathered = (full["weights"] - per_device["weights"]
                if workload.generated_rows and layout.gathers_for_generation and shards > 1 and "weights" in sharded
                and "weights" not in offloaded else 0)
    gathers = bool(gathered) and device_bytes is not None and \
        states + max((activations or 0) + logits, kv_cache + gathered) <= device_bytes
    on_device = states + max((activations or 0) + logits, kv_cache + (gathered if gathers else 0))
    return {
        "parameters": sum(parameter_count(p) for p in params),
        "trainable_parameters": trainable_count,
        "optimizer": cfg.optim.name,
        "precision": cfg.precision,
        "shards": shards,
        "sharded": sorted(sharded),
        "offloaded": sorted(offloaded),
        "batch_size": cfg.train.batch_size,
        "sequences_per_example": sequences,
        "seq_length": seq_length,
        "gradient_checkpointing": checkpointing,
        "weight_bytes": per_device["weights"],
        "gradient_bytes": per_device["gradients"],
        "optimizer_state_bytes": per_device["optimizer_state"],
        "activation_bytes": activations,
        "logit_bytes": logits,
        "frozen_model_bytes": frozen_bytes,
        "kv_cache_bytes": kv_cache,
        "generated_rows": workload.generated_rows,
        "generated_length": workload.generated_length,
        "generated_by": workload.generated_by,
        "gathered_weight_bytes": gathered,
        "gathers_weights": gathers,
        "logits_chunk": logits_chunk if token_logits else None,
        "total_bytes": on_device,
    }

def _state_bytes_of(params: List[torch.Tensor], trainable: List[torch.Tensor], cfg: RunConfig,
                    half_copies: bool) -> Dict[str, int]:
    """Bytes of the weights, gradients and optimizer state of these parameters (``half_copies``: DeepSpeed's
    16-bit weights and gradients with an fp32 master copy in the optimizer state)."""
    return {
        "weights": sum(p.numel() * 2 if half_copies else weight_bytes(p) for p in params),
        "gradients": sum(p.numel() * (2 if half_copies else p.element_size()) for p in trainable),
        "optimizer_state": optimizer_state_estimate(trainable, cfg.optim)
        + (4 * sum(p.numel() for p in trainable) if half_copies else 0),
    }

def _first_chunk(p: torch.Tensor, shards: int) -> torch.Tensor:
    """The first of ``torch.chunk(p, shards)`` (dimension 0) as a meta tensor: FSDP2's shard on the first process."""
    if p.dim() == 0:
        return p.detach().to("meta")
    rows = math.ceil(p.shape[0] / shards)
    return torch.empty((rows, *p.shape[1:]), dtype=p.dtype, device="meta")

def format_plan(plan: Dict[str, object]) -> str:
    """A short block for the run plan, in MiB."""
    def where(state: str) -> str:
        notes = [f"sharded over {plan['shards']} devices"] if state in plan["sharded"] else []
        notes += ["on the host"] if state in plan["offloaded"] else []
        return f" ({', '.join(notes)})" if notes else ""

    if plan["activation_bytes"] is None:
        activations = "unknown (no transformer config), not in the total"
    else:
        how = ", gradient checkpointing" if plan["gradient_checkpointing"] else ""
        rows = plan["batch_size"] * plan.get("sequences_per_example", 1)
        activations = (f"{_mib(plan['activation_bytes'])} (batch {rows} x {plan['seq_length']} "
                       f"tokens, precision {plan['precision']}{how})")
    return "\n".join([
        "memory plan per device (rough, a floor for the peak):",
        f"  parameters: {plan['parameters'] / 1e6:.2f}M ({plan['trainable_parameters'] / 1e6:.2f}M trainable)",
        f"  weights: {_mib(plan['weight_bytes'])}{where('weights')}",
        f"  gradients: {_mib(plan['gradient_bytes'])}{where('gradients')}",
        f"  optimizer state ({plan['optimizer']}): {_mib(plan['optimizer_state_bytes'])}{where('optimizer_state')}",
        f"  activations: {activations}",
        *([f"  logits: {_mib(plan['logit_bytes'])} ({_logits_held(plan)})"] if plan["logit_bytes"] else []),
        *([f"  generation's KV cache: {_mib(plan['kv_cache_bytes'])} ({plan['generated_rows']} sequences x "
           f"{plan['generated_length']} tokens; held before the update, the total counts the larger of it and "
           "the update's activations and logits)"] if plan.get("kv_cache_bytes") else []),
        *([f"  generation's weights: {_gathering(plan)}"] if plan.get("gathered_weight_bytes") else []),
        *([f"  frozen models (the task's reference, never trained): {_mib(plan['frozen_model_bytes'])}"]
          if plan.get("frozen_model_bytes") else []),
        f"  total on the device: {_mib(plan['total_bytes'])}",
    ])

def _gathering(plan: Dict[str, object]) -> str:
    whole = _mib(plan["gathered_weight_bytes"])
    if plan["gathers_weights"]:
        return f"{whole} beside the shard, gathered once per generation (held with the KV cache)"
    return (f"gathered block by block in each forward, in lockstep (the whole weights, {whole} beside the shard, "
            "would not fit the device's memory)")


def _logits_held(plan: Dict[str, object]) -> str:
    if plan.get("logits_chunk"):
        return (f"chunked loss: {plan['logits_chunk']} tokens x vocabulary at a time, fp32, and the gradients "
                "it keeps")
    return "batch x length x vocabulary, fp32, and their log-softmax"

def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"

def generation_refusal(plan: Dict[str, object], device_bytes: Optional[int]) -> Optional[str]:
    """Why the generation cannot run, where its KV cache and the weights alone exceed the device's memory
    (``device_bytes``; None: not known): unlike the rest of the plan these two are exact, so no run of this recipe
    could sample. Names the key of the completions' length."""
    kv = plan.get("kv_cache_bytes") or 0
    if not kv or device_bytes is None or kv + plan["weight_bytes"] <= device_bytes:
        return None
    key = plan["generated_by"]
    section = key.split(".")[0]
    return (f"{key}: the generation's KV cache needs {_mib(kv)} per device ({plan['generated_rows']} sequences x "
            f"{plan['generated_length']} tokens of prompt and completion) beside the weights' "
            f"{_mib(plan['weight_bytes'])}, more than the device's {_mib(device_bytes)}; lower {key}, "
            f"{section}.num_generations or train.batch_size")


def capacity_warning(plan: Dict[str, object], device_bytes: Optional[int]) -> Optional[str]:
    """A warning when the plan alone exceeds the device's memory (``device_bytes``: CUDA total memory; None
    where it is not known, which gives no warning). The run still starts: the plan is rough."""
    if device_bytes is None or plan["total_bytes"] <= device_bytes:
        return None
    parts = {"weights": plan["weight_bytes"], "gradients": plan["gradient_bytes"],
             "optimizer state": plan["optimizer_state_bytes"], "activations": plan["activation_bytes"] or 0}
    largest = max(parts, key=parts.get)
    return (f"the memory plan needs about {_mib(plan['total_bytes'])} per device, more than the device's "
            f"{_mib(device_bytes)} ({largest} {_mib(parts[largest])} the largest part); lower train.batch_size or "
            "data.max_length, set train.gradient_checkpointing=true, use optim.name=adamw_8bit or adafactor, or "
            "shard with distributed.strategy=fsdp or deepspeed")

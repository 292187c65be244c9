"""Model FLOPs and the hardware's peak, for MFU (model FLOPs utilization: the FLOPs the model's arithmetic needs
per second, over what the devices can do at most).

Model FLOPs per token follow PaLM (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
appendix B), the formula torchtitan's ``get_num_flop_per_token`` and llm-foundry's MFU use:

    6 * N  +  12 * L * H * Q * T

N: the parameters every token's matrix products touch (all but the embedding lookups; an output layer that
shares the embedding matrix is a product, so it counts), L layers, H attention heads of Q dimensions, T the
sequence length. 6N is the forward pass (2N: a multiply and an add per weight) and the backward pass (4N:
gradients of the inputs and of the weights); 12*L*H*Q*T is attention's two products (scores, values) per layer,
forward and backward, at full (not causal) cost, as in PaLM. A frozen weight (adapters, QLoRA) gets no weight
gradient, so it counts 4 instead of 6. Recomputation (gradient checkpointing) and padding are not model FLOPs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from framework.memory import parameter_count


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs to train on one token: ``per_token + per_token_context * T`` at sequence length T."""

    per_token: float  # the 6N (4N for frozen weights) part
    per_token_context: float  # 12 * L * H * Q: the attention part, per token of context
    matmul_parameters: int  # N

    def at(self, seq_length: int) -> float:
        return self.per_token + self.per_token_context * seq_length

    def total(self, tokens: int, token_context: int) -> float:
        """FLOPs of training on ``tokens`` tokens whose sequence lengths sum to ``token_context`` over the
        tokens (each token counts the length of the row it is in)."""
        return self.per_token * tokens + self.per_token_context * token_context


def model_flops(model: torch.nn.Module) -> ModelFlops:
    """The model's training FLOPs per token (module docstring), from its parameters and its config's layers,
    heads and head size. Call it on the model as loaded, before ``accelerator.prepare`` shards it."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied_output = getattr(output, "weight", None)
    per_token, n = 0.0, 0
    for p in model.parameters():  # shared tensors come once
        if id(p) in embeddings and p is not tied_output:
            continue
        count = parameter_count(p)
        n += count
        per_token += (6 if p.requires_grad else 4) * count
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    context = 12 * layers * heads * head_dim if layers and heads and head_dim else 0
    return ModelFlops(per_token, context, n)


# Dense peak FLOP/s per chip (no structured sparsity), in TFLOP/s, by the precision matrix products run in.
# NVIDIA from its datasheets (the sparsity figures halved); TPUs from Google Cloud's system architecture pages.
# On TPUs matrix products run in bf16 passes also for fp32 tensors (XLA's default precision), so one figure.
PEAK_TFLOPS = {
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "H100 SXM": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0, "fp8": 1670.5},
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "B200": {"fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
    "TPU v4": {"bf16": 275.0},
    "TPU v5e": {"bf16": 197.0},
    "TPU v5p": {"bf16": 459.0},
    "TPU v6e": {"bf16": 918.0},
}


def chip(device_name: str) -> Optional[str]:
    """The PEAK_TFLOPS row for a device's name (CUDA's device name, or an XLA device kind such as
    ``TPU v5 lite``), or None for a device the table does not know."""
    name = device_name.lower()
    if "h100" in name:
        return "H100 PCIe" if "pcie" in name else "H100 NVL" if "nvl" in name else "H100 SXM"
    for row in ("A100", "H200", "B200"):
        if row.lower() in name:
            return row
    tpu = {"tpu v4": "TPU v4", "tpu v5 lite": "TPU v5e", "tpu v5e": "TPU v5e", "tpu v5litepod": "TPU v5e",
           "tpu v5p": "TPU v5p",
           "tpu v5": "TPU v5p", "tpu v6 lite": "TPU v6e", "tpu v6e": "TPU v6e"}
    for kind, row in tpu.items():  # the longer names first: "tpu v5 lite" before "tpu v5"
        if name.startswith(kind):
            return row
    return None


def table_peak(row: str, matmul_precision: str) -> Optional[float]:
    """Peak FLOP/s of a PEAK_TFLOPS row in a precision (fp32, tf32, bf16, fp16, fp8); TPUs have one figure."""
    figures = PEAK_TFLOPS[row]
    value = figures.get(matmul_precision, figures["bf16"] if row.startswith("TPU") else None)
    return None if value is None else value * 1e12


PROBE_SIZE = 1024  # the largest probe product; a slow dtype (bf16 without native support: 0.8 GFLOP/s here) gets smaller ones


def measure_matmul_peak(dtype: torch.dtype, seconds: float = 0.3) -> tuple:
    """(FLOP/s, size) of this process's square matrix products on the CPU with its current threads: the best of
    repeated timings for about ``seconds``, at the largest size up to PROBE_SIZE whose product takes under 20 ms.
    A BLAS product that size runs near what the cores can do (here 67 GFLOP/s at 1024 and 72 at 512, fp32, 2
    threads), so it stands in for a peak no datasheet gives for this machine."""
    generator = torch.Generator().manual_seed(0)  # its own: the run's random state (dropout) stays untouched
    size = 128
    while True:
        a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
        start = time.perf_counter()
        out = torch.mm(a, b)  # also warms up: thread pool, packing buffers
        if size >= PROBE_SIZE or time.perf_counter() - start > 0.02:
            break
        size *= 2
    flops = 2 * size ** 3
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = max(best, flops / (time.perf_counter() - start))
        if time.perf_counter() >= deadline:
            return best, size

"""What the hardware is and holds: the device's name, its peak FLOP/s (a datasheet table, or a probe on the CPU),
and its memory."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional, Tuple

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator


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
    elsewhere it comes from ``PEAK_TFLOPS`` by the device's name; None for a device the table lacks."""
    precision = accelerator.mixed_precision
    if accelerator.device.type == "cpu":
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        value, size = measure_matmul_peak(dtype)
        return value, (f"measured: {str(dtype).replace('torch.', '')} {size}x{size} matrix products, "
                       f"{torch.get_num_threads()} threads")
    name = _device_name(accelerator)
    row = chip(name)
    if precision == "no":  # fp32 products run on tensor cores as TF32 only when torch allows it
        tf32 = accelerator.device.type == "cuda" and torch.backends.cuda.matmul.fp32_precision == "tf32"
        precision = "tf32" if tf32 else "fp32"
    value = table_peak(row, precision) if row else None
    if value is None:
        return None, f"no peak FLOP/s known for {name} in {precision} (framework/backend/hardware.py PEAK_TFLOPS): no MFU"
    return value, f"{row} {precision}, datasheet (dense)"


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


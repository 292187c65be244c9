"""What the hardware is and holds: the device's name, its peak FLOP/s (a datasheet table; on the CPU its cores,
clock and vector width), and its memory."""

from __future__ import annotations

import os
from pathlib import Path
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


# FLOPs a core's vector units can finish in a cycle, by the widest instruction set its flags name: two fused
# multiply-add pipes of that width (a multiply-add is 2 FLOPs), as x86 server cores since Haswell and Zen 2 have.
# bf16 and fp16 run at the fp32 rate unless the core has instructions of its own for them (AMX tiles; AVX-512's
# bf16 and fp16 dot products). An upper bound by construction: no kernel exceeds it, so neither does the MFU.
CPU_FLOPS_PER_CYCLE = (  # (flag, dtype, FLOPs a cycle a core); the first row whose flag the CPU has and whose dtype matches
    ("amx_bf16", "bfloat16", 1024), ("amx_fp16", "float16", 1024),
    ("avx512_bf16", "bfloat16", 128), ("avx512_fp16", "float16", 128),
    ("avx512f", None, 64), ("avx2", None, 32), ("avx", None, 16), ("sse2", None, 8),
)


# A virtual machine shows its cores' nominal clock and no cpufreq; they boost above it (a 2.1 GHz Xeon here
# multiplied fp32 matrices at 2.4 GHz x 64 FLOPs a cycle a core). Server parts boost to under twice their base clock
# (Xeon Scalable and EPYC: 1.4x to 1.9x), so twice the nominal clock bounds them.
VM_BOOST_BOUND = 2.0


def _cpuinfo() -> Tuple[set, Optional[float]]:
    """The CPU's flags and its clock in Hz: the kernel's highest frequency (cpufreq, where it is exposed), else the
    clock /proc/cpuinfo reports, which in a virtual machine (the ``hypervisor`` flag) is the nominal one and is
    taken ``VM_BOOST_BOUND`` times. Empty and None off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set(), None
    flags = set()
    clocks = []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("flags", "Features"):
            flags.update(value.split())
        elif key == "cpu MHz":
            clocks.append(float(value) * 1e6)
    try:
        return flags, int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) * 1e3
    except (OSError, ValueError):
        pass
    if not clocks:
        return flags, None
    return flags, max(clocks) * (VM_BOOST_BOUND if "hypervisor" in flags else 1.0)


def cpu_flags() -> set:
    """The CPU's instruction-set flags (/proc/cpuinfo; empty off Linux)."""
    return _cpuinfo()[0]


def _usable_cores() -> int:
    """The physical cores this process may run on: its CPUs, with SMT siblings (two CPUs of one core, which share
    its vector units) counted once."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(cpu)
    return len(cores)


def cpu_peak_flops(dtype: torch.dtype) -> Tuple[Optional[float], str]:
    """This process's peak FLOP/s on the CPU in ``dtype`` and how it was reckoned: the cores its threads can use x
    the clock x the FLOPs a core's vector units finish a cycle (``CPU_FLOPS_PER_CYCLE``). None where the clock
    or the instruction set is not known (then no MFU)."""
    flags, clock = _cpuinfo()
    name = str(dtype).replace("torch.", "")
    per_cycle = next(((flag, n) for flag, kind, n in CPU_FLOPS_PER_CYCLE
                      if flag in flags and kind in (None, name)), None)
    if clock is None or per_cycle is None:
        return None, "no CPU clock or vector instruction set readable from /proc/cpuinfo: no MFU"
    cores = min(torch.get_num_threads(), _usable_cores())
    flag, n = per_cycle
    boost = "; the clock twice a virtual machine's nominal one, which its cores boost above" if "hypervisor" in flags \
        else ""
    return cores * clock * n, (f"{cores} cores x {clock / 1e9:.3g} GHz x {n} {name} FLOPs a cycle ({flag}{boost}): "
                               "the vector units' bound, not a measurement")


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
    (said in the plan). On the CPU it is reckoned from its cores, clock and vector units (``cpu_peak_flops``);
    elsewhere it comes from ``PEAK_TFLOPS`` by the device's name; None for a device the table lacks."""
    precision = accelerator.mixed_precision
    if accelerator.device.type == "cpu":
        return cpu_peak_flops({"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32))
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
    """The device's memory when it is known: CUDA's; on the CPU the machine's memory, shared by the processes
    launched on it (LOCAL_WORLD_SIZE); None elsewhere (XLA)."""
    if accelerator.device.type == "cuda":
        return int(torch.cuda.get_device_properties(accelerator.device).total_memory)
    if accelerator.device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return None


def peak_memory_bytes(accelerator: Accelerator) -> int:
    """Peak memory of this process: the CUDA allocator's peak on GPU, else the process peak RSS."""
    if accelerator.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(accelerator.device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


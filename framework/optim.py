"""Optimizers, their parameter groups, and learning-rate schedules, by recipe name."""

from __future__ import annotations

import functools
import math
import re
from typing import List

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from framework.config import OptimConfig
from framework.errors import UserError

BITSANDBYTES = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit", "lion": "Lion"}


def param_groups(model: torch.nn.Module, cfg: OptimConfig) -> List[dict]:
    """Trainable parameters split by ``optim.param_groups`` (first matching pattern wins, the rest go to the
    default group), then each split again: matrices (weights, embeddings) decay, vectors (biases, LayerNorm
    scales) never do, since decaying them only pulls activations' scale and offset towards zero. The default
    group comes first, so the learning rate the loop logs (group 0's) is ``optim.lr``'s schedule."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    patterns = [re.compile(group.pattern) for group in cfg.param_groups]
    claimed: List[list] = [[] for _ in range(len(patterns) + 1)]  # [default group, then one per pattern]
    matched = [False] * len(patterns)
    for name, p in named:
        hits = [i for i, pattern in enumerate(patterns) if pattern.search(name)]
        for i in hits:
            matched[i] = True
        claimed[hits[0] + 1 if hits else 0].append(p)
    for i, group in enumerate(cfg.param_groups):
        if not matched[i]:
            raise UserError(f"optim.param_groups[{i}].pattern: {group.pattern!r} matches no trainable parameter; "
                            f"parameter names look like {_examples([name for name, _ in named])}")
        if not claimed[i + 1]:
            raise UserError(f"optim.param_groups[{i}].pattern: {group.pattern!r} only matches parameters that an "
                            "earlier group already takes (the first match wins); make it more specific or move it up")
        if group.lr is not None and cfg.relative_step:
            raise UserError(f"optim.param_groups[{i}].lr: Adafactor's relative-step mode sets its own learning "
                            "rate; remove the group's lr or set optim.relative_step=false")
    settings = [(None, None)] + [(g.lr, g.weight_decay) for g in cfg.param_groups]
    groups = []
    for params, (lr, weight_decay) in zip(claimed, settings):
        own_lr = {} if lr is None else {"lr": lr}
        decay = cfg.weight_decay if weight_decay is None else weight_decay
        groups.append({"params": [p for p in params if p.ndim >= 2], "weight_decay": decay, **own_lr})
        groups.append({"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, **own_lr})
    return [group for group in groups if group["params"]]


def _examples(names: List[str]) -> str:
    """Up to five names spread over the model, so the message shows its naming scheme from end to end."""
    if not names:
        return "nothing: the model has no trainable parameters"
    return ", ".join(repr(names[i]) for i in sorted({i * (len(names) - 1) // 4 for i in range(5)}))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, device_type: str,
                    dtensors: bool = False) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` over ``param_groups``. ``device_type`` is where the parameters will train
    (``accelerator.device.type``): the model may still be on the CPU here, before ``accelerator.prepare``.
    ``dtensors``: the parameters will be DTensors (FSDP2, tensor parallelism), for which torch (2.13) has a fused
    AdamW but no fused SGD (``aten._fused_sgd_`` has no sharding rule: every SGD run under FSDP2 failed)."""
    groups = param_groups(model, cfg)
    betas = tuple(cfg.betas)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **_kernel(device_type))
    if cfg.name == "sgd":
        if cfg.nesterov and cfg.momentum == 0:
            raise UserError("optim.nesterov: Nesterov SGD needs momentum; set optim.momentum > 0 "
                            "or optim.nesterov=false")
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               **({} if dtensors else _kernel(device_type)))
    if cfg.name == "adafactor":  # a plain per-parameter loop: transformers' Adafactor has no fused kernel
        from transformers.optimization import Adafactor

        if cfg.relative_step:
            return Adafactor(groups, lr=None, relative_step=True, scale_parameter=True, warmup_init=False)
        return Adafactor(groups, lr=cfg.lr, relative_step=False, scale_parameter=False)
    return _bitsandbytes(cfg, groups, device_type)


def _kernel(device_type: str) -> dict:
    """torch's fused kernel (one kernel per step for all parameters) wherever torch has one for AdamW and
    SGD: CUDA, the CPU (measured on 22.7M parameters: 28.5 ms per AdamW step fused, 148 ms with foreach),
    MPS, XPU. Elsewhere (XLA compiles the step itself) torch's own default."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # torch's own list

    fused = device_type != "xla" and device_type in _get_fused_kernels_supported_devices()
    return {"fused": True} if fused else {}


def _bitsandbytes(cfg: OptimConfig, groups: List[dict], device_type: str) -> torch.optim.Optimizer:
    """bitsandbytes optimizers, imported only when asked for: the package is optional, and its kernels
    exist for CUDA and the CPU but not XLA. The paged variant falls back to plain buffers on the CPU."""
    if device_type == "xla":
        raise UserError(f"optim.name: {cfg.name} (bitsandbytes) has no XLA kernels; use optim.name=adamw "
                        "or optim.name=adafactor on XLA")
    try:
        import bitsandbytes.optim as bnb_optim
    except ImportError:
        raise UserError(f"optim.name: {cfg.name} needs bitsandbytes, which is not installed; "
                        "`pip install bitsandbytes` or choose optim.name=adamw") from None
    optimizer_class = getattr(bnb_optim, BITSANDBYTES[cfg.name])
    if cfg.name == "lion":
        return optimizer_class(groups, lr=cfg.lr, betas=tuple(cfg.betas))
    return optimizer_class(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps is not None else math.ceil(cfg.warmup_ratio * total_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LRScheduler:
    """``optim.scheduler`` after ``warmup_steps`` linear warmup; the loop calls ``step()`` once per optimizer
    step and logs ``get_last_lr()[0]``."""
    warmup = warmup_steps(cfg, total_steps)
    if cfg.scheduler == "constant" and warmup:
        raise UserError(f"optim.scheduler: constant has no warmup, but {warmup} warmup steps were asked for; use "
                        "optim.scheduler=constant_with_warmup, or optim.warmup_ratio=0 and optim.warmup_steps=null")
    if cfg.relative_step:
        return RelativeStepSchedule(optimizer)
    return LambdaLR(optimizer, functools.partial(schedule_factor, cfg.scheduler, warmup=warmup, total=total_steps,
                                                 lr_init=cfg.lr))


POLYNOMIAL_LR_END = 1e-7  # transformers' default end of the polynomial decay


def schedule_factor(name: str, step: int, warmup: int, total: int, lr_init: float) -> float:
    """The factor on the peak learning rate after ``step`` optimizer steps: linear warmup from 0 over ``warmup``
    steps, then the schedule. These are the formulas of ``transformers.get_scheduler`` with its defaults (cosine:
    half a cycle; cosine_with_restarts: one cycle; polynomial: power 1 down to 1e-7), written here because
    importing ``transformers.optimization`` imports peft and bitsandbytes: 2 s of CPU at every process's start here
    (measured on top of the model's own imports). ``lr_init``: ``optim.lr``, the peak the polynomial ends relative to."""
    if name == "constant":
        return 1.0
    if step < warmup:
        return step / max(1, warmup)
    if name == "constant_with_warmup":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if name == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    if name == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    if name == "cosine_with_restarts":
        return 0.0 if progress >= 1.0 else max(0.0, 0.5 * (1.0 + math.cos(math.pi * (progress % 1.0))))
    if name == "polynomial":
        if step > total:
            return POLYNOMIAL_LR_END / lr_init
        return ((lr_init - POLYNOMIAL_LR_END) * (1 - (step - warmup) / (total - warmup)) + POLYNOMIAL_LR_END) / lr_init
    raise ValueError(f"no schedule {name}")


class RelativeStepSchedule(LRScheduler):
    """Reports the step size Adafactor chooses for itself in relative-step mode, min(1e-2, 1/sqrt(step)),
    before Adafactor scales it by each parameter's RMS. Adafactor ignores a group's ``lr`` in this mode, so
    writing it back is harmless. transformers' ``AdafactorSchedule`` cannot serve here: it reads gradients,
    which the loop has zeroed before it steps the schedule, and calls a method the accelerate wrapper lacks.
    Computed from the step count alone, it never reads a device tensor (no host sync on XLA)."""

    def get_lr(self) -> List[float]:
        step = self.last_epoch  # the loop steps the schedule once per optimizer step
        size = min(1e-2, 1.0 / math.sqrt(step)) if step > 0 else 0.0
        return [size for _ in self.optimizer.param_groups]

"""Optimizers and learning-rate schedules by name."""

from __future__ import annotations

import math

import torch
from transformers import get_scheduler

from framework.config import OptimConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list:
    """Decay matrices (weights, embeddings) but not vectors (biases, LayerNorm scales)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    warmup = math.ceil(cfg.warmup_ratio * total_steps)
    return get_scheduler(cfg.scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)

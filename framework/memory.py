"""Memory accounting: parameters, weights, gradients and optimizer state, and the measured peak."""

from __future__ import annotations

from typing import Dict

import torch


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's own state tensors (moments, quantization scales, ...)."""
    return sum(_tensor_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def measured(model: torch.nn.Module, optimizer: torch.optim.Optimizer, peak_bytes: int) -> Dict[str, int]:
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return {
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "weight_bytes": sum(_tensor_bytes(p) for p in params),
        "gradient_bytes": sum(_tensor_bytes(p) for p in trainable),
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "peak_bytes": peak_bytes,
    }

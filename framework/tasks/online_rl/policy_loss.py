"""Clipped surrogate policy losses, as TRL computes them, and what their clipping and estimates log.

The ratio is exp(log-probability now - log-probability at sampling) of the trained completion tokens (or of their
mean over the sequence: GSPO), clipped to [1 - epsilon, 1 + epsilon_high]; the loss of a token (``token_level``) or
a sequence (``sequence_level``) is -min(ratio * advantage, clipped ratio * advantage). A micro-batch's share of the
step's loss is returned as a sum; the step divides it by the whole generation's normaliser
(framework/tasks/online_rl/step.py)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def clipped_surrogate(ratio: torch.Tensor, advantage: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """-min(ratio * advantage, clip(ratio, 1 - low, 1 + high) * advantage), element by element."""
    return -torch.min(ratio * advantage, torch.clamp(ratio, 1 - low, 1 + high) * advantage)


def token_level(logps: torch.Tensor, old: torch.Tensor, ref: Optional[torch.Tensor], advantage: torch.Tensor,
                low: float, high: float, beta: float, mask: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Per token (TRL's ``GRPOTrainer._compute_loss``): the clipped surrogate loss of its ratio and its row's
    ``advantage``, plus ``beta`` times the KL estimate against the reference (``ref``; None: no KL); and the ratio
    and the KL estimate. The estimate is k3, times the ratio as TRL 1.16 takes it by default
    (``use_bias_correction_kl``: the unbiased reverse-KL gradient, DeepSeek-V3.2).

    With ``mask`` (the trained tokens), the ratio is the sequence's instead (GSPO, TRL's
    ``importance_sampling_level="sequence"``): exp of the mean log-ratio over the row's trained tokens, one (rows x
    1) ratio that every token of the row shares, clipped as one."""
    log_ratio = logps - old
    if mask is not None:
        log_ratio = ((log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).unsqueeze(1)
    ratio = torch.exp(log_ratio)
    loss = clipped_surrogate(ratio, advantage.unsqueeze(1), low, high)
    kl = None
    if ref is not None:
        kl = (torch.exp(ref - logps) - (ref - logps) - 1) * ratio
        loss = loss + beta * kl
    return loss, ratio, kl


def sequence_level(logps: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, advantage: torch.Tensor,
                   low: float, high: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per sequence (TRL's ``RLOOTrainer._compute_loss``): the clipped surrogate loss of the ratio of its whole
    completion (the log-probabilities summed over its trained tokens, ``mask``), and that ratio."""
    ratio = torch.exp((logps * mask).sum(dim=1) - (old * mask).sum(dim=1))
    return clipped_surrogate(ratio, advantage, low, high), ratio


def clipped_counts(ratio: torch.Tensor, advantage: torch.Tensor, low: float, high: float,
                   mask: torch.Tensor) -> torch.Tensor:
    """How many of the counted (``mask``) ratios are clipped below, above, either (where the clip bites: TRL's
    is_low_clipped, is_high_clipped), as a tensor of three sums."""
    low_clipped = ((ratio < 1 - low) & (advantage < 0)).float() * mask
    high_clipped = ((ratio > 1 + high) & (advantage > 0)).float() * mask
    return torch.stack([low_clipped.sum(), high_clipped.sum(), (low_clipped + high_clipped).clamp(max=1).sum()])

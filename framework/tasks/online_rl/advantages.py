"""From rewards to advantages, as TRL computes them. A step's completions come in groups of ``num_generations``
consecutive ones, a prompt's; a reward is NaN where no reward function scored the completion (left out of every
mean, its advantage 0)."""

from __future__ import annotations

from typing import Optional

import torch

STD_EPSILON = 1e-4  # TRL's: advantages are divided by std + 1e-4


def nanstd(values: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (NaN with fewer than 2 values): TRL's."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim)
    count = (~torch.isnan(values)).sum(dim=dim)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=values.dtype))
    return torch.sqrt(variance * correction)


def group_relative(rewards: torch.Tensor, group: int, scale: str, step_std: torch.Tensor) -> torch.Tensor:
    """GRPO's advantages (TRL's ``GRPOTrainer``): each reward minus its group's mean, over (std + 1e-4) of the group
    (``scale`` group), of the whole step (batch: ``step_std``) or not divided (none)."""
    grouped = rewards.view(-1, group)
    centred = rewards - torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "group":
        centred = centred / (nanstd(grouped, dim=1).repeat_interleave(group) + STD_EPSILON)
    elif scale == "batch":
        centred = centred / (step_std + STD_EPSILON)
    return torch.nan_to_num(centred, nan=0.0)


def leave_one_out(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """RLOO's advantages (TRL's ``RLOOTrainer``): each reward minus the mean of its group's other scored rewards
    (NaN where it is unscored, or the only one scored: made 0 by the caller, after any normalisation)."""
    grouped = rewards.view(-1, group)
    scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    others = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)
    return rewards - others.view(-1)


def normalised(advantages: torch.Tensor, every: torch.Tensor) -> torch.Tensor:
    """``advantages`` minus the mean of ``every`` advantage of the step (all processes), over their std + 1e-4."""
    return (advantages - torch.nanmean(every)) / (nanstd(every) + STD_EPSILON)

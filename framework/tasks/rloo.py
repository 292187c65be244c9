"""RLOO (REINFORCE Leave-One-Out; Ahmadian et al. 2024), as TRL 1.16's ``RLOOTrainer`` computes it, on the online-RL
package (framework/tasks/online_rl/: the prompts, sampling, rewards and the step every algorithm shares).

Recipe keys: online RL's (framework/tasks/online_rl/task.py) in the ``rloo`` section (``RlooConfig``), with TRL's
defaults (``num_generations`` 2, ``beta`` 0.05) and its own ``normalize_advantages``.

- Rewards: the weighted rewards minus ``beta`` times each completion's KL against the reference, summed over its
  tokens with the first-order estimate (log-probability at sampling minus the reference's): a penalty in the reward,
  where GRPO adds its k3 estimate to the loss.
- Advantages: each reward minus the mean of its group's other scored rewards (the leave-one-out baseline);
  with ``normalize_advantages``, minus the step's mean over its std + 1e-4 (all processes); 0 where unscored.
- Loss: the clipped surrogate of each completion's sequence-level ratio (its log-probabilities summed over its
  tokens, now and at sampling), averaged over the generation's completions.

Metrics beside online RL's (TRL's names): ``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean`` (of the
completions), ``entropy`` (per completion token) and ``kl`` (per completion token, the first-order estimate) with a
reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch

from framework.losses import IGNORE
from framework.tasks.base import register
from framework.tasks.online_rl import advantages, policy_loss
from framework.tasks.online_rl.task import OnlineConfig, OnlineRL


@dataclass
class RlooConfig(OnlineConfig):
    """REINFORCE Leave-One-Out (``task: rloo``): how completions are sampled, scored and learnt from."""

    num_generations: int = field(default=2, metadata={"ge": 2})
    """Completions sampled per prompt (a group: each completion's baseline is the mean of the others' rewards)."""
    beta: float = field(default=0.05, metadata={"ge": 0.0})
    """Weight of the KL penalty against the reference model, subtracted from each completion's reward (0: no
    reference is kept)."""
    normalize_advantages: bool = False
    """Normalise the advantages over the step (all processes) to mean 0 and standard deviation 1."""


class Rloo:
    """RLOO's advantages and sequence-level policy loss (framework/tasks/online_rl/step.py's ``Algorithm``)."""

    std_scope = "group"

    def __init__(self, g: RlooConfig):
        self.g = g
        self.high = g.epsilon if g.epsilon_high is None else g.epsilon_high
        self.needs_old_logps = g.beta > 0  # the KL penalty in the rewards is of the log-probabilities at sampling

    def advantages(self, rewards, every, rollouts, gather):
        figures = {}
        if self.g.beta > 0:
            masks = [(r["targets"] != IGNORE).float() for r in rollouts]
            kl = torch.cat([((r["old"] - r["ref"]) * m).sum(dim=1) for r, m in zip(rollouts, masks)]).cpu()
            tokens = torch.cat([m.sum(dim=1) for m in masks]).cpu()
            rewards = rewards - self.g.beta * kl
            totals = gather(torch.stack([kl, tokens], dim=1)).sum(dim=0)
            figures["kl"] = (totals[0] / totals[1].clamp(min=1)).item()
        advantage = advantages.leave_one_out(rewards, self.g.num_generations)
        if self.g.normalize_advantages:
            advantage = advantages.normalised(advantage, gather(advantage))
        return torch.nan_to_num(advantage, nan=0.0), figures

    def normaliser(self, mask: torch.Tensor):
        return mask.shape[0]  # completions

    def loss(self, logps, entropy, rollout):
        mask = (rollout["targets"] != IGNORE).float()
        a = rollout["advantages"]
        per_sequence, ratio = policy_loss.sequence_level(logps, rollout.get("old", logps.detach()), mask, a,
                                                         self.g.epsilon, self.high)
        clipped = policy_loss.clipped_counts(ratio.detach(), a, self.g.epsilon, self.high, torch.ones_like(a))
        sums = torch.cat([clipped, torch.stack([a.new_tensor(float(a.shape[0])), (entropy * mask).sum(), mask.sum()])])
        return per_sequence.sum(), sums

    def metrics(self, sums: List[float]) -> Dict[str, float]:
        low, high, region, sequences, entropy_sum, tokens = sums
        sequences = max(sequences, 1)
        return {"clip_ratio/low_mean": low / sequences, "clip_ratio/high_mean": high / sequences,
                "clip_ratio/region_mean": region / sequences, "entropy": entropy_sum / max(tokens, 1)}


@register("rloo")
class RLOO(OnlineRL):
    options = ("rloo", RlooConfig)
    reads = ("model.config_overrides", "data.max_length", "data.chat_template", "eval.harness", "rloo")

    def algorithm(self, cfg) -> Rloo:
        return Rloo(cfg.rloo)

"""Online RL with verifiable rewards: GRPO and its variants (DAPO, Dr. GRPO, BNPO), on the online-RL package
(framework/tasks/online_rl/: the prompts, sampling, rewards and the step every algorithm shares).

Recipe keys: online RL's (framework/tasks/online_rl/task.py) in the ``grpo`` section (``GrpoConfig``), with its
own ``loss`` and ``scale_rewards``.

Advantages are group-relative (each reward minus its group's mean, over the group's or the step's std). The loss is
TRL 1.16's ``GRPOTrainer._compute_loss`` (``loss_type`` dapo, grpo, dr_grpo, bnpo; token-level importance sampling
or GSPO's sequence-level, two-sided clipping with ``epsilon``/``epsilon_high``, the k3 KL estimate against the
reference with weight ``beta``, times the ratio as TRL's default ``use_bias_correction_kl``). Its normaliser, counted
over the whole generation:
dapo the completion tokens, grpo the completions (each a token mean), dr_grpo the completions times
``max_completion_length``. bnpo is by definition the mean over micro-batches of each micro-batch's token mean (TRL:
"normalization is performed over the local batch only"): it alone depends on the split; dapo is its split-free
form.

Metrics beside online RL's (TRL's names): ``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean`` (of the trained
completion tokens), ``entropy`` (the mean over them of the entropy of the distribution they were sampled from, the
logits over the temperature, read in the update's forward) and ``kl`` with a reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Literal

import torch

from framework.losses import IGNORE
from framework.tasks.base import register
from framework.tasks.online_rl import advantages, policy_loss
from framework.tasks.online_rl.advantages import nanstd
from framework.tasks.online_rl.task import OnlineConfig, OnlineRL


@dataclass
class GrpoConfig(OnlineConfig):
    """Online RL with verifiable rewards (``task: grpo``): how completions are sampled, scored and learnt from."""

    loss: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo"
    """How token losses are averaged (TRL's loss_type): dapo, over the step's completion tokens; grpo, a token mean
    per completion, then over completions; dr_grpo, the token sum over completions x max_completion_length; bnpo,
    each micro-batch's token mean, averaged over micro-batches (the one that depends on the split)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """The importance ratio clipped and weighting the advantage: each token's (GRPO), or one per completion, exp of
    its tokens' mean log-ratio (GSPO, TRL's importance_sampling_level=sequence; the GSPO paper pairs it with
    loss=grpo, whose token mean per completion makes it the per-sequence objective)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantages are rewards minus their group's mean, divided by (std + 1e-4): the group's std, the whole step's
    (all processes), or not divided."""


class Grpo:
    """GRPO's advantages and token-level policy loss (framework/tasks/online_rl/step.py's ``Algorithm``)."""

    needs_old_logps = False

    def __init__(self, g: GrpoConfig):
        self.g = g
        self.high = g.epsilon if g.epsilon_high is None else g.epsilon_high
        self.std_scope = "batch" if g.scale_rewards == "batch" else "group"

    def advantages(self, rewards, every, rollouts, gather):
        return advantages.group_relative(rewards, self.g.num_generations, self.g.scale_rewards, nanstd(every)), {}

    def normaliser(self, mask: torch.Tensor):
        """Completion tokens (dapo), completions (grpo, dr_grpo) or one micro-batch (bnpo)."""
        if self.g.loss == "dapo":
            return mask.sum()
        return 1 if self.g.loss == "bnpo" else mask.shape[0]

    def loss(self, logps, entropy, rollout):
        g, mask = self.g, (rollout["targets"] != IGNORE).float()
        sequence = mask if g.importance_sampling_level == "sequence" else None
        per_token, ratio, kl = policy_loss.token_level(logps, rollout.get("old", logps.detach()), rollout.get("ref"),
                                                       rollout["advantages"], g.epsilon, self.high, g.beta, sequence)
        clipped = policy_loss.clipped_counts(ratio.detach(), rollout["advantages"].unsqueeze(1), g.epsilon, self.high,
                                             mask)
        kl_sum = (kl.detach() * mask).sum() if kl is not None else mask.new_zeros(())
        sums = torch.cat([clipped, torch.stack([kl_sum, mask.sum(), (entropy * mask).sum()])])
        return self._aggregate(per_token * mask, mask), sums

    def _aggregate(self, masked: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the step's loss before the division by the step's normaliser."""
        if self.g.loss == "grpo":
            return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum()
        if self.g.loss == "bnpo":
            return masked.sum() / mask.sum().clamp(min=1)
        if self.g.loss == "dr_grpo":
            return masked.sum() / self.g.max_completion_length
        return masked.sum()  # dapo

    def metrics(self, sums: List[float]) -> Dict[str, float]:
        low, high, region, kl_sum, tokens, entropy_sum = sums
        tokens = max(tokens, 1)
        figures = {"clip_ratio/low_mean": low / tokens, "clip_ratio/high_mean": high / tokens,
                   "clip_ratio/region_mean": region / tokens, "entropy": entropy_sum / tokens}
        if self.g.beta > 0:
            figures["kl"] = kl_sum / tokens
        return figures


@register("grpo")
class GRPO(OnlineRL):
    options = ("grpo", GrpoConfig)
    reads = ("model.config_overrides", "data.max_length", "data.chat_template", "eval.harness", "grpo")

    def algorithm(self, cfg) -> Grpo:
        return Grpo(cfg.grpo)

"""DAPO's dynamic sampling (``OnlineConfig.dynamic_sampling``): a group whose completions all got the same reward
teaches nothing (each advantage is zero), so its prompt is replaced by another, drawn from the training set, and
sampled again, round after round, until the group's rewards differ or ``dynamic_sampling`` rounds ran (a group
still flat then is trained on as it is).

Each group's place in the step (a slot: its prompt's epoch and key) goes its own way: the prompt that replaces it in
round r and its completions' sampling seeds are keyed by (the run's seed, the epoch, the key, r), so what a slot
ends with depends neither on the process holding it nor on the process count or the accumulation. The processes
agree whether another round runs (a flat group anywhere); a process with none samples its first group again and
drops it, so that the collectives of sharded generation and of the reward functions meet. The replacements are drawn
beside the data order, not from it: the epoch's order and a resume's position are as without them. On XLA (fixed
shapes) every round samples as many groups as the step did, the groups not replaced drawing their own replacements,
which are dropped: the round generates in the step's compiled graphs instead of a new shape per count.

The anchors: verl's ``algorithm.filter_groups`` (DAPO's reference code) fills the batch with the next prompts of the
data order instead, on its one controller; TRL has none (its issue #3708)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Dict, List, Tuple

import datasets
import numpy as np
import torch

from framework import backend
from framework.tasks.online_rl import sampling
from framework.tasks.online_rl.advantages import nanstd
from framework.tasks.online_rl.multi_turn import Rollouts
from framework.tasks.online_rl.rollout import PROMPT_IDS, PromptCollator

if TYPE_CHECKING:
    from framework.tasks.online_rl.task import OnlineRun


def flat_groups(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Per group of ``group`` consecutive completions: whether their weighted rewards are all equal (the std that
    TRL's frac_reward_zero_std finds zero)."""
    std = nanstd(rewards.view(-1, group), dim=1)
    return torch.isclose(std, torch.zeros_like(std))


def replacement(seed: int, epoch: int, key: int, round_: int, rows: int) -> int:
    """The training row that replaces the group of prompt ``key`` in ``round_`` of ``epoch``."""
    return int(np.random.default_rng(sampling.row_seed(seed, epoch, key, round_)).integers(rows))


def resample(run: OnlineRun, model: torch.nn.Module, accelerator, pool: datasets.Dataset, batches: List[Dict],
             out: Rollouts, rows: List[Dict], per_function: torch.Tensor
             ) -> Tuple[Rollouts, List[Dict], torch.Tensor, torch.Tensor]:
    """The step's rollouts (``out``), their rows and rewards with each flat group replaced (module docstring), and
    per group of this process how many times it was replaced. ``pool``: the prepared training rows."""
    group, rounds = run.settings.num_generations, run.settings.dynamic_sampling
    slots = [(batch["epoch"], key) for batch in batches for key in batch["index"]]
    flat = flat_groups(run.rewards.total(per_function), group)
    replaced = torch.zeros(len(slots))
    for round_ in range(1, rounds + 1):
        pending = flat.nonzero().flatten().tolist()
        if not backend.any_process(accelerator, bool(pending))[0]:  # one process: no device value (on XLA a graph)
            break
        drawn = pending or [0]  # nothing flat here: the first group again, dropped, so the collectives meet
        if run.static_generation:  # XLA: as many groups as the step sampled, in the graphs it compiled
            drawn = drawn + [s for s in range(len(slots)) if s not in drawn]  # their own replacements, dropped
        features = [pool[replacement(run.seed, *slots[s], round_, len(pool))] for s in drawn]
        prompts = [f[PROMPT_IDS] for f in features for _ in range(group)]
        # Five numbers: apart from every ordinary draw's four (rollout.generation_batch).
        seeds = [sampling.row_seed(run.seed, *slots[s], j, round_) for s in drawn for j in range(group)]
        new_rows = [PromptCollator.columns(f) for f in features for _ in range(group)]
        new, new_rows = run.rollouts(model, prompts, seeds, new_rows)
        scores = run.rewards.score_together(new_rows, new.completions, new.messages)
        new_flat = flat_groups(run.rewards.total(scores), group)
        places = [(slice(s * group, (s + 1) * group), slice(i * group, (i + 1) * group))
                  for i, s in enumerate(pending)]
        out = _spliced(out, new, places)
        for here, there in places:
            rows[here], per_function[here] = new_rows[there], scores[there]
        flat[pending], replaced[pending] = new_flat[:len(pending)], replaced[pending] + 1
    return out, rows, per_function, replaced


def _spliced(out: Rollouts, new: Rollouts, places: List[Tuple[slice, slice]]) -> Rollouts:
    """``out`` with, for each (here, there) of ``places``, its rows ``here`` those of ``new`` at ``there`` (every
    per-row field it has), each field copied once."""
    changed = {}
    for f in fields(Rollouts):
        mine, theirs = getattr(out, f.name), getattr(new, f.name)
        if mine:  # a field the rollouts fill (calls and messages only with tools)
            mine = list(mine)
            for here, there in places:
                mine[here] = theirs[there]
            changed[f.name] = mine
    return replace(out, **changed)


def metrics(replaced: torch.Tensor) -> Dict[str, float]:
    """The step's figures from how many times each of its groups (every process's) was replaced: the replacements,
    the rounds run (a group replaced in the last round was in every round before) and the share of groups that were
    flat as first sampled."""
    return {"dynamic_sampling/replacements": float(replaced.sum()), "dynamic_sampling/rounds": float(replaced.max()),
            "dynamic_sampling/flat_first": float((replaced > 0).float().mean())}

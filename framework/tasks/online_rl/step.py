"""The step every online-RL algorithm runs (``OnlineStep``), given the algorithm's advantages and policy loss
(``Algorithm``): generate, score, advantages, then ``iterations`` x ``generation_steps`` updates on the same
rollouts.

Each step takes its prompts (``train.batch_size`` per micro-batch, so the plan's samples are prompts) and samples
``num_generations`` completions of each (framework/tasks/online_rl/rollout.py keys them), scores them (with
``dynamic_sampling``, replacing groups whose rewards are all equal: framework/tasks/online_rl/dynamic_sampling.py),
turns the rewards into advantages and updates ``iterations`` times on those rollouts, each micro-batch holding its
prompts' completions; with ``generation_steps`` above 1 each of those passes is that many optimizer steps, each on
an equal share of the micro-batches (one generation feeding several optimizer steps, TRL's
``steps_per_generation``).

The loss's normaliser (the algorithm's count per micro-batch: completion tokens, or completions) is counted over
the whole generation (every micro-batch and process) before the backward pass, as the supervised step does, and
each optimizer step divides by its share (the generation's over ``generation_steps``, as TRL's), so splitting the
same step over more processes or micro-batches gives the same gradient.

Old log-probabilities (the ratio's denominator) are recorded before the first update by a forward pass of the
training model itself, without gradients, on the same micro-batches (so they equal the first update's within
rounding), where a later update needs them (``iterations`` or ``generation_steps`` above 1) or the algorithm's
advantages do; otherwise the ratio is exactly 1, as in TRL, which then skips that pass. The reference's
(``beta`` > 0) are recorded in the same pass.

Metrics follow TRL's names: ``reward``, ``reward_std``, ``rewards/NAME/mean`` and ``/std``, ``frac_reward_zero_std``,
``completions/mean_length`` (``min_``, ``max_``), ``completions/clipped_ratio`` (no stop token within
``max_completion_length``), and the algorithm's own (clipping, entropy, KL); each over the whole step (all
processes), then averaged over the log window. Each training record also holds ``examples``: the logged step's
first prompt and a few of its sampled completions, as text, with their rewards and advantages (TRL's
``log_completions``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Protocol, Tuple

import torch

from framework import backend
from framework.losses import IGNORE
from framework.step import Count, StepContext, StepResult
from framework.tasks.online_rl import dynamic_sampling
from framework.tasks.online_rl.advantages import nanstd
from framework.tasks.online_rl.multi_turn import tool_frequencies
from framework.tasks.online_rl.rollout import generation_batch, rollout_batch

if TYPE_CHECKING:
    from framework.tasks.online_rl.task import OnlineConfig, OnlineRun

Rollout = Dict[str, torch.Tensor]


class Algorithm(Protocol):
    """What an online-RL algorithm brings to the step."""

    needs_old_logps: bool  # its advantages read the log-probabilities at sampling (``old``) of every rollout
    std_scope: str  # "group" or "batch": the std that frac_reward_zero_std finds zero

    def advantages(self, rewards: torch.Tensor, every: torch.Tensor, rollouts: List[Rollout],
                   gather: Callable[[torch.Tensor], torch.Tensor]) -> Tuple[torch.Tensor, Dict[str, float]]:
        """(each of this process's completions' advantage, the metrics computing them gives) from their weighted
        rewards (``rewards``; ``every``: all processes'), the rollouts (with ``old`` and ``ref`` where recorded) and
        ``gather`` (a tensor per completion of this process -> every process's, each once)."""

    def normaliser(self, mask: torch.Tensor) -> Count:
        """What a micro-batch (``mask``: its trained completion tokens) adds to the generation's normaliser."""

    def loss(self, logps: torch.Tensor, entropy: torch.Tensor, rollout: Rollout) -> Tuple[torch.Tensor, torch.Tensor]:
        """(a micro-batch's loss sum, before the division by the normaliser; the sums its metrics are made of) from
        the log-probabilities and entropies of its tokens now."""

    def metrics(self, sums: List[float]) -> Dict[str, float]:
        """The update's metrics from its sums over every micro-batch, pass and process."""


class OnlineStep:
    """One step of an online-RL algorithm (module docstring)."""

    def __init__(self, cfg, settings: OnlineConfig, algorithm: Algorithm):
        self.settings, self.algorithm = settings, algorithm
        self.updates = settings.iterations * settings.generation_steps
        self.micro_batches_per_update = cfg.train.gradient_accumulation_steps // settings.generation_steps

    def __call__(self, ctx: StepContext, batches: List[Dict]) -> StepResult:
        run: OnlineRun = ctx.task
        acc, g, algorithm = ctx.accelerator, self.settings, self.algorithm
        group = g.num_generations
        prompts, seeds = generation_batch(batches, group, run.seed)
        rows = [row for batch in batches for row in batch["rows"] for _ in range(group)]
        with backend.generating(acc, ctx.model, ctx.mesh, run.static_generation, run.gathers_weights) as model:
            out, rows = run.rollouts(model, prompts, seeds, rows)
            per_function = run.rewards.score_together(rows, out.completions, out.messages)
            if g.dynamic_sampling:
                out, rows, per_function, replaced = dynamic_sampling.resample(run, model, acc, ctx.examples, batches,
                                                                              out, rows, per_function)
        prompts, completions = out.prompts, out.completions
        stops = set(run.sampling.stop_ids)
        truncated = torch.tensor([not c or c[-1] not in stops for c in completions])
        # The model's tokens (TRL's with tools: a tool turn's are not the completion's length).
        lengths = torch.tensor([sum(s) for s in out.sampled], dtype=torch.float32)
        gather = _gatherer(acc)
        # Every process's rewards and lengths: the step-wide statistics and the metrics.
        everything = gather(torch.cat([per_function, lengths[:, None], truncated[:, None].float()], 1))
        rewards = run.rewards.total(per_function)
        every_reward = run.rewards.total(everything[:, :len(run.rewards.functions)])

        trained = [not (g.mask_truncated_completions and t) for t in truncated.tolist()]
        rollouts, start = [], 0
        for batch in batches:
            end = start + len(batch["prompt_ids"]) * group
            rollouts.append(ctx.mesh.shard_batch(rollout_batch(
                prompts[start:end], completions[start:end], trained[start:end], run.sampling.pad_id, acc.device,
                run.buckets, out.sampled[start:end])))
            start = end
        with torch.no_grad():
            for r in rollouts:
                if g.iterations > 1 or g.generation_steps > 1 or algorithm.needs_old_logps:
                    r["old"] = run.logprobs(ctx.model, r)  # the ratio's denominator, before any update
                if g.beta > 0:
                    r["ref"] = run.reference_logprobs(ctx.model, r)
        backend.run_pending(acc)  # XLA: those passes as a graph of their own, before advantages may read them
        advantage, metrics = algorithm.advantages(rewards, every_reward, rollouts, gather)
        start = 0
        for r in rollouts:
            r["advantages"] = advantage[start:start + r["input_ids"].shape[0]].to(acc.device)
            ctx.mesh.shard_batch(r)
            start += r["input_ids"].shape[0]
        metrics.update(reward_metrics(everything, every_reward, run, algorithm.std_scope))
        if g.dynamic_sampling:
            metrics.update(dynamic_sampling.metrics(gather(replaced[:, None])[:, 0]))
        if run.tool_loop is not None:
            counts = gather(torch.tensor([out.calls, out.failures], dtype=torch.float32).T)
            metrics.update(tool_frequencies(counts[:, 0].numpy(), counts[:, 1].numpy()))

        counts = [algorithm.normaliser(r["targets"] != IGNORE) for r in rollouts]
        total = backend.total_over_processes(acc, sum(counts))
        total = total.clamp(min=1) if isinstance(total, torch.Tensor) else max(total, 1)
        # Each optimizer step divides by its share of the generation's normaliser (TRL's dapo: the generation's
        # tokens over its steps). As the supervised step's scale: accelerate divides by the micro-batches of an
        # update and DDP averages over processes.
        scale = acc.num_processes * (len(rollouts) // g.generation_steps) / (total / g.generation_steps)
        sums, loss = 0, 0
        for _ in range(g.iterations):
            for r in rollouts:
                def loss_of(model, r=r):
                    nonlocal sums
                    logps, entropy = run.logprobs(model, r, with_entropy=True)
                    loss_sum, update_sums = algorithm.loss(logps, entropy, r)
                    sums = sums + update_sums
                    return loss_sum

                loss = loss + ctx.update.micro_batch(loss_of, scale)
        reduced = acc.reduce(sums, reduction="sum") if acc.num_processes > 1 else sums
        # XLA: the updates run as the step's graph first, then their sums are read (backend.to_host).
        metrics.update(algorithm.metrics(backend.to_host(acc, [reduced])[0].tolist()))
        # Tokens: every update's forward and backward (the FLOPs counted); generation and the no-grad forwards are
        # not model FLOPs of training. Micro-steps: the step's micro-batches once (the loop counts its samples by
        # them), however many times each is updated on.
        row_lengths = torch.cat([r["attention_mask"].sum(dim=1) for r in rollouts])
        examples = run.examples(prompts, completions, per_function, advantage) if acc.is_main_process else []
        return StepResult(loss, sum(counts) * g.iterations, row_lengths.sum() * g.iterations,
                          (row_lengths * row_lengths).sum() * g.iterations, len(rollouts), metrics, examples)


def _gatherer(acc) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor per completion of this process -> every process's, on the host, each row once: the processes of a
    tensor-parallel group (consecutive) hold the same rows, so one copy of each is kept."""
    tp = backend.tensor_parallel_size(acc)

    def gather(values: torch.Tensor) -> torch.Tensor:
        if acc.num_processes == 1:  # one process (XLA SPMD's too) holds every row already
            return values
        every = acc.gather(values.to(acc.device)).cpu()
        if tp > 1:
            every = every.view(acc.num_processes, -1, *every.shape[1:])[::tp].flatten(0, 1)
        return every

    return gather


def reward_metrics(everything: torch.Tensor, total: torch.Tensor, run: OnlineRun, std_scope: str) -> Dict[str, float]:
    """TRL's reward and completion figures over every completion of the step (all processes): ``everything`` is
    their rewards per function, lengths and truncation flags; ``total`` their weighted rewards; ``std_scope``: the
    std frac_reward_zero_std counts (a group's, or the step's)."""
    functions, group = len(run.rewards.functions), run.settings.num_generations
    # Per completion, whether the std of its group (or of the whole step) is zero: dynamic sampling's flat groups.
    flat = dynamic_sampling.flat_groups(total, group if std_scope == "group" else len(total))
    flat = flat.repeat_interleave(group) if std_scope == "group" else flat.expand_as(total)
    lengths = everything[:, functions]
    figures = {"reward": torch.nanmean(total).item(), "reward_std": nanstd(total).item(),
               "frac_reward_zero_std": flat.float().mean().item(),
               "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
               "completions/max_length": lengths.max().item(),
               "completions/clipped_ratio": everything[:, functions + 1].mean().item()}
    for i, function in enumerate(run.rewards.functions):
        figures[f"rewards/{function.name}/mean"] = torch.nanmean(everything[:, i]).item()
        figures[f"rewards/{function.name}/std"] = nanstd(everything[:, i]).item()
    return figures

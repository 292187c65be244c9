"""Online reinforcement learning with verifiable rewards: GRPO and its variants (DAPO, Dr. GRPO, BNPO).

Recipe keys: the language-model keys (``model.name_or_path``, or ``model.config`` + ``model.tokenizer``),
``data.chat_template``, ``data.max_length`` (the longest prompt, in tokens: a longer one keeps its last tokens,
where its question and generation prompt are) and the ``grpo`` section (``GrpoConfig``).

Rows hold a prompt (``grpo.prompt_column``: a string, tokenized as TRL does, or a conversation, rendered with the
chat template and its generation prompt) and any other columns, which go to the reward functions by name
(framework/rewards.py). Each optimizer step (:class:`GrpoStep`) takes its prompts (``train.batch_size`` per
micro-batch, so the plan's samples are prompts), samples ``grpo.num_generations`` completions of each
(framework/sampling.py: keyed by (seed, epoch, the prompt's index in the dataset, the completion's number), so
the process count and the accumulation do not change what is drawn), scores them, turns the rewards into
advantages and updates ``grpo.iterations`` times on those rollouts, each micro-batch holding its prompts'
completions; with ``grpo.generation_steps`` above 1 each of those passes is that many optimizer steps, each on an
equal share of the micro-batches (one generation feeding several optimizer steps, TRL's ``steps_per_generation``). Evaluation (and the end-of-run sample) decodes greedily, one completion per held-out prompt, and
reports their mean reward.

The epoch stands in the sampling key where the step could: within an epoch each prompt index comes at most once,
so (epoch, index) names one draw as (step, index) would, and the collator knows the epoch (the loop sets it,
on a resume too) where nothing in a step knows the step's number. A mix of sources (``data.sources``) that
repeats a row within an epoch draws the same completions for its repeats. Streamed prompts (``data.streaming``)
have no index independent of the process count: a hash of the row's columns stands in for it (``row_key``), with
the epoch each process counts.

The loss is TRL 1.16's ``GRPOTrainer._compute_loss`` (``loss_type`` dapo, grpo, dr_grpo, bnpo; token-level
importance sampling, two-sided clipping with ``epsilon``/``epsilon_high``, the k3 KL estimate against the
reference with weight ``beta``, times the ratio as TRL's default ``use_bias_correction_kl``), its
log-probabilities those of the logits over the temperature, as TRL takes them. Its normaliser is counted over the whole generation (every micro-batch and process) before the
backward pass, as the supervised step does, and each optimizer step divides by its share (the generation's over
``grpo.generation_steps``, as TRL's): dapo by the completion tokens, grpo by the completions (each a token mean),
dr_grpo by the completions times ``max_completion_length``, so splitting the same step over more processes or
micro-batches gives the same gradient. bnpo is by definition the mean over
micro-batches of each micro-batch's token mean (TRL: "normalization is performed over the local batch only"):
it alone depends on the split; dapo is its split-free form.

Old log-probabilities (the ratio's denominator) are recorded before the first update by a forward pass of the
training model itself, without gradients, on the same micro-batches (so they equal the first update's within
rounding); with ``grpo.iterations`` and ``grpo.generation_steps`` 1 the first update is the only one and the
ratio is exactly 1, as in TRL, which then skips that pass. Dropout is switched off: the log-probabilities at sampling, the reference's and the
training forward's must be of one function. The reference (``grpo.beta`` > 0) is DPO's: a frozen copy of the
starting weights, or the trained model with its adapter off under peft.

Under FSDP2 and DeepSpeed ZeRO-3 generation runs on the sharded model (framework/backend/generation.py): each
block gathers its weights in its forward, a collective, so the processes, each on its own prompts, generate in
lockstep (``synced``) until the last one's completions stop. The frozen-copy reference is refused there.

Metrics follow TRL's names: ``reward``, ``reward_std``, ``rewards/NAME/mean`` and ``/std``,
``frac_reward_zero_std``, ``completions/mean_length`` (``min_``, ``max_``), ``completions/clipped_ratio`` (no stop
token within ``max_completion_length``), ``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean``, ``entropy`` (the
mean over trained completion tokens of the entropy of the distribution they were sampled from, the logits over the
temperature, read in the update's forward) and ``kl`` with a reference; each over the whole step (all processes),
then averaged over the log window. Each training record also holds ``examples``: the logged step's first prompt
and a few of its sampled completions, as text, with their rewards and advantages (TRL's ``log_completions``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, List, Literal, Optional

import datasets
import numpy as np
import torch
import torch.nn.functional as F

import framework.step
from framework import adapters, backend, chat, data, losses, rewards, sampling
from framework.errors import UserError
from framework.step import StepResult
from framework.tasks.base import register
from framework.tasks.causal_lm import CausalLM
from framework.tasks.completions import (ADAPTER_OFF, completion_tokenizer, evaluating, load_completion_model,
                                         reference_model)
from framework.tasks.language import IGNORE

# The prepared rows' own columns, beside the data's: the prompt's tokens (``input_ids``, as the framework's length
# ordering reads them) and the row's index in the dataset.
PROMPT_IDS, INDEX = "input_ids", "grpo_index"
STD_EPSILON = 1e-4  # TRL's: advantages are divided by std + 1e-4
EXAMPLES = 4  # completions of a step's first prompt its log record shows


@dataclass
class GrpoConfig:
    """Online RL with verifiable rewards (``task: grpo``): how completions are sampled, scored and learnt from."""

    reward_functions: List[str] = field(default_factory=list)
    """The rewards, summed with ``reward_weights``: built-in ``exact_match``, ``numeric`` (against
    ``answer_column``), ``regex`` (``grpo.regex``), or the user's ``path/to/file.py:function`` /
    ``package.module:function`` with TRL's signature f(prompts, completions, completion_ids, **columns) -> list
    of float or None (framework/rewards.py)."""
    reward_weights: Optional[List[float]] = None
    """One weight per reward function (default: 1 each)."""
    answer_column: str = "answer"
    """exact_match, numeric: the column holding each prompt's answer."""
    regex: Optional[str] = None
    """The regular expression the built-in ``regex`` reward wants the whole (stripped) completion to match."""
    prompt_column: str = "prompt"
    """The column holding the prompt (a string, or a conversation: a list of {role, content})."""
    num_generations: int = field(default=8, metadata={"ge": 2})
    """Completions sampled per prompt (a group: advantages compare a completion with its group's)."""
    max_completion_length: int = field(default=256, metadata={"ge": 1})
    """The longest completion, in tokens; one that has not stopped by then is truncated."""
    temperature: float = field(default=1.0, metadata={"gt": 0.0})
    """Sampling temperature; the loss's log-probabilities are those of the logits over it, as TRL's."""
    top_p: float = field(default=1.0, metadata={"gt": 0.0, "le": 1.0})
    """Nucleus sampling: keep the most likely tokens whose probabilities sum to top_p (1: all)."""
    top_k: int = field(default=0, metadata={"ge": 0})
    """Keep the k most likely tokens (0: all)."""
    loss: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo"
    """How token losses are averaged (TRL's loss_type): dapo, over the step's completion tokens; grpo, a token mean
    per completion, then over completions; dr_grpo, the token sum over completions x max_completion_length; bnpo,
    each micro-batch's token mean, averaged over micro-batches (the one that depends on the split)."""
    epsilon: float = field(default=0.2, metadata={"gt": 0.0})
    """The ratio's lower clip: 1 - epsilon."""
    epsilon_high: Optional[float] = field(default=None, metadata={"gt": 0.0})
    """The ratio's upper clip: 1 + epsilon_high (default: epsilon; DAPO uses 0.28)."""
    iterations: int = field(default=1, metadata={"ge": 1})
    """Updates on each step's rollouts (GRPO's mu; TRL's num_iterations): passes over the same completions, each
    ``generation_steps`` optimizer steps, and the learning-rate schedule advances with each (as TRL's)."""
    generation_steps: int = field(default=1, metadata={"ge": 1})
    """Optimizer steps each generation feeds: the step's prompts (``train.batch_size`` x
    ``train.gradient_accumulation_steps`` per process) are generated for at once, then learnt from in this many
    optimizer steps, each on an equal share of its micro-batches (it must divide the accumulation steps); the later
    shares are slightly off-policy, their ratio against the log-probabilities at sampling. TRL's
    ``steps_per_generation`` counts micro-batches: it is ``train.gradient_accumulation_steps`` here, and TRL's
    ``gradient_accumulation_steps`` that over this."""
    beta: float = field(default=0.0, metadata={"ge": 0.0})
    """Weight of the KL penalty against the reference model (0: no reference is kept)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantages are rewards minus their group's mean, divided by (std + 1e-4): the group's std, the whole step's
    (all processes), or not divided."""
    mask_truncated_completions: bool = False
    """Leave completions that did not stop within max_completion_length out of the loss (DAPO)."""


def nanstd(values: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (NaN with fewer than 2 values): TRL's."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim)
    count = (~torch.isnan(values)).sum(dim=dim)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=values.dtype))
    return torch.sqrt(variance * correction)


def weighted_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per completion, the weighted sum of its rewards over the functions that scored it (NaN where none did)."""
    total = (per_function * weights).nansum(dim=1)
    return torch.where(torch.isnan(per_function).all(dim=1), torch.nan, total)


def advantages(total: torch.Tensor, group: int, scale: str, step_std: torch.Tensor) -> torch.Tensor:
    """TRL's advantages from the completions' rewards (``total``, groups of ``group`` consecutive completions):
    minus the group mean, over (std + 1e-4) of the group or of the whole step (``step_std``), NaN made 0."""
    grouped = total.view(-1, group)
    centred = total - torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "group":
        centred = centred / (nanstd(grouped, dim=1).repeat_interleave(group) + STD_EPSILON)
    elif scale == "batch":
        centred = centred / (step_std + STD_EPSILON)
    return torch.nan_to_num(centred, nan=0.0)


def token_losses(logps: torch.Tensor, old: torch.Tensor, ref: Optional[torch.Tensor], advantage: torch.Tensor,
                 g: GrpoConfig):
    """Per token: the clipped surrogate loss plus beta times the KL estimate (TRL's ``_compute_loss``), the ratio
    and the KL estimate (None without a reference). The estimate is k3, times the ratio as TRL 1.16 takes it by
    default (``use_bias_correction_kl``: the unbiased reverse-KL gradient, DeepSeek-V3.2)."""
    ratio = torch.exp(logps - old)
    high = g.epsilon if g.epsilon_high is None else g.epsilon_high
    clipped = torch.clamp(ratio, 1 - g.epsilon, 1 + high)
    a = advantage.unsqueeze(1)
    loss = -torch.min(ratio * a, clipped * a)
    kl = None
    if ref is not None:
        kl = (torch.exp(ref - logps) - (ref - logps) - 1) * ratio
        loss = loss + g.beta * kl
    return loss, ratio, kl


def loss_sum(per_token: torch.Tensor, mask: torch.Tensor, g: GrpoConfig) -> torch.Tensor:
    """A micro-batch's share of the step's loss before the division by the step's normaliser (``normaliser``)."""
    masked = per_token * mask
    if g.loss == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum()
    if g.loss == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1)
    if g.loss == "dr_grpo":
        return masked.sum() / g.max_completion_length
    return masked.sum()  # dapo


def normaliser(mask: torch.Tensor, g: GrpoConfig):
    """What a micro-batch adds to the step's normaliser: completion tokens (dapo), completions (grpo, dr_grpo) or
    one micro-batch (bnpo)."""
    if g.loss == "dapo":
        return mask.sum()
    return 1 if g.loss == "bnpo" else mask.shape[0]


def share_normaliser(generation, g: GrpoConfig):
    """What each optimizer step's loss sum is divided by: its share of the generation's normaliser (summed over
    its micro-batches and processes), as TRL divides by the generation's over ``steps_per_generation``."""
    return generation / g.generation_steps


class _Tempered(torch.nn.Module):
    """The output head with its logits divided by the temperature (the chunked loss calls it chunk by chunk)."""

    def __init__(self, head: torch.nn.Module, temperature: float):
        super().__init__()
        self.head, self.temperature = head, temperature

    def forward(self, x):
        return self.head(x) / self.temperature


@register("grpo")
class GRPO(CausalLM):
    metric = "reward"
    options = ("grpo", GrpoConfig)
    keeps_other_columns = True
    reads = ("model.config_overrides", "data.max_length", "data.chat_template", "eval.harness", "grpo")

    def __init__(self):
        self.grpo: Optional[GrpoConfig] = None  # the run's settings and what it needs (for_run)
        self.rewards: List[rewards.RewardFunction] = []
        self.sampling: Optional[sampling.Sampling] = None
        self.run_tokenizer, self.reference, self.seed = None, None, 0
        self.autocast = self.unwrap = None
        self.synced = False  # generation in lockstep over the processes (for_run)

    # ------------------------------------------------------------ recipe keys, model

    def check(self, cfg) -> List[str]:
        problems = super().check(cfg)
        g = cfg.grpo
        if not g.reward_functions:
            problems.append("grpo.reward_functions: name at least one reward function (exact_match, numeric, regex, "
                            "path/to/file.py:function or package.module:function)")
        if g.reward_weights is not None and len(g.reward_weights) != len(g.reward_functions):
            problems.append(f"grpo.reward_weights: {len(g.reward_weights)} weights for {len(g.reward_functions)} "
                            "reward functions; give one per function")
        if "regex" in g.reward_functions:
            try:
                rewards.regex(g.regex or "")
            except Exception as e:
                problems.append(f"grpo.regex: {g.regex!r} is not a regular expression ({e})")
            if not g.regex:
                problems.append("grpo.regex: the regex reward function needs the expression completions must match")
        accumulation = cfg.train.gradient_accumulation_steps
        if accumulation % g.generation_steps:
            problems.append(f"grpo.generation_steps: {g.generation_steps} optimizer steps cannot share the "
                            f"generation's {accumulation} micro-batches (train.gradient_accumulation_steps) equally; "
                            "make it divide them")
        return problems

    def metric_names(self):
        return ("reward",)

    def columns(self, cfg) -> Dict[str, str]:
        g = cfg.grpo
        columns = {"grpo.prompt_column": g.prompt_column}
        if {"exact_match", "numeric"} & set(g.reward_functions):
            columns["grpo.answer_column"] = g.answer_column
        return columns

    def keep_row(self, cfg):
        """Every prompt must be text or a conversation: a bad one stops the run naming its row."""
        column = cfg.grpo.prompt_column

        def check(row) -> bool:
            prompt = row[column]
            where = f"grpo.prompt_column: the row {chat.snippet(row)}"
            if isinstance(prompt, list) or (isinstance(prompt, str) and prompt.strip()):
                chat.maybe_conversation(prompt, where)
                return True
            raise UserError(f"{where}: the prompt is {chat.snippet(prompt)}, not text nor a conversation (a list of "
                            "{role, content}); fix or remove the row")

        return check

    def load(self, cfg, train, evaluation):
        model, tokenizer = load_completion_model(self, cfg)
        stop = chat.end_of_turn_ids(tokenizer, cfg.data.chat_template)
        # model/ then answers in a pipeline("text-generation") up to where sampling stopped (training's sampling
        # sets the model's generation defaults aside: framework/sampling.py).
        model.generation_config.eos_token_id = stop if len(stop) > 1 else stop[0]
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        data.check_length("data.max_length + grpo.max_completion_length", self.sequence_length(cfg, model), tokenizer,
                          model)
        return model, tokenizer

    def sequence_length(self, cfg, model) -> int:
        return cfg.data.max_length + cfg.grpo.max_completion_length

    def workload(self, cfg, model):
        """As a language model's, and the step's generation: every completion of its micro-batches at once."""
        rows = cfg.train.batch_size * cfg.train.gradient_accumulation_steps * cfg.grpo.num_generations
        return dataclasses.replace(super().workload(cfg, model), generated_rows=rows,
                                   generated_length=self.sequence_length(cfg, model))

    def for_run(self, model, accelerator, cfg) -> "GRPO":
        """A copy holding the run's ``grpo`` keys, its reward functions (imported now: a missing one stops the run
        before training), the tokenizer (it decodes completions for the rewards; loaded again from the recipe as
        ``load`` made it), the stop and padding ids, and the reference where ``beta`` > 0. Dropout (peft's too) is
        switched off in the model."""
        if backend.needs_static_shapes(accelerator):
            raise UserError("task: grpo does not run on XLA yet (generation makes a new shape per token); use "
                            "backend=cpu or gpu")
        if cfg.grpo.beta > 0 and not adapters.is_adapted(model) and backend.shards_parameters(accelerator):
            raise UserError("grpo.beta: the reference model, a frozen copy, is not built under FSDP or DeepSpeed yet "
                            "(its weights load on the first process only); train an adapter (peft: the reference is "
                            "the adapter off), or set grpo.beta=0, or use distributed.strategy=ddp")
        for module in model.modules():  # TRL's disable_dropout: one function for sampling, reference and training
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        g = cfg.grpo
        task = super().for_run(model, accelerator, cfg)  # the chunked loss's settings, decided where every LM's are
        task.grpo, task.seed = g, cfg.seed
        task.rewards = rewards.load(g.reward_functions, g.answer_column, g.regex)
        tokenizer, _ = completion_tokenizer(self, cfg)
        task.run_tokenizer = tokenizer
        task.sampling = sampling.Sampling(g.temperature, g.top_k, g.top_p, g.max_completion_length,
                                          chat.end_of_turn_ids(tokenizer, cfg.data.chat_template),
                                          tokenizer.pad_token_id)
        task.reference = reference_model(model, accelerator) if g.beta > 0 else None
        task.autocast, task.unwrap, task.accelerator = accelerator.autocast, accelerator.unwrap_model, accelerator
        # FSDP2 and ZeRO-3 gather each block's weights in its forward, a collective: the processes, each on its own
        # prompts, generate in lockstep until the last one's completions stop.
        task.synced = (backend.is_fsdp2(accelerator) or backend.is_zero3(accelerator)) and accelerator.num_processes > 1
        task.sequences_per_example = g.num_generations
        return task

    def frozen_models(self) -> List[torch.nn.Module]:
        return [self.reference] if isinstance(self.reference, torch.nn.Module) else []

    def step(self, cfg):
        return GrpoStep()

    def updates_per_step(self, cfg) -> int:
        return cfg.grpo.iterations * cfg.grpo.generation_steps

    def micro_batches_per_update(self, cfg) -> int:
        return cfg.train.gradient_accumulation_steps // cfg.grpo.generation_steps

    # ------------------------------------------------------------ data

    def prepare(self, ds, tokenizer, model, cfg):
        """Rows -> their columns as they are, the prompt's token ids (the last ``data.max_length``) and the row's
        key in its sampling key: its index in the dataset, or in a stream (whose positions depend on the process
        count), a hash of the row's content."""
        column, length = cfg.grpo.prompt_column, cfg.data.max_length
        streamed = isinstance(ds, datasets.IterableDataset)

        def tokenize(batch, indices):
            out = dict(batch)
            out[PROMPT_IDS] = [prompt_ids(tokenizer, prompt, f"grpo.prompt_column: the prompt {chat.snippet(prompt)}")
                               [-length:] for prompt in batch[column]]
            out[INDEX] = [row_key({k: v[i] for k, v in batch.items()}) for i in range(len(indices))] if streamed \
                else indices
            return out

        identity = (data.tokenizer_identity(tokenizer), tokenizer.chat_template, column, length, PROMPT_IDS, INDEX)
        return data.map_rows(ds, tokenize, identity, "Tokenizing prompts", with_indices=True)

    def collator(self, tokenizer, cfg, buckets, rows=None):
        return PromptCollator()

    # ------------------------------------------------------------ rollouts

    def score(self, rows: List[Dict], completion_ids: List[List[int]]) -> torch.Tensor:
        """The rewards (completions x functions, float32, NaN where a function returned None) of each completion
        of the prompt in the same place of ``rows`` (the data's rows, as collated)."""
        column = self.grpo.prompt_column
        prompts = [chat.maybe_conversation(row[column], "grpo.prompt_column") or row[column] for row in rows]
        texts = self.run_tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                       for p, t in zip(prompts, texts)]
        # Streamed sources mixed may hold other columns: a row without one gives None (its functions may skip it).
        keys = dict.fromkeys(key for row in rows for key in row if key != column)
        columns = {key: [row.get(key) for row in rows] for key in keys}
        scores = [function(prompts, completions, completion_ids, columns) for function in self.rewards]
        return torch.tensor(np.stack(scores, axis=1), dtype=torch.float32)

    def score_together(self, rows: List[Dict], completion_ids: List[List[int]]) -> torch.Tensor:
        """``score`` on every process at once: where a reward function fails on any process, every process ends with
        that process's message (a UserError), instead of the others waiting for it in the next collective."""
        try:
            scores, message = self.score(rows, completion_ids), None
        except UserError as error:
            scores, message = None, str(error)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object  # not at import: the backend is chosen before accelerate loads

            messages = [m for m in gather_object([message]) if m]
            message = messages[0] if messages else None
        if message:
            raise UserError(message)
        return scores

    def examples(self, prompts: List[List[int]], completions: List[List[int]], per_function: torch.Tensor,
                 advantage: torch.Tensor) -> List[Dict[str, object]]:
        """The step's first prompt and up to ``EXAMPLES`` of its completions, as text, each with its reward (weighted,
        and per function: None where a function skipped it) and advantage: what the log shows of the step."""
        def number(value: float) -> Optional[float]:  # float32's 7 digits (JSON has no NaN)
            return None if np.isnan(value) else float(f"{value:.7g}")

        shown = min(self.grpo.num_generations, EXAMPLES)
        total = weighted_rewards(per_function[:shown], self.weights()).tolist()
        prompt = self.run_tokenizer.decode(prompts[0])
        return [{"prompt": prompt, "completion": self.run_tokenizer.decode(completions[j], skip_special_tokens=True),
                 "reward": number(total[j]),
                 "advantage": number(float(advantage[j])),
                 "rewards": {f.name: number(v) for f, v in zip(self.rewards, per_function[j].tolist())}}
                for j in range(shown)]

    def weights(self) -> torch.Tensor:
        w = self.grpo.reward_weights
        return torch.tensor(w if w is not None else [1.0] * len(self.rewards), dtype=torch.float32)

    def token_logprobs(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor], with_entropy: bool = False):
        """Per token, the log-probability of its target (the next token, where it is a completion token; 0
        elsewhere) under the model's logits over the temperature, through the chunked head where exact.
        ``with_entropy``: (log-probabilities, each completion token's entropy of that distribution, as TRL logs it;
        not differentiable)."""
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
        targets, temperature = batch["targets"], self.grpo.temperature
        head = losses.output_head(model) if self.loss_chunk else None
        if head is not None:
            hidden, called = losses.hidden_states(model, head, **inputs)
            if called:
                tempered = head if temperature == 1.0 else _Tempered(head, temperature)
                return losses.token_logprobs(hidden, tempered, targets, self.loss_chunk, self.select_targets,
                                             with_entropy)
            logits = hidden  # the model did not call its head module: these are its logits
        else:
            logits = model(**inputs).logits
        counted = targets != IGNORE
        logp = torch.log_softmax(logits[counted].float() / temperature, dim=-1)
        chosen = logp.gather(1, targets[counted].unsqueeze(1)).squeeze(1)
        out = torch.zeros(targets.shape, dtype=chosen.dtype, device=chosen.device).masked_scatter(counted, chosen)
        if not with_entropy:
            return out
        entropy = -(logp.detach().exp() * logp.detach()).sum(dim=-1)
        return out, torch.zeros_like(out).masked_scatter(counted, entropy)

    def reference_logprobs(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad(), self.autocast():
            if self.reference is ADAPTER_OFF:
                inner = self.unwrap(model)
                with inner.disable_adapter(), evaluating(inner):
                    return self.token_logprobs(inner, batch)
            return self.token_logprobs(self.reference, batch)

    # ------------------------------------------------------------ evaluation

    def eval_outputs(self, model, batch) -> Dict[str, torch.Tensor]:
        """Per held-out prompt: the rewards of its greedy completion, per function and weighted."""
        inner = backend.generation_ready(self.accelerator, self.unwrap(model))
        completions = sampling.generate(inner, batch["prompt_ids"], [], self.sampling, greedy=True, synced=self.synced)
        per_function = self.score_together(batch["rows"], completions)
        device = next(inner.parameters()).device
        return {"rewards": per_function.to(device), "reward": weighted_rewards(per_function, self.weights()).to(device)}

    def metrics(self, gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
        """The greedy completions' mean reward, overall and per function (over the prompts it scored)."""
        figures = {"reward": float(np.nanmean(gathered["reward"])), "prompts": int(len(gathered["reward"]))}
        for i, function in enumerate(self.rewards):
            figures[f"rewards/{function.name}"] = float(np.nanmean(gathered["rewards"][:, i]))
        return figures

    def sample(self, model, tokenizer, cfg, eval_ds) -> Optional[Dict[str, str]]:
        """The first held-out prompt, its greedy completion and that completion's reward."""
        if len(eval_ds) == 0:
            return None
        row = eval_ds[0]
        completion = sampling.generate(model, [row[PROMPT_IDS]], [], self.sampling, greedy=True)[0]
        reward = weighted_rewards(self.score([PromptCollator.columns(row)], [completion]), self.weights())
        return {"prompt": tokenizer.decode(row[PROMPT_IDS]), "generated": tokenizer.decode(completion),
                "reward": f"{float(reward[0]):.4g}"}


def row_key(row: Dict) -> int:
    """A streamed row's stand-in for its index: 63 bits of a hash of its columns, so that whichever process reads
    it, it draws the same completions (rows repeated within an epoch draw the same ones, as repeated sources')."""
    text = json.dumps(row, sort_keys=True, default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def prompt_ids(tokenizer, prompt, where: str) -> List[int]:
    """A prompt's token ids as TRL's GRPOTrainer makes them: a conversation rendered with the generation prompt,
    text tokenized with the tokenizer's special tokens."""
    conversation = chat.maybe_conversation(prompt, where)
    if conversation is not None:
        ids = chat.encode(tokenizer, chat.render(tokenizer, conversation, where, add_generation_prompt=True))[0]
    else:
        ids = tokenizer(prompt, verbose=False)["input_ids"]
    if not ids:
        raise UserError(f"{where}: has no tokens; fix or remove the row")
    return ids


class PromptCollator:
    """Prompts -> a batch: their token ids (unpadded: the step pads every completion of the step together), their
    indices in the dataset, the epoch (``set_epoch``; with the index, what keys the sampling) and the rows'
    other columns for the reward functions."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @staticmethod
    def columns(feature: Dict) -> Dict:
        return {k: v for k, v in feature.items() if k not in (PROMPT_IDS, INDEX)}

    def __call__(self, features: List[Dict]) -> Dict:
        return {"prompt_ids": [f[PROMPT_IDS] for f in features], "index": [f[INDEX] for f in features],
                "epoch": self.epoch, "rows": [self.columns(f) for f in features]}


def rollout_batch(prompts: List[List[int]], completions: List[List[int]], advantage: torch.Tensor,
                  trained: List[bool], pad_id: int, device) -> Dict[str, torch.Tensor]:
    """One micro-batch of rollouts: each prompt followed by its completion, right-padded (positions 0..n-1, as
    generation had them), the completion's tokens the targets (``trained``: False leaves a completion out of
    the loss) and each row's advantage."""
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    labels = torch.full((len(prompts), longest), IGNORE, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        attention_mask[i, :len(p) + len(c)] = 1
        if trained[i]:
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)  # the next token at each position
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
            "targets": targets.to(device), "advantages": advantage.to(device)}


def generation_batch(task: GRPO, batches: List[Dict]):
    """A step's generation: each prompt of its micro-batches ``grpo.num_generations`` times, and each completion
    row's sampling seed (keyed by the seed, epoch, prompt index and completion number)."""
    group = task.grpo.num_generations
    prompts = [ids for batch in batches for ids in batch["prompt_ids"] for _ in range(group)]
    seeds = [sampling.row_seed(task.seed, batch["epoch"], index, j)
             for batch in batches for index in batch["index"] for j in range(group)]
    return prompts, seeds


class GrpoStep:
    """One step of GRPO (module docstring): sample, score, then ``grpo.iterations`` x ``grpo.generation_steps``
    updates."""

    def __call__(self, run, batches: List[Dict]) -> StepResult:
        task, acc = run.task, run.accelerator
        g, group = task.grpo, task.grpo.num_generations
        prompts, seeds = generation_batch(task, batches)
        with backend.generating(acc, run.model, run.mesh) as model:
            completions = sampling.generate(model, prompts, seeds, task.sampling, synced=task.synced)
        per_function = task.score_together([row for batch in batches for row in batch["rows"] for _ in range(group)],
                                           completions)
        stops = set(task.sampling.stop_ids)
        truncated = torch.tensor([c[-1] not in stops for c in completions])
        completion_lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
        # Every process's rewards and lengths: the step-wide std (scale_rewards batch) and the metrics.
        everything = acc.gather(torch.cat([per_function, completion_lengths[:, None], truncated[:, None].float()], 1)
                                .to(acc.device)).cpu()
        tp = backend.tensor_parallel_size(acc)
        if tp > 1:  # the processes of a tensor-parallel group (consecutive) hold the same rows: one copy of each
            everything = everything.view(acc.num_processes, -1, everything.shape[1])[::tp].flatten(0, 1)
        weights = task.weights()
        all_rewards = weighted_rewards(everything[:, :len(task.rewards)], weights)
        advantage = advantages(weighted_rewards(per_function, weights), group, g.scale_rewards, nanstd(all_rewards))
        metrics = reward_metrics(everything, all_rewards, task, group)

        trained = [not (g.mask_truncated_completions and t) for t in truncated.tolist()]
        rollouts, start = [], 0
        for batch in batches:
            end = start + len(batch["prompt_ids"]) * group
            rollouts.append(rollout_batch(prompts[start:end], completions[start:end], advantage[start:end],
                                          trained[start:end], task.sampling.pad_id, acc.device))
            start = end
        counts = [normaliser(r["targets"] != IGNORE, g) for r in rollouts]
        total = backend.total_over_processes(acc, sum(counts))
        total = total.clamp(min=1) if isinstance(total, torch.Tensor) else max(total, 1)
        # Each optimizer step divides by its share of the generation's normaliser (TRL's dapo: the generation's
        # tokens over its steps). As the supervised step's scale: accelerate divides by the micro-batches of an
        # update and DDP averages over processes.
        scale = acc.num_processes * (len(rollouts) // g.generation_steps) / share_normaliser(total, g)
        with torch.no_grad():
            for r in rollouts:
                if g.iterations > 1 or g.generation_steps > 1:  # the ratio's denominator, before any update
                    r["old"] = task.token_logprobs(run.model, r)
                if g.beta > 0:
                    r["ref"] = task.reference_logprobs(run.model, r)

        stats = torch.zeros(6, device=acc.device)  # low-, high-, region-clipped tokens, KL sum, tokens, entropy sum
        loss = 0
        for _ in range(g.iterations):
            for r in rollouts:
                def loss_of(model, r=r):
                    logps, entropy = task.token_logprobs(model, r, with_entropy=True)
                    per_token, ratio, kl = token_losses(logps, r.get("old", logps.detach()), r.get("ref"),
                                                        r["advantages"], g)
                    mask = (r["targets"] != IGNORE).float()
                    stats.add_(update_sums(ratio.detach(), kl, entropy, r["advantages"], mask, g))
                    return loss_sum(per_token, mask, g)

                # Looked up at the call, as the supervised step's: tests/scripts/kill_at.py counts micro-batches by it.
                loss = loss + framework.step.backward_and_step(run, loss_of, scale)
        low, high, region, kl_sum, tokens, entropy_sum = (acc.reduce(stats, reduction="sum") if acc.num_processes > 1
                                                          else stats).tolist()
        metrics.update({"clip_ratio/low_mean": low / max(tokens, 1), "clip_ratio/high_mean": high / max(tokens, 1),
                        "clip_ratio/region_mean": region / max(tokens, 1), "entropy": entropy_sum / max(tokens, 1)})
        if g.beta > 0:
            metrics["kl"] = kl_sum / max(tokens, 1)
        # Tokens: every update's forward and backward (the FLOPs counted); generation and the no-grad forwards are
        # not model FLOPs of training. Micro-steps: the step's micro-batches once (the loop counts its samples by
        # them), however many times each is updated on.
        lengths = torch.cat([r["attention_mask"].sum(dim=1) for r in rollouts])
        examples = task.examples(prompts, completions, per_function, advantage) if acc.is_main_process else []
        return StepResult(loss, sum(counts) * g.iterations, lengths.sum() * g.iterations,
                          (lengths * lengths).sum() * g.iterations, len(rollouts), metrics, examples)


def update_sums(ratio: torch.Tensor, kl: Optional[torch.Tensor], entropy: torch.Tensor, advantage: torch.Tensor,
                mask: torch.Tensor, g: GrpoConfig) -> torch.Tensor:
    """Of a micro-batch's completion tokens: how many have their ratio clipped below, above, either (where the
    clip bites: TRL's is_low_clipped, is_high_clipped), the summed KL estimate, how many there are, and their
    summed entropy."""
    a = advantage.unsqueeze(1)
    high = g.epsilon if g.epsilon_high is None else g.epsilon_high
    low_clipped = ((ratio < 1 - g.epsilon) & (a < 0)).float() * mask
    high_clipped = ((ratio > 1 + high) & (a > 0)).float() * mask
    kl_sum = (kl.detach() * mask).sum() if kl is not None else mask.new_zeros(())
    return torch.stack([low_clipped.sum(), high_clipped.sum(), (low_clipped + high_clipped).clamp(max=1).sum(), kl_sum,
                        mask.sum(), (entropy * mask).sum()])


def reward_metrics(everything: torch.Tensor, total: torch.Tensor, task: GRPO, group: int) -> Dict[str, float]:
    """TRL's reward and completion figures over every completion of the step (all processes): ``everything`` is
    their rewards per function, lengths and truncation flags; ``total`` their weighted rewards."""
    functions = len(task.rewards)
    std = (nanstd(total.view(-1, group), dim=1).repeat_interleave(group) if task.grpo.scale_rewards != "batch"
           else nanstd(total).expand_as(total))
    lengths = everything[:, functions]
    figures = {"reward": torch.nanmean(total).item(), "reward_std": nanstd(total).item(),
               "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item(),
               "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
               "completions/max_length": lengths.max().item(),
               "completions/clipped_ratio": everything[:, functions + 1].mean().item()}
    for i, function in enumerate(task.rewards):
        figures[f"rewards/{function.name}/mean"] = torch.nanmean(everything[:, i]).item()
        figures[f"rewards/{function.name}/std"] = nanstd(everything[:, i]).item()
    return figures

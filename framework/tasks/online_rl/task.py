"""What every online-RL task shares: its recipe keys (``OnlineConfig``, the base of each algorithm's section), the
model, the prompts, and its run (``OnlineRun``): the reward functions, how completions are sampled, the reference,
the log-probabilities of completions, and evaluation by greedy completions scored by the reward functions.

Recipe keys: the language-model keys (``model.name_or_path``, or ``model.config`` + ``model.tokenizer``),
``data.chat_template``, ``data.max_length`` (the longest prompt, in tokens: a longer one keeps its last tokens,
where its question and generation prompt are) and the algorithm's section.

The log-probabilities the losses use are those of the logits over the temperature, as TRL takes them, through the
chunked head where exact. Dropout is switched off: the log-probabilities at sampling, the reference's and the
training forward's must be of one function. The reference (``beta`` > 0) is DPO's: a frozen copy of the starting
weights, or the trained model with its adapter off under peft; the frozen copy is refused under FSDP and DeepSpeed.

Under FSDP2 and DeepSpeed ZeRO-3 generation runs on the sharded model (framework/backend/generation.py): it
gathers the whole weights once per generation where the memory plan says they fit (``gathers_weights``); otherwise
each block gathers its weights in its forward, a collective, so the processes, each on its own prompts, generate in
lockstep (``synced``) until the last one's completions stop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from framework import backend, data, templates
from framework.errors import UserError
from framework.tasks.causal_lm import CausalLM
from framework.tasks.completions import Reference, completion_tokenizer, load_completion_model, target_logprobs
from framework.tasks.language import LanguageRun
from framework.tasks.online_rl import generator, multi_turn, reward_models, rewards, sampling, tools
from framework.tasks.online_rl.rollout import PROMPT_IDS, PromptCollator, prepare_prompts, prompt_ids
from framework.tasks.online_rl.step import OnlineStep

EXAMPLES = 4  # completions of a step's first prompt its log record shows


@dataclass
class OnlineConfig:
    """The keys every online-RL algorithm reads from its section: the rewards, how completions are sampled, and the
    update's clipping, passes and reference."""

    reward_functions: List[str] = field(default_factory=list)
    """The rewards, summed with ``reward_weights``: built-in ``exact_match``, ``numeric`` (against
    ``answer_column``), ``regex`` (``regex``), a trained reward model ``model:PATH`` (a sequence classifier with one
    output: a ``reward_model`` run's model/), or the user's ``path/to/file.py:function`` /
    ``package.module:function`` with TRL's signature f(prompts, completions, completion_ids, **columns) -> list
    of float or None (framework/tasks/online_rl/rewards.py)."""
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
    mask_truncated_completions: bool = False
    """Leave completions that did not stop within max_completion_length out of the loss (DAPO)."""
    dynamic_sampling: int = field(default=0, metadata={"ge": 0})
    """DAPO's dynamic sampling: the most rounds in which a group whose rewards are all equal (every advantage zero)
    is replaced by another prompt drawn from the training set, until its rewards differ; 0: off. Each draw is keyed
    by the group's prompt and the round (framework/tasks/online_rl/dynamic_sampling.py)."""
    tools: List[str] = field(default_factory=list)
    """Functions the model may call, ``path/to/file.py:function`` or ``package.module:function`` (TRL's ``tools``):
    type hints and a Google-style docstring give each its JSON schema, which the prompt lists (a template that
    renders tools: ``data.chat_template: chatml-tools``); rollouts go on after each call with its result
    (framework/tasks/online_rl/multi_turn.py). Tools are your own code: they run in the training process."""
    environment: Optional[str] = None
    """A class, named as a tool is, with TRL's ``environment_factory`` contract: one instance per rollout,
    ``reset(**row)`` (a returned string is appended to the prompt's last message), its public methods tools, and
    an optional ``get_reward()``, a reward named after the class (weight 1)."""
    max_tool_calls: int = field(default=4, metadata={"ge": 1})
    """With tools: the most tool turns a rollout makes (each runs the calls its turn wrote; TRL's
    ``max_tool_calling_iterations``); a call after them ends the rollout unanswered."""
    tool_timeout: float = field(default=10.0, metadata={"gt": 0.0})
    """With tools: seconds a tool call may run; a slower one gives the model an error result (and runs on, given up
    on, in a daemon thread)."""


class OnlineRL(CausalLM):
    """An online-RL task: subclasses set ``options`` (their section, a subclass of ``OnlineConfig``), ``reads`` and
    ``algorithm``."""

    metric = "reward"
    keeps_other_columns = True  # the reward functions read every column

    @property
    def section(self) -> str:
        return self.options[0]

    def settings(self, cfg) -> OnlineConfig:
        """The recipe's section of this task."""
        return getattr(cfg, self.section)

    def algorithm(self, cfg):
        """The advantages and policy loss the step learns with (framework/tasks/online_rl/step.py's ``Algorithm``)."""
        raise NotImplementedError

    def step(self, cfg) -> OnlineStep:
        return OnlineStep(cfg, self.settings(cfg), self.algorithm(cfg))

    # ------------------------------------------------------------ recipe keys, model

    def check(self, cfg, strategy) -> List[str]:
        problems = super().check(cfg, strategy)
        g, key = self.settings(cfg), self.section
        if not g.reward_functions and not g.environment:
            problems.append(f"{key}.reward_functions: name at least one reward function (exact_match, numeric, regex, "
                            "model:PATH, path/to/file.py:function or package.module:function)")
        for spec in g.reward_functions:
            if reward_models.is_model(spec):
                problems += reward_models.check(spec, f"{key}.reward_functions")
        if g.reward_weights is not None and len(g.reward_weights) != len(g.reward_functions):
            problems.append(f"{key}.reward_weights: {len(g.reward_weights)} weights for {len(g.reward_functions)} "
                            "reward functions; give one per function")
        if "regex" in g.reward_functions:
            try:
                rewards.regex(g.regex or "")
            except Exception as e:
                problems.append(f"{key}.regex: {g.regex!r} is not a regular expression ({e})")
            if not g.regex:
                problems.append(f"{key}.regex: the regex reward function needs the expression completions must match")
        accumulation = cfg.train.gradient_accumulation_steps
        if accumulation % g.generation_steps:
            problems.append(f"{key}.generation_steps: {g.generation_steps} optimizer steps cannot share the "
                            f"generation's {accumulation} micro-batches (train.gradient_accumulation_steps) equally; "
                            "make it divide them")
        if g.dynamic_sampling and cfg.data.streaming:
            problems.append(f"{key}.dynamic_sampling: draws replacement prompts from the training set, which a stream "
                            "cannot give; set data.streaming=false or remove the key")
        if (g.tools or g.environment) and strategy.shards_parameters:
            problems.append(f"{key}.tools: tools and environments do not run under FSDP or DeepSpeed yet (each "
                            "process's rollouts take their own number of turns, and a sharded model generates in "
                            "lockstep); use distributed.strategy=ddp")
        if (g.tools or g.environment) and strategy.xla:
            problems.append(f"{key}.tools: tools and environments do not run on XLA yet (each rollout takes its own "
                            "number of turns, a new shape per turn); use backend=cpu or gpu")
        if g.beta > 0 and cfg.peft is None and strategy.shards_parameters:
            problems.append(f"{key}.beta: the reference model, a frozen copy, is not built under FSDP or DeepSpeed yet "
                            "(its weights load on the first process only); train an adapter (peft: the reference is "
                            f"the adapter off), or set {key}.beta=0, or use distributed.strategy=ddp")
        return problems

    def metric_names(self):
        return ("reward",)

    def columns(self, cfg) -> Dict[str, str]:
        g, key = self.settings(cfg), self.section
        columns = {f"{key}.prompt_column": g.prompt_column}
        if {"exact_match", "numeric"} & set(g.reward_functions):
            columns[f"{key}.answer_column"] = g.answer_column
        return columns

    def keep_row(self, cfg):
        """Every prompt must be text or a conversation: a bad one stops the run naming its row."""
        column, key = self.settings(cfg).prompt_column, f"{self.section}.prompt_column"

        def check(row) -> bool:
            prompt = row[column]
            where = f"{key}: the row {templates.snippet(row)}"
            if isinstance(prompt, list) or (isinstance(prompt, str) and prompt.strip()):
                templates.maybe_conversation(prompt, where)
                return True
            raise UserError(f"{where}: the prompt is {templates.snippet(prompt)}, not text nor a conversation (a list of "
                            "{role, content}); fix or remove the row")

        return check

    def load(self, cfg, train, evaluation):
        model, tokenizer = load_completion_model(self, cfg)
        stop = templates.end_of_turn_ids(tokenizer, cfg.data.chat_template)
        # model/ then answers in a pipeline("text-generation") up to where sampling stopped (training's sampling
        # sets the model's generation defaults aside: framework/tasks/online_rl/sampling.py).
        model.generation_config.eos_token_id = stop if len(stop) > 1 else stop[0]
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        data.check_length(f"data.max_length + {self.section}.max_completion_length", self.sequence_length(cfg, model),
                          tokenizer, model)
        return model, tokenizer

    def sequence_length(self, cfg, model) -> int:
        return cfg.data.max_length + self.settings(cfg).max_completion_length

    def prepare(self, ds, tokenizer, model, cfg):
        """The prompts' tokens, with the tools' schemas listed where the section names tools (imported now: a
        mistake in them stops the run before it trains)."""
        schemas = tools.Toolbox(self.settings(cfg), self.section).schemas
        if schemas:  # a template that renders the tools or the calls as if they were not there is refused
            templates.check_tools_shown(tokenizer, schemas, f"{self.section}.tools")
        return prepare_prompts(ds, tokenizer, self.settings(cfg).prompt_column, cfg.data.max_length,
                               f"{self.section}.prompt_column", schemas)

    def collator(self, tokenizer, cfg, buckets, rows=None):
        return PromptCollator(rows)

    def bind(self, cfg, model, accelerator) -> "OnlineRun":
        """Dropout (peft's too) is switched off in the model: TRL's disable_dropout, one function for sampling, the
        reference and training."""
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        g = self.settings(cfg)
        return OnlineRun(self, cfg, accelerator, Reference.of(model, accelerator) if g.beta > 0 else None,
                         generator.supports(model))


class OnlineRun(LanguageRun):
    """An online-RL task bound to its run: its section's settings, reward functions, sampling settings and how it
    generates, the tokenizer (it decodes completions for the rewards; loaded again from the recipe as ``load`` made
    it), the reference. ``own_generator``: the model runs on framework/tasks/online_rl/generator.py's generator (else
    on transformers' generate: a model with sliding-window attention)."""

    def __init__(self, task: OnlineRL, cfg, accelerator, reference: Optional[Reference] = None,
                 own_generator: bool = True):
        super().__init__(task, cfg, accelerator)
        # XLA: fixed shapes on the device (prompts in data.max_length slots, the step's rollouts padded to the run's
        # buckets); a model the generator cannot run generates with transformers' generate on a host copy there.
        static = backend.needs_static_shapes(accelerator)
        self.static_generation = static and own_generator
        if not own_generator:
            self.generator = None
        elif static:  # each decode step one graph: run_pending ends it
            self.generator = generator.Generator(static=True, prompt_slots=cfg.data.max_length,
                                                 sync=lambda: backend.run_pending(accelerator),
                                                 host=lambda tensor: backend.to_host(accelerator, [tensor])[0])
        else:
            self.generator = generator.Generator()
        # The step's prefill and decode step, evaluation's (its rows, greedy), the no-grad log-probabilities' pass.
        self.compiled_graphs = 5 if self.static_generation else 0
        self.buckets = data.pad_lengths(cfg.data, static, task.sequence_length(cfg, None))
        g = self.settings = task.settings(cfg)
        self.section, self.seed, self.accelerator, self.reference = task.section, cfg.seed, accelerator, reference
        self.tokenizer, _ = completion_tokenizer(task, cfg)
        self.rewards = rewards.Rewards(g, task.section, self.tokenizer, accelerator)
        self.sampling = sampling.Sampling(g.temperature, g.top_k, g.top_p, g.max_completion_length,
                                          templates.end_of_turn_ids(self.tokenizer, cfg.data.chat_template),
                                          self.tokenizer.pad_token_id)
        self.toolbox = tools.Toolbox(g, task.section)
        self.tool_loop = (multi_turn.ToolLoop(self.toolbox, self.tokenizer, self.sampling, g.max_tool_calls,
                                              cfg.data.max_length + g.max_completion_length) if self.toolbox else None)
        if self.toolbox.has_reward:
            self.rewards.add_environment_reward(self.toolbox.environment, f"{task.section}.environment")
        if not self.rewards.functions:
            raise UserError(f"{task.section}.reward_functions: name at least one reward function, or give "
                            f"{task.section}.environment a get_reward method")
        # FSDP2 (block by block) and ZeRO-3 gather each block's weights in its forward, a collective: the processes,
        # each on its own prompts, generate in lockstep until the last one's completions stop.
        self.synced = (backend.is_fsdp2(accelerator) or backend.is_zero3(accelerator)) and accelerator.num_processes > 1

    def workload(self, model):
        """As a language model's, and the step's generation: every completion of its micro-batches at once; the frozen
    models: the reference and the reward models."""
        g, t = self.settings, self.cfg.train
        return dataclasses.replace(super().workload(model), sequences=g.num_generations,
                                   generated_rows=t.batch_size * t.gradient_accumulation_steps * g.num_generations,
                                   generated_length=self.task.sequence_length(self.cfg, model),
                                   generated_by=f"{self.task.section}.max_completion_length",
                                   frozen=(self.reference.models() if self.reference else []) + self.rewards.models())

    def generate(self, model: torch.nn.Module, prompts: List[List[int]], seeds: List[int],
                 greedy: bool = False) -> List[List[int]]:
        """One completion of each prompt (through its stop token where one came), row i sampled with the generator
        seeded ``seeds[i]`` (``greedy``: the most likely tokens), on every process in lockstep where the model's
        weights are sharded and gathered in each forward (``synced``; not while ``backend.generating`` holds them
        whole). The model is left in eval mode: call it inside ``backend.generating``."""
        synced = self.synced and not backend.weights_gathered(model)
        if self.generator is None:
            return sampling.generate(model, prompts, seeds, self.sampling, greedy=greedy, synced=synced)
        return self.generator(model, prompts, seeds, self.sampling, greedy=greedy, synced=synced).completions

    def rollouts(self, model: torch.nn.Module, prompts: List[List[int]], seeds: List[int], rows: List[Dict],
                 greedy: bool = False) -> Tuple[multi_turn.Rollouts, List[Dict]]:
        """The completions of ``prompts`` (row i drawn by ``seeds[i]``; ``greedy``: the most likely tokens), one
        sampled span each, or through the tool loop where the section names tools or an environment; and the rows
        the rewards score: ``rows``, each with its rollout's environment (``environments``, TRL's reward argument)
        where there is one. An environment's ``reset(**row)`` observation is appended to its prompt, rendered again
        (with the tools, the last ``data.max_length`` tokens)."""
        if self.tool_loop is None:
            completions = self.generate(model, prompts, seeds, greedy=greedy)
            return multi_turn.Rollouts(prompts, completions, [[1] * len(c) for c in completions]), rows
        environments = self.toolbox.environments(len(rows))
        if self.toolbox.environment is not None:
            key, column = f"{self.section}.environment", self.settings.prompt_column
            prompts = list(prompts)
            for i, (row, environment) in enumerate(zip(rows, environments)):
                observation = tools.reset(environment, row, key)
                if observation is not None:
                    where = f"{self.section}.prompt_column: the prompt {templates.snippet(row[column])}"
                    prompt = multi_turn.with_observation(templates.maybe_conversation(row[column], where), observation)
                    ids = prompt_ids(self.tokenizer, prompt, where, self.toolbox.schemas)
                    prompts[i] = ids[-self.cfg.data.max_length:]
            rows = [{**row, "environments": environment} for row, environment in zip(rows, environments)]
        return self.tool_loop.generate(model, prompts, seeds, environments, greedy), rows

    def logprobs(self, model: torch.nn.Module, rollout: Dict[str, torch.Tensor], with_entropy: bool = False):
        """Per token of a micro-batch of rollouts, the log-probability of its target (``target_logprobs``, at the
        sampling temperature); ``with_entropy``: and each completion token's entropy, as TRL logs it."""
        return target_logprobs(model, rollout, rollout["targets"], self.loss_chunk, self.select_targets,
                               self.settings.temperature, with_entropy)

    def reference_logprobs(self, model: torch.nn.Module, rollout: Dict[str, torch.Tensor]) -> torch.Tensor:
        return self.reference.logprobs(model, lambda reference: self.logprobs(reference, rollout))

    def examples(self, prompts: List[List[int]], completions: List[List[int]], per_function: torch.Tensor,
                 advantage: torch.Tensor) -> List[Dict[str, object]]:
        """The step's first prompt and up to ``EXAMPLES`` of its completions, as text, each with its reward (weighted,
        and per function: None where a function skipped it) and advantage: what the log shows of the step."""
        def number(value: float) -> Optional[float]:  # float32's 7 digits (JSON has no NaN)
            return None if np.isnan(value) else float(f"{value:.7g}")

        shown = min(self.settings.num_generations, EXAMPLES)
        total = self.rewards.total(per_function[:shown]).tolist()
        prompt = self.tokenizer.decode(prompts[0])
        # With tools, the tool turns show as the template marks them (their headers are special tokens).
        marked = bool(self.toolbox)
        return [{"prompt": prompt, "completion": self.tokenizer.decode(completions[j], skip_special_tokens=not marked),
                 "reward": number(total[j]), "advantage": number(float(advantage[j])),
                 "rewards": {f.name: number(v) for f, v in zip(self.rewards.functions, per_function[j].tolist())}}
                for j in range(shown)]

    # ------------------------------------------------------------ evaluation

    def eval_outputs(self, model, batch) -> Dict[str, torch.Tensor]:
        """Per held-out prompt: the rewards of its greedy completion (through the tool loop, with tools), per
        function and weighted; with tools, its calls and failed calls."""
        inner = backend.generation_ready(self.accelerator, self.accelerator.unwrap_model(model))
        out, rows = self.rollouts(inner, batch["prompt_ids"], [], batch["rows"], greedy=True)
        per_function = self.rewards.score_together(rows, out.completions, out.messages)
        device = next(inner.parameters()).device
        outputs = {"rewards": per_function.to(device), "reward": self.rewards.total(per_function).to(device)}
        if self.tool_loop is not None:
            outputs["tool_calls"] = torch.tensor(out.calls, dtype=torch.float32, device=device)
            outputs["tool_failures"] = torch.tensor(out.failures, dtype=torch.float32, device=device)
        return outputs

    def metrics(self, gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
        """The greedy completions' mean reward, overall and per function (over the prompts it scored); with tools,
        the calls per rollout and the failed share of them (TRL's ``tools/call_frequency``,
        ``tools/failure_frequency``)."""
        figures = {"reward": float(np.nanmean(gathered["reward"])), "prompts": int(len(gathered["reward"]))}
        for i, function in enumerate(self.rewards.functions):
            figures[f"rewards/{function.name}"] = float(np.nanmean(gathered["rewards"][:, i]))
        if "tool_calls" in gathered:
            figures.update(multi_turn.tool_frequencies(gathered["tool_calls"], gathered["tool_failures"]))
        return figures

    def sample(self, model, tokenizer, eval_ds) -> Optional[Dict[str, str]]:
        """The first held-out prompt, its greedy completion and that completion's reward."""
        if len(eval_ds) == 0:
            return None
        row = eval_ds[0]
        out, rows = self.rollouts(model, [row[PROMPT_IDS]], [], [PromptCollator.columns(row)], greedy=True)
        reward = self.rewards.total(self.rewards.score(rows, out.completions, out.messages))
        return {"prompt": tokenizer.decode(out.prompts[0]), "generated": tokenizer.decode(out.completions[0]),
                "reward": f"{float(reward[0]):.4g}"}


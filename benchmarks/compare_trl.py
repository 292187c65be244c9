"""Post-training: the framework against TRL (SFTTrainer, DPOTrainer, GRPOTrainer), the same jobs side by side in
one run.

    .venv/bin/python benchmarks/compare_trl.py [--jobs sft_full,sft_lora,dpo_lora,grpo_lora[,grpo_tools]] [--steps 10]
        [--rounds 3] [--skip-steps 2] [--train-rows 480] [--eval-rows 100] [--threads N]
        [--gradient-checkpointing defaults|off|on] [--fixed-seed] [--no-warmup] [--set KEY=VALUE ...]
        [--json results.json]

Five jobs on SmolLM2-135M-Instruct (``assets/SmolLM2-135M-Instruct``: Llama, tied embeddings, ChatML template; the
fifth on the model recipes/sft_tools.yaml makes of it), fp32 on the CPU, each run for ``--steps`` optimizer steps
(default 10) by two sides, each in its own process:

- framework: the real CLI, ``python recipes/run.py --config RECIPE train.max_steps=N output_dir=DIR ...``;
- TRL: ``compare_trl.py --side trl --config RECIPE ...`` (this file, below): ``trl.SFTTrainer`` with ``SFTConfig``
  or ``trl.DPOTrainer`` with ``DPOConfig``, given the model folder's path as a user gives it (TRL loads the model
  and its tokenizer), on TRL's own defaults except what the job fixes.

The jobs:

- ``sft_lora``: ``recipes/sft.yaml``: LoRA r 16, alpha 32 on all linear layers, lr 1e-3, cosine, warmup ratio
  0.05, weight decay 0.01, batch 8, conversations packed into 128-token blocks (TRL: ``packing=True,
  max_length=128``; ``peft.LoraConfig`` from the recipe's ``peft`` section);
- ``sft_full``: the same, full fine-tuning: ``peft=null optim.lr=3e-5`` (TRL: no ``peft_config``);
- ``dpo_lora``: ``recipes/dpo.yaml``: sigmoid loss, beta 0.1, LoRA as above (the reference is the model with
  its adapters off on both sides), lr 5e-4, batch 8, max_length 128.
- ``grpo_lora``: ``recipes/grpo.yaml``: 2 prompts a step, 8 completions each of at most 16 tokens at temperature
  1, the dapo loss, beta 0, LoRA as above, lr 3e-4; the rewards ``numeric`` + 0.5 ``regex`` (the framework's
  functions, TRL's signature, given to ``GRPOTrainer`` as they are). TRL counts completions where the framework
  counts prompts (``per_device_train_batch_size`` 16). The rows are ``assets/sums.jsonl``'s. Quality is read
  from the rewards, not the loss (about 0 with one update per generation): the mean over the steps of each
  step's reward, and each side's own eval reward (the framework: one greedy answer per eval prompt; TRL: its
  ``num_generations`` samples of each). Tokens: the prompt and completion tokens of the update.
- ``grpo_tools``: ``recipes/grpo_tools.yaml``: GRPO as ``grpo_lora`` (its own settings: 8 completions of at most 96
  tokens, the dapo loss, beta 0, lr 1e-4, constant, no weight decay) on multiplications, each rollout allowed
  ``grpo.max_tool_calls`` (2) turns of calls to recipes/tools/calculator.py's ``multiply``. The rows are
  ``assets/tool_prompts.jsonl``'s (500: ``--train-rows`` and ``--eval-rows`` must sum to at most that, the
  defaults' 580 do not). Its model is the recipe's, ``runs/sft_tools/model``, which ``accelerate launch
  recipes/run.py --config recipes/sft_tools.yaml`` saves (not one of the default jobs: run that recipe first, or
  pass ``--set model.name_or_path=...``). TRL: ``GRPOTrainer(tools=[multiply])`` (the function
  imported as the framework imports ``grpo.tools``), ``max_tool_calling_iterations=grpo.max_tool_calls`` and the
  tokenizer as ``processing_class``: the model's, given ``data.chat_template`` (chatml-tools, the template the
  sft_tools model carries already) as the framework gives it (``templates.use_template``; where that adds
  ``<tool_call>`` and ``</tool_call>`` to a model without them, as ``--set model.name_or_path=
  assets/SmolLM2-135M-Instruct`` does, TRL gets the model grown as the framework grows it,
  ``templates.resize_embeddings``, but its new rows stay frozen where the framework trains them beside the
  adapters: peft's ``trainable_token_indices`` wraps the tied output layer, which TRL 1.16's fused LM head cannot
  read, an AttributeError on its ``bias``; the sft_tools model has the tokens, and neither side adds rows). TRL's
  ``add_response_schema`` knows the template's format (Qwen's and Hermes' ``<tool_call>{json}
  </tool_call>``) by the exact template text only, and refuses ours, so the side sets TRL's own Qwen 3 response
  template (``qwen3_template``) on the tokenizer before building the trainer; with it TRL parses
  ``<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call><|im_end|>`` into that call.
  chatml-tools is prefix-preserving as TRL checks it (``is_chat_template_prefix_preserving``: true), so TRL keeps
  it: both sides render the same prompts (the schema in the system turn) and insert the same tool turns. Equal:
  ``max_completion_length`` counts the model's and the tool turns' tokens on both sides, a tool result that
  does not fit is dropped and the rollout ends at its call, and tool tokens are out of the loss. Tool figures:
  ``tools/call_frequency`` (calls per rollout) and ``tools/failure_frequency`` (failed share of the calls),
  logged each step by both; the table gives the calls per rollout (mean over steps) and the failed share of all
  the run's calls (0 without calls, as both log it). What differs, each side's own design: the framework stops
  sampling at ``</tool_call>`` (one id) and inserts the rest of the turn (``<|im_end|>``) with the tool turn, one
  call per turn; TRL samples to the end of the turn, so the model writes that ``<|im_end|>`` itself (in TRL's
  loss and token count), and every call of the turn is run. The framework samples at most the budget left after
  each tool turn; TRL samples up to ``max_completion_length`` new tokens after each and then cuts them to it.
  TRL drops a tool turn that would pass the budget, the framework one that leaves no room for a sampled token.
  A malformed call (bad JSON, no ``</tool_call>``) is a failed call with an error result for the framework; TRL
  reads it as plain text (no call, no failure, and its text counts for the rewards). TRL has no tool timeout
  (``grpo.tool_timeout`` is the framework's alone).

Same data: the SmolLM2 template has no ``{% generation %}`` markers, so TRL's ``assistant_only_loss`` cannot be
used; both SFT sides instead train on prompt/completion conversations (TRL's default for such rows: loss on the
completion only; the framework's ``sft.train_on=completion``). The parent writes them from
``assets/rotten_tomatoes_pairs.jsonl`` (its ``prompt`` and ``chosen`` columns): the first ``--train-rows`` rows to
a train file, the next ``--eval-rows`` to an eval file; DPO gets the same rows with all three columns. Both
sides read those two files (the framework with ``data.train_file``, ``data.eval_file`` and no row caps).

Same settings by construction: both sides get the same recipe and overrides, and the TRL side resolves them
with the framework's config loader (``common.read_recipe``); its ``SFTConfig``/``DPOConfig`` takes the recipe's
seed, steps, batch, lr, weight decay, Adam's betas and eps, schedule, warmup ratio and clipping
(``common.recipe_training_args``), the sequence length and packing, the DPO loss, beta and reference setting,
and ``bf16=False``, ``report_to="none"``. Beyond what a user must write, as in ``trainer_job.py``: TRL's eval
batch is the framework's (twice the train batch for SFT, the dpo recipe's 32), and neither side saves a
resumable checkpoint (framework ``checkpoint.every_minutes=null``; TRL ``save_strategy="no"``): both train,
evaluate once at the end (framework ``eval.every_steps`` beyond the run; TRL ``trainer.evaluate()``) and save
the model (the framework merges LoRA and saves the adapter beside it, as its recipes ask; TRL
``trainer.save_model()`` writes the adapter alone). The probe records each run's optimizer (its kernel,
hyperparameters and parameter groups) and the output says whether they match.

Gradient checkpointing (``--gradient-checkpointing``): TRL turns it on by default, the framework does not.
``defaults`` (the default) leaves each side on its own default, as users get them, and the table says so;
``off`` and ``on`` set the same on both (``train.gradient_checkpointing``, which the TRL side reads too).

What stays different (each side's own design, not equalized here): TRL packs SFT rows best-fit decreasing and
trains a batch padding-free, as one flattened row whose attention the model masks block-diagonally from
``position_ids``, while the framework packs conversations in order, each block a row of the batch; so the
blocks, the tokens per step and the attention work differ. Each side shuffles with its own sampler seeded by
the same seed: on the DPO rows, the same on both sides, they draw the same pairs in the same order (checked in
a 2-step run: the same tokens at each step, eval losses within 1e-7). TRL's eval loss is the mean of its eval
batches' means, the framework's the mean over every eval target token (DPO: both the mean over pairs). The
framework keeps large CPU buffers between steps (``framework/backend/cpu.py``), TRL has glibc's default.

Seeds: round i runs both sides with the recipe's seed + i (``--fixed-seed``: the recipe's seed in every round),
so the spread over rounds shows how far the losses move with the seed (LoRA's initialisation, the data order)
and a reader can tell whether the sides' loss difference is within it. Threads: both sides compute with
``--threads`` (default: the cores this process may run on, the framework's ``auto``): OMP_NUM_THREADS for
both, ``train.cpu_threads`` for the framework, which the TRL side passes to ``torch.set_num_threads``; the probe
records ``torch.get_num_threads()`` in each.

Measurement (compare_loops.py's Bench runs the children, its probe is loaded into each): per run,

- total wall: process start to exit (``os.wait4``), model loading, tokenization, the final eval and save included;
- time to first step: start to the end of optimizer step 1;
- steady tokens/s: the non-padding tokens put through the model (prompt and completion; DPO: chosen and
  rejected sequences) in steps ``--skip-steps``+1 .. ``--steps``, over the wall time from the end of step
  ``--skip-steps`` to the end of the last step (the probe's optimizer-step hook, the same in both processes).
  Tokens per step: the framework's own log (``train.log_every=1``: metrics.jsonl ``tokens_per_second`` x the
  step's seconds, from ``samples_per_second``), which counts the batch's attention mask; on the TRL side the
  batch each ``training_step`` gets, its attention mask's sum (DPO) or, padding-free (SFT), its length;
- peak memory: the child's peak RSS (``ru_maxrss`` of ``os.wait4``);
- final train loss: the loss of the last step (its batch's mean over target tokens, or over pairs), as passed
  to ``backward`` (the probe; for the framework its logged loss of that step is kept as a cross-check);
- eval loss: each side's own, over the eval rows, after the last step.

One unmeasured warm-up run of each side per job (2 steps; ``--no-warmup`` skips it) first fills the datasets
cache (a fresh HF_HOME) and the OS file cache. Then each round runs both sides back to back, the side that
goes first alternating from round to round. Each table gives the median over rounds and the spread
(min-max); the ratios framework / TRL are the median (and min-max) over rounds of each round's ratio. No
target: this says where the framework stands against TRL, it checks nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import ClassVar, Dict, List, Optional, Set, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PAIRS = ROOT / "assets" / "rotten_tomatoes_pairs.jsonl"
SUMS = ROOT / "assets" / "sums.jsonl"
TOOL_PROMPTS = ROOT / "assets" / "tool_prompts.jsonl"
FAR = 10 ** 9  # a step count beyond any run: eval.every_steps that never comes
DEFAULT_CHECKPOINTING = "--trl-default-checkpointing"  # the TRL side keeps TRL's gradient checkpointing default


# ---------------------------------------------------------------- the TRL side (a child)


def trl_side(argv: List[str]) -> None:
    """``compare_trl.py --side trl [--trl-default-checkpointing] [--config RECIPE] KEY=VALUE...``: the recipe's
    job with TRL, written as a TRL user writes it; writes ``summary.json`` (steps, eval figures, tokens per
    step) in ``output_dir``."""
    keep_default = DEFAULT_CHECKPOINTING in argv
    sys.argv = [sys.argv[0], *[a for a in argv if a != DEFAULT_CHECKPOINTING]]
    from common import read_recipe, recipe_training_args

    cfg = read_recipe(loop_only=False)
    t = cfg.train
    if cfg.precision != "no" or cfg.optim.name != "adamw" or cfg.optim.param_groups:
        sys.exit("the TRL side mirrors fp32 training with plain AdamW (precision: no, optim.name: adamw)")
    if not t.max_steps or not cfg.data.train_file or not cfg.data.eval_file:
        sys.exit("the TRL side needs train.max_steps, data.train_file and data.eval_file")
    if cfg.task == "sft" and cfg.sft.train_on != "completion":
        sys.exit("the TRL side trains SFT on prompt/completion rows: sft.train_on=completion")
    if cfg.task == "dpo" and cfg.dpo.loss not in ("sigmoid", "ipo"):
        sys.exit("DPOTrainer has the sigmoid and ipo losses (simpo is CPOTrainer's)")
    if cfg.task not in ("sft", "dpo", "grpo"):
        sys.exit("compare_trl.py runs the sft, dpo and grpo tasks")
    if cfg.task == "grpo" and cfg.grpo.environment:
        sys.exit("the TRL side mirrors grpo.tools, not grpo.environment")

    import torch

    if isinstance(t.cpu_threads, int):  # the parent always passes a number: the framework's count
        torch.set_num_threads(t.cpu_threads)
    import trl
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    data = load_dataset("json", data_files={"train": cfg.data.train_file, "eval": cfg.data.eval_file})
    settings = dict(
        **recipe_training_args(cfg),
        bf16=False, fp16=False, report_to="none",
        per_device_eval_batch_size=t.eval_batch_size or 2 * t.batch_size,  # the framework's eval batch
        save_strategy="no",  # no resumable checkpoint; the model is saved at the end
        **({} if keep_default else {"gradient_checkpointing": t.gradient_checkpointing}),
    )
    p = cfg.peft
    if p is not None and p.quantize:
        sys.exit("the TRL side does not mirror peft.quantize")
    peft_config = None if p is None else LoraConfig(
        r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout, target_modules=p.target_modules,
        modules_to_save=p.modules_to_save or None, task_type="CAUSAL_LM")
    if cfg.task == "grpo":
        trainer = grpo_trainer(cfg, settings, data, peft_config)
    elif cfg.task == "sft":
        # data.packing null means packed; data.block_size null, the model's positions up to 1024 (here 1024).
        args = trl.SFTConfig(**settings, max_length=cfg.data.block_size or 1024,
                             packing=cfg.data.packing is not False)
        trainer = trl.SFTTrainer(model=cfg.model.name_or_path, args=args, train_dataset=data["train"],
                                 eval_dataset=data["eval"], peft_config=peft_config)
    else:
        args = trl.DPOConfig(**settings, max_length=cfg.data.max_length, beta=cfg.dpo.beta,
                             loss_type=[cfg.dpo.loss], precompute_ref_log_probs=cfg.dpo.precompute_reference)
        trainer = trl.DPOTrainer(model=cfg.model.name_or_path, args=args, train_dataset=data["train"],
                                 eval_dataset=data["eval"], peft_config=peft_config)

    # Tokens per optimizer step. A callback sees no batch, so training_step (called once per micro-batch with
    # the collated batch) counts it and the callback closes each optimizer step's count. The counts stay
    # tensors until the end: no host read inside the steps.
    pending, per_step = [], []
    training_step = trainer.training_step

    def counting_step(model, inputs, *rest, **kwargs):
        mask = inputs.get("attention_mask")
        # Padding-free (TRL's packed SFT): one flattened row of real tokens, no attention mask, no padding.
        pending.append(mask.sum() if mask is not None else inputs["input_ids"].numel())
        return training_step(model, inputs, *rest, **kwargs)

    compute_loss = trainer.compute_loss

    def counting_loss(model, inputs, *rest, **kwargs):
        """GRPO: training_step gets the prompts; the rollouts it generated reach compute_loss."""
        if model.training:
            pending.append(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
        return compute_loss(model, inputs, *rest, **kwargs)

    class StepTokens(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            per_step.append(sum(pending))
            pending.clear()

    if cfg.task == "grpo":
        trainer.compute_loss = counting_loss
    else:
        trainer.training_step = counting_step
    trainer.add_callback(StepTokens())
    trained = trainer.train()
    evaluation = trainer.evaluate()
    print(f"eval {evaluation}", flush=True)
    trainer.save_model(str(Path(cfg.output_dir) / "model"))
    steps = [e for e in trainer.state.log_history if "loss" in e]  # one record per step (logging_steps 1)
    summary = {"train": {"steps": trained.global_step, "wall_seconds": trained.metrics["train_runtime"],
                         "gradient_checkpointing": bool(trainer.args.gradient_checkpointing)},
               "eval": {k.removeprefix("eval_"): v for k, v in evaluation.items()},
               "tokens_per_step": [int(n) for n in per_step],
               "rewards": [e["reward"] for e in steps if "reward" in e],
               # With tools, TRL's per-step figures: calls per rollout, failed share of the calls (0 without calls).
               "tools": {key: [e[f"tools/{key}"] for e in steps if f"tools/{key}" in e]
                         for key in ("call_frequency", "failure_frequency")}}
    (Path(cfg.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def grpo_trainer(cfg, settings: dict, data, peft_config):
    """``trl.GRPOTrainer`` on the recipe's sampling, loss and rewards: the framework's reward functions are
    TRL's signature (framework/tasks/online_rl/rewards.py), given to TRL as they are. TRL counts completions where the
    framework counts prompts: its batch is the framework's times ``num_generations``, so each step samples
    the same number of completions of as many prompts; its eval samples ``num_generations`` of each eval
    prompt (the framework's greedy one), its own design."""
    import trl

    from framework.tasks.online_rl import rewards

    g, group = cfg.grpo, cfg.grpo.num_generations
    functions = rewards.load(g.reward_functions, g.answer_column, g.regex, "grpo.reward_functions")
    model, tool_settings = cfg.model.name_or_path, {}
    if g.tools:
        model, tool_settings = with_tools(cfg)
    settings.update(per_device_train_batch_size=cfg.train.batch_size * group,
                    per_device_eval_batch_size=cfg.train.batch_size * group,
                    logging_steps=1)  # the reward of every step, as the framework's train.log_every=1
    args = trl.GRPOConfig(**settings, num_generations=group, max_completion_length=g.max_completion_length,
                          temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, loss_type=g.loss,
                          epsilon=g.epsilon, epsilon_high=g.epsilon_high, num_iterations=g.iterations,
                          beta=g.beta, scale_rewards=g.scale_rewards,
                          mask_truncated_completions=g.mask_truncated_completions,
                          reward_weights=list(g.reward_weights) if g.reward_weights else None,
                          **({"max_tool_calling_iterations": g.max_tool_calls} if tool_settings else {}))
    return trl.GRPOTrainer(model=model, reward_funcs=[f.function for f in functions], args=args,
                           train_dataset=data["train"], eval_dataset=data["eval"], peft_config=peft_config,
                           **tool_settings)


def with_tools(cfg):
    """(the model, ``GRPOTrainer``'s tool arguments) of a run with ``grpo.tools``, as a TRL user sets them up: the
    functions imported as the framework imports them (``tools.Toolbox``); the model's tokenizer with
    ``data.chat_template`` given as the framework gives it (chatml-tools: the sft_tools model's own already), and
    TRL's Qwen 3 response template, which parses chatml-tools' ``<tool_call>{json}</tool_call>`` (TRL's
    ``add_response_schema`` recognises templates by their exact text, and not ours). Where the template adds tokens
    the model lacks, the model is loaded and grown as the framework grows it (its new rows frozen: peft's
    ``trainable_token_indices``, the framework's way to train them, breaks TRL's fused LM head); otherwise TRL
    loads it from its path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    from framework import templates
    from framework.tasks.online_rl.tools import Toolbox

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.name_or_path)
    added = templates.use_template(tokenizer, cfg.data.chat_template)
    tokenizer.response_template = qwen3_template
    model = cfg.model.name_or_path
    if added:
        model = AutoModelForCausalLM.from_pretrained(model)
        templates.resize_embeddings(model, tokenizer)
    tools = list(Toolbox(cfg.grpo, "grpo").functions.values())
    return model, {"processing_class": tokenizer, "tools": tools}


# ---------------------------------------------------------------- the parent


def _parent_imports():
    """compare_loops.py's process runner, environment and machine description, and the framework's config
    loader (imported by the parent only)."""
    global Bench, Finished, RUN, MIB, child_env, machine, probe_env, load_config
    from compare_loops import MIB, RUN, Bench, Finished, child_env, machine, probe_env  # noqa: F401

    sys.path.insert(0, str(ROOT))
    from framework.recipe import load_config  # noqa: F401


@dataclass
class Job:
    """One post-training job on both sides, with the interface of compare_loops.Case (which Bench runs)."""
    name: str
    title: str
    recipe: Path
    job_overrides: List[str]  # what makes the job out of the recipe
    data: Dict[str, Path]  # train, eval: the files both sides read
    steps: int
    skip: int  # the first steps, left out of steady tokens/s
    threads: int
    checkpointing: str  # --gradient-checkpointing
    kind: str = "sft"  # sft, dpo, grpo or grpo_tools: the data, and what the job's quality is read from
    overrides: List[str] = field(default_factory=list)  # --set, for both sides
    seed: int = 42  # the seed of the runs about to start (set per round)
    loops: Dict[str, List[str]] = field(default_factory=dict)

    RATIOS: ClassVar[List[str]] = ["total_wall_s", "steady_tokens_per_s", "peak_rss_mib"]
    # What each job's quality is read from, per side: the last step's loss and the eval loss; GRPO's loss is no
    # measure of learning (with one update per generation, its value is about 0), its rewards are.
    # With tools, also the tool figures both log each step: calls per rollout and the failed share of the calls.
    QUALITY: ClassVar[Dict[str, List[Tuple[str, str]]]] = {
        "loss": [("train_loss", "final train loss"), ("eval_loss", "eval loss")],
        "reward": [("train_reward", "train reward (mean over steps)"),
                   ("eval_reward", "eval reward (framework greedy, TRL sampled)")]}
    QUALITY["tools"] = [*QUALITY["reward"], ("tool_calls", "tool calls per rollout (mean over steps)"),
                        ("tool_failures", "failed share of tool calls")]
    # Quality figures that are not like for like, reported but not judged: the framework's GRPO eval decodes
    # greedily, TRL's samples num_generations completions at the training temperature.
    UNMATCHED: ClassVar[List[str]] = ["eval_reward"]

    @property
    def rl(self) -> bool:
        """Whether the job is GRPO (its quality read from the rewards)."""
        return self.kind in ("grpo", "grpo_tools")

    @property
    def quality(self) -> List[Tuple[str, str]]:
        return self.QUALITY["tools" if self.kind == "grpo_tools" else "reward" if self.rl else "loss"]

    @property
    def metrics(self) -> List[str]:
        return ["total_wall_s", "time_to_first_step_s", "steady_tokens_per_s", "tokens_per_step", "peak_rss_mib",
                *(key for key, _ in self.quality)]

    def __post_init__(self):
        self.loops = {"framework": [sys.executable, str(RUN)],
                      "TRL": [sys.executable, str(Path(__file__).resolve()), "--side", "trl",
                              *([DEFAULT_CHECKPOINTING] if self.checkpointing == "defaults" else [])]}

    def recipe_overrides(self, output_dir: Path, steps: int) -> List[str]:
        """Both sides' recipe overrides: the TRL side reads the same ones."""
        return [*self.job_overrides,
                f"output_dir={output_dir}", f"seed={self.seed}", f"train.max_steps={steps}",
                f"data.train_file={self.data['train']}", f"data.eval_file={self.data['eval']}",
                "data.max_train_samples=null", "data.max_eval_samples=null",
                f"train.cpu_threads={self.threads}",
                "train.log_every=1",  # the framework's tokens per step, from its log
                f"eval.every_steps={FAR}",  # evaluate once, after the last step
                "checkpoint.every_minutes=null",  # no resumable checkpoint inside the run, as TRL's side
                *([f"train.gradient_checkpointing={'true' if self.checkpointing == 'on' else 'false'}"]
                  if self.checkpointing != "defaults" else []),
                *self.overrides]

    def command(self, loop: str, device: str, output_dir: Path, steps: Optional[int]) -> List[str]:
        return [*self.loops[loop], "--config", str(self.recipe), "backend=cpu",
                *self.recipe_overrides(output_dir, steps)]

    def env(self, base: Dict[str, str], probe_file: Optional[Path], steps: Optional[int]) -> Dict[str, str]:
        return probe_env(base, probe_file, steps, self.skip)

    def measure(self, loop: str, steps: Optional[int], device: str, done: Finished) -> Dict:
        probe = json.loads(done.probe_file.read_text())
        ends = probe["step_ends"]
        if len(ends) != steps:
            sys.exit(f"{self.name}, {loop}: {len(ends)} optimizer steps instead of {steps}")
        summary = json.loads((done.output_dir / "summary.json").read_text())
        result = {"side": loop, "seed": self.seed}
        if loop == "framework":
            records = [json.loads(line) for line in (done.output_dir / "metrics.jsonl").read_text().splitlines()]
            tokens = self.logged_tokens(records, summary["plan"]["effective_batch"])
            result["logged_train_loss"] = summary["train"]["loss"]  # the last step's, with train.log_every=1
            resolved = load_config(done.output_dir / "config.yaml", [])  # the recipe the run resolved
            result["gradient_checkpointing"] = resolved.train.gradient_checkpointing
            rewards = [r["reward"] for r in records if "reward" in r]  # train records; eval's say eval_reward
            tools = {key: [r[f"tools/{key}"] for r in records if f"tools/{key}" in r]
                     for key in ("call_frequency", "failure_frequency")}
        else:
            tokens = summary["tokens_per_step"]
            result["gradient_checkpointing"] = summary["train"]["gradient_checkpointing"]
            rewards, tools = summary["rewards"], summary["tools"]
        if self.rl:
            if len(rewards) != steps:
                sys.exit(f"{self.name}, {loop}: rewards for {len(rewards)} steps instead of {steps}")
            result.update(train_reward=statistics.mean(rewards), eval_reward=summary["eval"]["reward"])
        if self.kind == "grpo_tools":
            calls, failures = tools["call_frequency"], tools["failure_frequency"]
            if len(calls) != steps or len(failures) != steps:
                sys.exit(f"{self.name}, {loop}: tool figures for {len(calls)} steps instead of {steps}")
            # Every step samples as many rollouts: a step's calls are its calls per rollout times that count.
            result.update(tool_calls=statistics.mean(calls),
                          tool_failures=sum(c * f for c, f in zip(calls, failures)) / sum(calls) if sum(calls) else 0.0)
        if len(tokens) != steps:
            sys.exit(f"{self.name}, {loop}: token counts for {len(tokens)} steps instead of {steps}")
        steady = None
        if steps > self.skip:  # from the end of step `skip` to the end of the last step
            steady = sum(tokens[self.skip:]) / (ends[-1] - ends[self.skip - 1])
        return {**result,
                "total_wall_s": done.wall,
                "time_to_first_step_s": ends[0],
                "steady_tokens_per_s": steady,
                "tokens_per_step": statistics.median(tokens),
                "tokens": tokens,
                "peak_rss_mib": done.peak_rss_bytes / MIB,
                "train_loss": probe["last_loss"],
                "first_train_loss": probe["first_loss"],
                "eval_loss": summary["eval"].get("loss"),
                "eval": summary["eval"],
                "optimizer": probe["optimizer"],
                "threads": probe["threads"]}

    @staticmethod
    def logged_tokens(records: List[Dict], batch: int) -> List[int]:
        """The framework's tokens per step from its log (one record per step): tokens/s x the step's seconds,
        which its samples/s gives (batch samples a step)."""
        return [round(r["tokens_per_second"] * batch / r["samples_per_second"])
                for r in records if "tokens_per_second" in r]

    def summarize(self, runs: List[Dict]) -> Dict:
        """Per side, each metric's median, min and max over the rounds; framework / TRL, the median, min and max
        of the rounds' ratios (the two runs of a round are back to back)."""
        sides = {side: [r for r in runs if r["side"] == side] for side in self.loops}
        stats = {side: {m: spread([r[m] for r in rs]) for m in self.metrics} for side, rs in sides.items()}
        ratios = {m: spread([None if f[m] is None or t[m] is None else f[m] / t[m]
                             for f, t in zip(sides["framework"], sides["TRL"])]) for m in self.RATIOS}
        optimizers = {side: {json.dumps(r["optimizer"], sort_keys=True) for r in rs} for side, rs in sides.items()}
        return {"stats": stats, "ratios": ratios,
                "same_optimizer": len(optimizers["framework"] | optimizers["TRL"]) == 1,
                "same_threads": len({r["threads"] for r in runs}) == 1}

    def markdown(self, runs: List[Dict], summary: Dict) -> str:
        stats, ratios = summary["stats"], summary["ratios"]
        rounds = len(runs) // len(self.loops)
        seeds = sorted({r["seed"] for r in runs})
        checkpointing = {side: next(r["gradient_checkpointing"] for r in runs if r["side"] == side)
                         for side in self.loops}
        window = (f"steps {self.skip + 1}-{self.steps}" if self.steps > self.skip
                  else f"none: --steps {self.steps} leaves no step after --skip-steps {self.skip}")
        job = " ".join([str(self.recipe.relative_to(ROOT)), *self.job_overrides, f"train.max_steps={self.steps}"])
        lines = [f"## {self.name}: {self.title}", "",
                 f"`{job}`; "
                 f"{rounds} round(s), seed(s) {', '.join(map(str, seeds))}; {self.threads} CPU thread(s) per side; "
                 f"steady window: {window}. Gradient checkpointing: framework "
                 f"{'on' if checkpointing['framework'] else 'off'}, TRL {'on' if checkpointing['TRL'] else 'off'}"
                 + (" (each side's default)" if self.checkpointing == "defaults" else "") + "."
                 + (f" Overrides on both sides: {' '.join(self.overrides)}." if self.overrides else ""), "",
                 "Median over rounds (min-max):", "",
                 "| side | total wall (s) | time to first step (s) | steady tokens/s | tokens/step | peak RSS (MiB) | "
                 + " | ".join(name for _, name in self.quality) + " |",
                 "| --- |" + " ---: |" * len(self.metrics)]
        formats = {"total_wall_s": ".1f", "time_to_first_step_s": ".1f", "steady_tokens_per_s": ".0f",
                   "tokens_per_step": ".0f", "peak_rss_mib": ".0f", **{key: ".4f" for key, _ in self.quality}}
        lines += [f"| {side} | " + " | ".join(show(s[m], formats[m]) for m in self.metrics) + " |"
                  for side, s in stats.items()]
        lines += ["", "framework / TRL, the median (min-max) of each round's ratio (tokens/s above 1: the framework "
                  "is faster; wall and memory below 1: it is quicker or lighter):", "",
                  "| ratio | total wall | steady tokens/s | peak RSS |", "| --- | ---: | ---: | ---: |",
                  "| framework / TRL | " + " | ".join(show(ratios[m], ".3f") for m in self.RATIOS) + " |", ""]
        for metric, name in self.quality:
            f, t = stats["framework"][metric], stats["TRL"][metric]
            overlap = f["min"] <= t["max"] and t["min"] <= f["max"]
            judged = ("not like for like: not judged" if metric in self.UNMATCHED else
                      "one round: no spread to judge it by" if rounds == 1 else
                      f"the sides' ranges over the rounds {'overlap' if overlap else 'do NOT overlap'}")
            lines.append(f"{name}: framework - TRL = {f['median'] - t['median']:+.4f} (medians); {judged}.")
        framework_runs = [r for r in runs if r["side"] == "framework"]
        mismatch = [r for r in framework_runs if not self.rl and abs(
            r["logged_train_loss"] - r["train_loss"]) > 1e-5 * max(1.0, abs(r["train_loss"]))]
        if mismatch:
            lines.append("WARNING: the framework's logged last-step loss differs from the loss its backward got: "
                         + ", ".join(f"{r['logged_train_loss']:.6f} vs {r['train_loss']:.6f}" for r in mismatch))
        if summary["same_optimizer"]:
            lines += ["", f"Optimizer, the same on both sides: {json.dumps(runs[0]['optimizer'])}."]
        else:
            lines += ["", "The sides' optimizers differ: " + "; ".join(
                f"{r['side']} {json.dumps(r['optimizer'])}" for r in runs[:len(self.loops)]) + "."]
        if summary["same_threads"]:
            lines.append(f"CPU threads (torch.get_num_threads), the same in every run: {runs[0]['threads']}.")
        else:
            lines.append("WARNING: the runs' thread counts differ: "
                         + "; ".join(f"{r['side']} {r['threads']}" for r in runs) + ".")
        return "\n".join(lines)


def spread(values: List[Optional[float]]) -> Dict[str, Optional[float]]:
    """Median, min and max (None when a run had no value: no steady window)."""
    if not values or any(v is None for v in values):
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def show(s: Dict[str, Optional[float]], fmt: str) -> str:
    """``median (min-max)``, or the median alone when min and max print the same (one round)."""
    if s["median"] is None:
        return "-"
    low, high = format(s["min"], fmt), format(s["max"], fmt)
    return format(s["median"], fmt) + ("" if low == high else f" ({low}-{high})")


JOBS = {  # name: (title, recipe, overrides that make the job, data kind)
    "sft_full": ("SFT, full fine-tuning, on prompt/completion conversations", "sft.yaml",
                 ["peft=null", "optim.lr=3e-5", "sft.train_on=completion"], "sft"),
    "sft_lora": ("SFT with LoRA on prompt/completion conversations", "sft.yaml", ["sft.train_on=completion"], "sft"),
    "dpo_lora": ("DPO (sigmoid) with LoRA on preference pairs", "dpo.yaml", [], "dpo"),
    "grpo_lora": ("GRPO with LoRA on two-number sums (numeric and regex rewards)", "grpo.yaml", [], "grpo"),
    "grpo_tools": ("GRPO with LoRA and a calculator tool on multiplications (numeric and regex rewards)",
                   "grpo_tools.yaml", [], "grpo_tools"),
}
# Jobs whose model another recipe trains, with that recipe: not run by default.
TRAINED_BY = {"grpo_tools": "recipes/sft_tools.yaml"}


def write_data(folder: Path, train_rows: int, eval_rows: int, kinds: Set[str]) -> Dict[str, Dict[str, Path]]:
    """The rows both sides read, for the data ``kinds`` the jobs run: the first ``train_rows`` rows for training,
    the next ``eval_rows`` for evaluation; for SFT the pairs' prompt and chosen completion as prompt/completion
    conversations, for GRPO the sums' prompts and answers (``assets/sums.jsonl``), for GRPO with tools the
    multiplications' (``assets/tool_prompts.jsonl``)."""
    sources = (("sft", PAIRS, lambda r: {"prompt": r["prompt"], "completion": r["chosen"]}),
               ("dpo", PAIRS, lambda r: r), ("grpo", SUMS, lambda r: r), ("grpo_tools", TOOL_PROMPTS, lambda r: r))
    files, read = {}, {}
    for source in {source for kind, source, _ in sources if kind in kinds}:
        with source.open() as f:
            read[source] = [json.loads(line) for _, line in zip(range(train_rows + eval_rows), f)]
        if len(read[source]) < train_rows + eval_rows:
            sys.exit(f"{source.relative_to(ROOT)} has {len(read[source])} rows, fewer than --train-rows + "
                     f"--eval-rows ({train_rows + eval_rows})")
    for kind, source, convert in sources:
        if kind not in kinds:
            continue
        files[kind], rows = {}, read[source]
        for split, part in (("train", rows[:train_rows]), ("eval", rows[train_rows:])):
            path = folder / f"{kind}_{split}.jsonl"
            path.write_text("".join(json.dumps(convert(r)) + "\n" for r in part))
            files[kind][split] = path
    return files


def run_job(bench, job: Job, rounds: int, warmup: bool, vary_seed: bool, base_seed: int) -> List[Dict]:
    """The optional warm-up of each side, then ``rounds`` rounds of both sides back to back, the first side
    alternating; progress to stderr."""
    sides = list(job.loops)
    if warmup:
        job.seed = base_seed
        for side in sides:
            print(f"[{job.name}] warm-up: {side}", file=sys.stderr, flush=True)
            bench.run(job, side, f"{job.name}-{side}-warmup", steps=2, measured=False)
    runs = []
    for i in range(rounds):
        job.seed = base_seed + i if vary_seed else base_seed
        for side in sides if i % 2 == 0 else sides[::-1]:
            print(f"[{job.name}] round {i + 1}/{rounds} (seed {job.seed}): {side}", file=sys.stderr, flush=True)
            runs.append({"round": i + 1, **bench.run(job, side, f"{job.name}-{side}-{i}", job.steps, measured=True)})
    return sorted(runs, key=lambda r: (r["side"] != "framework", r["round"]))  # framework's rounds, then TRL's


def main() -> None:
    _parent_imports()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default=",".join(name for name in JOBS if name not in TRAINED_BY),
                        help=f"comma-separated, of {', '.join(JOBS)} (default all but "
                        f"{', '.join(TRAINED_BY)}, whose model another recipe trains)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    parser.add_argument("--skip-steps", type=int, default=2,
                        help="the first steps, left out of steady tokens/s (default 2)")
    parser.add_argument("--rounds", "--repeats", type=int, default=3,
                        help="measured runs per side and job, both sides in each round (default 3)")
    parser.add_argument("--train-rows", type=int, default=480, help="training rows (default 480, the sft recipe's)")
    parser.add_argument("--eval-rows", type=int, default=100, help="evaluation rows (default 100)")
    parser.add_argument("--threads", type=int, help="CPU threads per process, both sides (default: the cores this "
                        "process may run on, the framework's auto). On a machine shared with other work, 1 is far "
                        "less sensitive to the other load")
    parser.add_argument("--gradient-checkpointing", choices=["defaults", "off", "on"], default="defaults",
                        help="defaults: each side's own (TRL on, the framework off); off, on: the same on both")
    parser.add_argument("--fixed-seed", action="store_true",
                        help="the recipe's seed in every round (default: round i uses seed + i on both sides)")
    parser.add_argument("--no-warmup", action="store_true", help="no unmeasured warm-up run before the rounds")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="a recipe override for both sides of every job (after this script's own)")
    parser.add_argument("--json", "--out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()
    jobs = [name.strip() for name in args.jobs.split(",") if name.strip()]
    if not jobs or any(name not in JOBS for name in jobs):
        parser.error(f"--jobs takes a comma-separated list of {', '.join(JOBS)}")
    if args.steps < 1 or args.skip_steps < 1 or args.rounds < 1 or args.train_rows < 1 or args.eval_rows < 1 \
            or (args.threads is not None and args.threads < 1):
        parser.error("--steps, --skip-steps, --rounds, --train-rows, --eval-rows and --threads must be at least 1")
    if any("=" not in override for override in args.overrides):
        parser.error("--set takes KEY=VALUE")
    for name in [name for name in jobs if name in TRAINED_BY]:
        _, recipe, job_overrides, _ = JOBS[name]
        recipe = ROOT / "recipes" / recipe
        model = load_config(recipe, job_overrides).model.name_or_path  # the recipe's own (--set may name another)
        if load_config(recipe, [*job_overrides, *args.overrides]).model.name_or_path == model \
                and not (ROOT / model).exists():
            sys.exit(f"{name}: its model {model} does not exist: run `accelerate launch recipes/run.py --config "
                     f"{TRAINED_BY[name]}` first, or pass --set model.name_or_path=...")

    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = {**machine("cpu", threads), "trl": version("trl"), "peft": version("peft")}
    env = child_env("cpu", threads)  # OMP_NUM_THREADS=threads for both sides
    print(f"# Post-training: the framework vs TRL {info['trl']}\n\n"
          f"Date: {started}. Machine: {info['cpu']}, {info['cores']} cores. Framework {info['framework_revision']}; "
          f"torch {info['torch']}, transformers {info['transformers']}, accelerate {info['accelerate']}, "
          f"peft {info['peft']}. fp32; {args.train_rows} train rows, {args.eval_rows} eval rows "
          "(assets/rotten_tomatoes_pairs.jsonl; grpo_lora: assets/sums.jsonl; grpo_tools: "
          "assets/tool_prompts.jsonl). Tokens: non-padding tokens put "
          "through the model. Peak RSS: the child process's. Final train loss: the last step's.", flush=True)
    report = {"date": started, "machine": info, "rounds": args.rounds, "settings": vars(args),
              "jobs": {}}
    with tempfile.TemporaryDirectory(prefix="compare_trl-") as tmp:
        work = Path(tmp)
        env["HF_HOME"] = str(work / "hf_home")  # a fresh datasets cache, filled by the warm-up runs
        data = write_data(work, args.train_rows, args.eval_rows, {JOBS[name][3] for name in jobs})
        bench = Bench("cpu", work, env)
        for name in jobs:
            title, recipe, job_overrides, kind = JOBS[name]
            recipe = ROOT / "recipes" / recipe
            base_seed = load_config(recipe, [*job_overrides, *args.overrides]).seed
            job = Job(name, title, recipe, job_overrides, data[kind], args.steps, args.skip_steps, threads,
                      args.gradient_checkpointing, kind, args.overrides)
            runs = run_job(bench, job, args.rounds, not args.no_warmup, not args.fixed_seed, base_seed)
            summary = job.summarize(runs)
            report["jobs"][name] = {"recipe": str(recipe.relative_to(ROOT)), "overrides": job_overrides,
                                    "runs": runs, **summary}
            print("\n" + job.markdown(runs, summary), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--side":
        if sys.argv[2] != "trl":
            sys.exit("--side takes trl")
        trl_side(sys.argv[3:])
    else:
        main()

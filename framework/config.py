"""Recipes: YAML files mapped onto a typed schema.

A recipe is loaded with OmegaConf (``extends`` first, then the file, then ``KEY=VALUE`` overrides),
then checked against the dataclasses below. Every problem is collected and reported at once, each
naming its dotted key; unknown keys get a "did you mean" suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.errors import UserError
from framework.trackers import TRACKER_PACKAGES

# Field bounds live in field metadata: gt (exclusive minimum), ge, le, lt.
def _bounded(default: Any, **bounds: float) -> Any:
    return field(default=default, metadata=bounds)


@dataclass
class ModelConfig:
    name_or_path: Optional[str] = None
    """A local folder holding a transformers model (config.json, weights, tokenizer), or a Hub id: the
    pretrained model to fine-tune. Language models may instead be trained from scratch with ``config``."""
    config: Optional[Dict[str, Any]] = None
    """A model to train from scratch (language models): a transformers config as a mapping with its
    ``model_type`` (gpt2, llama, bert, ...) and sizes, e.g. {model_type: gpt2, n_layer: 4, n_embd: 256}.
    ``vocab_size`` and the special token ids default to the tokenizer's."""
    config_overrides: Optional[Dict[str, Any]] = None
    """Causal LMs (``causal_lm``, ``sft``, ``dpo``): attributes set on the pretrained model's config before its
    weights load, e.g. {is_decoder: true} to load a BERT checkpoint as a causal decoder (BertLMHeadModel)."""
    tokenizer: Optional[str] = None
    """The tokenizer (a local folder or Hub id); default: the one in ``name_or_path``. Required with ``config``."""
    token: Optional[str] = None
    """A Hugging Face token for a private Hub model. Write it as ``${oc.env:HF_TOKEN}``: values that come from
    the environment are written out (config.yaml, trackers, --print-config) as that template, never in clear."""


@dataclass
class SourceConfig:
    """One corpus of a mix (``data.sources``)."""

    train_file: Optional[Union[str, List[str]]] = None
    """Its files: a path, a glob (``shards/*.jsonl``) or a list of them, in one format."""
    dataset: Optional[str] = None
    """Or a Hub dataset name."""
    dataset_config: Optional[str] = None
    """The Hub dataset's configuration name, if it has several."""
    split: str = "train"
    """The split of ``dataset`` to read."""
    weight: float = _bounded(1.0, gt=0.0)
    """Its share of the rows drawn (weights are normalised to probabilities)."""


@dataclass
class DataConfig:
    train_file: Optional[Union[str, List[str]]] = None
    """Training data: csv, tsv, json, jsonl, parquet or txt, optionally compressed (.gz, .bz2, .xz, .zst, .zip);
    a path, a glob (``shards/*.jsonl``) or a list of them, in one format."""
    eval_file: Optional[Union[str, List[str]]] = None
    """Evaluation data in the same formats. Without it, ``eval_fraction`` of the training rows is held out."""
    sources: List[SourceConfig] = field(default_factory=list)
    """Several corpora drawn by probability instead of ``train_file``/``dataset``: a list of
    ``{train_file | dataset, weight}``. Rows are drawn from source i with probability weight_i / sum(weights)
    (seeded by ``seed``) until every source has been read once: that is an epoch. Their ``data.text_column``
    (and label column) must exist in each."""
    streaming: bool = False
    """Read the data as a stream (a ``datasets`` IterableDataset): rows are tokenized (and packed) on the fly
    and never all held in memory; each process reads its own share. An epoch is one pass over the files,
    so ``train.max_steps`` sizes the run; evaluation reads ``eval.batches`` batches of the eval stream."""
    shuffle_buffer: int = _bounded(1000, ge=1)
    """Streaming: examples are drawn at random from a buffer of this many (its contents are saved in every
    checkpoint, so a resume is exact); the file order is also shuffled every epoch. 1: file order."""
    dataset: Optional[str] = None
    """A Hub dataset name, used instead of ``train_file`` (needs network or a filled datasets cache)."""
    dataset_config: Optional[str] = None
    """The Hub dataset's configuration name, if it has several."""
    train_split: str = "train"
    """The split of ``dataset`` to train on."""
    eval_split: Optional[str] = None
    """The split of ``dataset`` to evaluate on; without it ``eval_fraction`` of the train split is held out."""
    eval_fraction: float = _bounded(0.1, gt=0.0, lt=1.0)
    """Fraction of the training rows held out for evaluation (seeded by ``seed``) when there is no eval set."""
    text_column: str = "text"
    """Column holding the text."""
    text_pair_column: Optional[str] = None
    """Optional second text column, for sentence-pair tasks."""
    label_column: str = "label"
    """Column holding the label: strings (mapped to ids in sorted order) or integers."""
    chat_template: Optional[str] = None
    """Post-training (sft, dpo): the chat template: a jinja file, or a built-in name (chatml); default the
    tokenizer's own."""
    labels: Optional[List[str]] = None
    """Keep only rows whose label is one of these; their order gives the label ids."""
    sample_by: Literal["line", "paragraph", "document"] = "paragraph"
    """How a plain-text file (.txt) is cut into documents: each line, each paragraph (blank-line separated), or
    the whole file. The document is then the ``text`` column."""
    packing: Optional[bool] = None
    """Language models: concatenate documents (EOS after each) into blocks of ``block_size`` tokens, each token
    attending only to its own document, positions restarting at each (default true). false: one document
    per row, truncated to ``block_size`` and padded."""
    block_size: Optional[int] = _bounded(None, ge=8)
    """Language models: tokens per row; default the model's positions, at most 1024."""
    mlm_probability: float = _bounded(0.15, gt=0.0, lt=1.0)
    """Masked language models: the fraction of tokens to predict (of them 80% masked, 10% random, 10% kept)."""
    max_length: int = _bounded(128, ge=8)
    """Classification: the longest tokenized input; longer texts are truncated."""
    max_train_samples: Optional[int] = _bounded(None, gt=0)
    """Train on at most this many rows (taken after the eval split)."""
    max_eval_samples: Optional[int] = _bounded(None, gt=0)
    """Evaluate on at most this many rows."""
    padding: Literal["auto", "dynamic", "max_length", "buckets"] = "auto"
    """Batch shapes: pad to the batch's longest text (dynamic), always to max_length, or to the smallest of
    ``pad_buckets`` that fits. auto: buckets on XLA (every new shape is a new compiled graph), else dynamic."""
    pad_buckets: Optional[List[int]] = None
    """Sequence lengths to pad to with ``padding: buckets``; default a quarter, half and all of the longest
    (``max_length``, or ``block_size`` for language models)."""
    group_by_length: bool = False
    """Batch examples of similar length together (shuffled in mega-batches): less padding, faster steps."""
    num_workers: int = _bounded(0, ge=0)
    """DataLoader worker processes."""


@dataclass
class TrainConfig:
    epochs: float = _bounded(3.0, gt=0)
    """Passes over the training data (fractions allowed). Ignored when ``max_steps`` is set."""
    max_steps: Optional[int] = _bounded(None, gt=0)
    """Stop after this many optimizer steps."""
    batch_size: int = _bounded(32, gt=0)
    """Examples per device per forward pass."""
    eval_batch_size: Optional[int] = _bounded(None, gt=0)
    """Examples per device per evaluation forward pass; defaults to twice ``batch_size``."""
    gradient_accumulation_steps: int = _bounded(1, gt=0)
    """Forward/backward passes per optimizer step."""
    max_grad_norm: Optional[float] = _bounded(1.0, gt=0)
    """Clip the global gradient norm to this value; null turns clipping off."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN or infinite training loss or gradient. stop: the loss is read where the loop reads it anyway (log steps,
    and before every checkpoint, with every weight), and the run exits with status 4 before writing anything from it.
    skip: every step reads its gradient norm (one host read and, with several processes, an all-reduce a step); a
    step whose norm is not finite leaves the weights and optimizer state as they were (its data is consumed and the
    schedule advances), counted in summary.json's ``train.skipped_steps``; ``max_skipped_steps`` in a row stop the run
    as stop does. Not on XLA (a host read in every step), with fp16 (its grad scaler skips overflowing steps itself)
    or DeepSpeed (its engine steps inside the backward)."""
    max_skipped_steps: int = _bounded(3, ge=1)
    """With ``on_nonfinite: skip``: steps skipped in a row before the run stops as diverged (status 4)."""
    log_every: int = _bounded(10, gt=0)
    """Log the mean training loss every this many optimizer steps."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward instead of storing them (the model's own non-reentrant
    checkpointing; with FSDP, use distributed.fsdp.activation_checkpointing)."""
    chunked_loss: bool = True
    """Language models: apply the output head and cross-entropy ``loss_chunk_tokens`` tokens at a time
    (framework/losses.py), so that no step holds the whole batch's logits; losses and gradients equal the
    full logits' up to float rounding. Architectures it is not exact for (logit soft-capping or scaling)
    always use full logits. false: the model's full logits, as transformers computes them."""
    loss_chunk_tokens: int = _bounded(1024, gt=0)
    """Language models, with ``chunked_loss``: tokens per chunk (the logits held at once: this many x the
    vocabulary, fp32)."""
    compile: bool = False
    """torch.compile the model (not on XLA, which compiles graphs itself)."""
    early_stopping_patience: Optional[int] = _bounded(None, gt=0)
    """Stop after this many evaluations in a row without improving ``eval.metric``."""
    profile_steps: Optional[List[int]] = None
    """[START, END]: record a profiler trace of optimizer steps START to END (counted from 1), one file per process
    in ``output_dir/profile/``: torch.profiler's Chrome trace JSON (open it in https://ui.perfetto.dev or
    chrome://tracing), on XLA torch_xla's profiler (TensorBoard's profile plugin reads it)."""
    cpu_threads: Union[Literal["auto"], int] = _bounded("auto", ge=1, le=65536)
    """Threads per process for CPU compute. auto: OMP_NUM_THREADS when it is set above 1 (a deliberate
    ``--num_cpu_threads_per_process``), else this machine's cores divided by its processes (plain
    ``accelerate launch`` sets OMP_NUM_THREADS=1, which would leave all but one core idle)."""


@dataclass
class HarnessConfig:
    """EleutherAI's lm-evaluation-harness on a causal language model (framework/harness.py): at the end of the
    run and, with ``every_steps``, during it. A recipe turns it on by having an ``eval.harness`` section."""

    tasks: List[str] = field(default_factory=list)
    """lm-eval task (or group) names: the repository's local ones (framework/harness_tasks: rt_sentiment,
    hamlet_next_line; their data is made by ``make install``), those in ``include_path``, or lm-eval's own
    (hellaswag, ...), which read their data from the Hugging Face Hub."""
    num_fewshot: Optional[int] = _bounded(None, ge=0)
    """Examples put before each question; default each task's own (0 for the local ones)."""
    limit: Optional[int] = _bounded(None, gt=0)
    """Score at most this many examples of each task (the first ones): a quicker, rougher figure."""
    batch_size: int = _bounded(8, gt=0)
    """Requests (context + continuation) per forward pass."""
    every_steps: Optional[int] = _bounded(None, gt=0)
    """Also run it every this many optimizer steps (not on XLA); default only at the end of the run."""
    include_path: List[str] = field(default_factory=list)
    """More folders of lm-eval task YAML files, searched after framework/harness_tasks."""


@dataclass
class EvalConfig:
    every_steps: Optional[int] = _bounded(None, gt=0)
    """Evaluate every this many optimizer steps instead of after every epoch (and always at the end). With
    ``data.streaming`` (epochs of unknown length) the default is only at the end."""
    batches: Optional[int] = _bounded(None, gt=0)
    """Evaluate on at most this many batches (of ``train.eval_batch_size``): the same examples every time.
    Streaming: the number of batches read from the start of the eval stream, default 16."""
    metric: Optional[str] = None
    """Metric that picks the best model (one of the task's: loss, accuracy, f1 for classification; loss,
    perplexity, accuracy for language models): model/ then holds the best, not the last."""
    greater_is_better: Optional[bool] = None
    """Whether a larger ``metric`` is better; default: false for loss and perplexity, true otherwise."""
    prompt: Optional[str] = None
    """Causal language models: the text a short greedy generation starts from at the end (logged and in
    summary.json); default: the first words of the first eval document."""
    max_new_tokens: int = _bounded(32, ge=1)
    """Causal language models: the length of that generation."""
    harness: Optional[HarnessConfig] = None
    """Causal language models: lm-evaluation-harness tasks to score the model on (see HarnessConfig); null: none."""


@dataclass
class CheckpointConfig:
    every_steps: Optional[int] = _bounded(None, gt=0)
    """Save a resumable checkpoint every this many optimizer steps under output_dir/checkpoints/step_N."""
    every_epoch: bool = False
    """Also save one at the end of every epoch."""
    every_minutes: Optional[float] = _bounded(None, gt=0)
    """Also save one when this many minutes of training have passed since the last save (or the start),
    so a run killed at any time loses at most about this much work."""
    keep_last: int = _bounded(2, ge=1)
    """Keep the newest this many checkpoints (plus the best model's, when eval.metric is set)."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in output_dir if there is one; never; or the path of
    a checkpoint (read only: the run writes into its own output_dir). The recipe must be the one the
    checkpoint was trained with, up to keys that cannot change the result (RESUME_FREE_KEYS)."""


@dataclass
class ReportConfig:
    enabled: bool = True
    """Write ``output_dir/report.html`` with PNG plots (curves, time, memory) at the end of the run and, while it
    trains, every ``every_minutes``."""
    every_minutes: float = _bounded(1.0, gt=0)
    """How often the report is rewritten while the run trains (at the next log step after this long), at most:
    never so often that drawing it takes more than 1% of the training time."""


@dataclass
class ParamGroupConfig:
    pattern: str = ""
    """Regular expression searched in parameter names (e.g. 'classifier'); the first matching group wins."""
    lr: Optional[float] = _bounded(None, gt=0)
    """This group's peak learning rate (default: optim.lr)."""
    weight_decay: Optional[float] = _bounded(None, ge=0)
    """This group's weight decay for its matrices (default: optim.weight_decay)."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd", "adafactor", "adamw_8bit", "paged_adamw_8bit", "lion"] = "adamw"
    """Optimizer: torch AdamW or SGD (torch's fused kernel where it has one: CUDA, the CPU), transformers'
    Adafactor, bitsandbytes' 8-bit AdamW (paged or not), or bitsandbytes' Lion."""
    lr: Optional[float] = _bounded(5e-5, gt=0)
    """Peak learning rate. null only with Adafactor's relative-step mode."""
    weight_decay: float = _bounded(0.01, ge=0)
    """Decoupled weight decay, applied to weights but not to biases and normalization layers."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam/Lion moment coefficients."""
    eps: float = _bounded(1e-8, gt=0)
    """Adam denominator epsilon."""
    momentum: float = _bounded(0.9, ge=0, lt=1)
    """SGD momentum."""
    nesterov: bool = False
    """SGD Nesterov momentum."""
    relative_step: bool = False
    """Adafactor only: its own time-dependent learning rate (set lr: null and scheduler: constant)."""
    param_groups: List[ParamGroupConfig] = field(default_factory=list)
    """Parameters with their own learning rate or weight decay, matched by name."""
    scheduler: Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                       "constant_with_warmup"] = "linear"
    """Learning-rate schedule after warmup (transformers.get_scheduler)."""
    warmup_ratio: float = _bounded(0.0, ge=0, lt=1)
    """Fraction of the optimizer steps spent warming up linearly from zero."""
    warmup_steps: Optional[int] = _bounded(None, ge=0)
    """Warmup length in optimizer steps; overrides warmup_ratio."""


@dataclass
class FSDPConfig:
    version: Literal[1, 2] = 2
    """FSDP implementation: 2 (per-parameter sharding, fully_shard) or 1 (FlatParameter)."""
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = "FULL_SHARD"
    """What is sharded: parameters+gradients+optimizer state, gradients+state only, nothing, or per node."""
    auto_wrap_policy: Literal["transformer", "size", "none"] = "transformer"
    """Wrap each transformer block (the model's _no_split_modules), modules above a size, or the model whole."""
    min_num_params: int = _bounded(100_000_000, gt=0)
    """Parameter count above which a module is wrapped, with ``auto_wrap_policy: size``."""
    activation_checkpointing: bool = False
    """Recompute each wrapped block's activations in backward instead of storing them."""
    cpu_ram_efficient_loading: bool = True
    """Load the pretrained weights on the first process only and broadcast them (less host memory)."""
    offload_params: bool = False
    """Keep parameters and gradients on the CPU between uses."""
    replicas: int = _bounded(1, ge=1)
    """FSDP2: HSDP, the processes as a replicas x (processes / replicas) mesh (accelerate's ParallelismConfig
    dp_replicate_size x dp_shard_size): each replica group holds one copy, sharded over its processes; gradients
    reduce-scatter within a group and all-reduce across groups. 1: every process shards one copy (FULL_SHARD)."""
    state_dict: Literal["sharded", "full"] = "sharded"
    """How checkpoints hold the model and optimizer: sharded (torch.distributed.checkpoint: each process writes
    its own shards, no process ever holds the whole model) or full (gathered and written by the first process).
    ``model/`` is always the full model in safetensors."""


@dataclass
class DeepSpeedConfig:
    zero_stage: Optional[int] = _bounded(None, ge=0, le=3)
    """ZeRO stage: 1 shards optimizer state, 2 adds gradients, 3 adds parameters. null: the launch config's stage
    (accelerate_configs/deepspeed_zero3.yaml: 3), else 2. A stage here that the launch config contradicts is refused."""
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    """Where ZeRO keeps the optimizer state."""
    offload_params: Literal["none", "cpu", "nvme"] = "none"
    """Where ZeRO-3 keeps the parameters."""


@dataclass
class DistributedConfig:
    strategy: Literal["auto", "ddp", "fsdp", "deepspeed", "xla_spmd", "xla_fsdp"] = "auto"
    """How processes share the work; auto takes what the launch config sets up (DDP when several processes).
    xla_spmd: one process drives every XLA device, each batch sharded over them on a data axis (SPMD).
    xla_fsdp: the same, with the parameters, gradients and optimizer state sharded over the mesh's fsdp axis."""
    mesh: Optional[List[int]] = None
    """xla_fsdp: the SPMD device mesh as [data, fsdp], devices along each axis (their product: every XLA device).
    Parameters are sharded fsdp ways and replicated data ways; batches are split over all. Default [1, N]."""
    num_processes: Optional[int] = _bounded(None, gt=0)
    """The number of processes this recipe expects; the run refuses to start with any other number."""
    local_sgd_steps: Optional[int] = _bounded(None, gt=0)
    """Local SGD: each process steps on its own gradients and parameters are averaged every this many
    optimizer steps (accelerate's LocalSGD), instead of all-reducing gradients every step."""
    timeout_minutes: Optional[float] = _bounded(None, gt=0, le=10**9)
    """How long a process waits in a collective for the others before it fails (torch.distributed's timeout;
    default torch's: 30 minutes for gloo, 10 for NCCL). A process that died breaks its peers' connections at once;
    this bounds the wait for one that hangs (a frozen machine, a lost network link)."""
    tensor_parallel: Optional[int] = _bounded(None, gt=1)
    """Tensor parallelism over this many processes, every launched one (accelerate's ParallelismConfig tp_size, the
    model sharded by transformers' tensor-parallel plan: Llama-style models, ``base_model_tp_plan``): each process
    holds 1/N of each attention and MLP matrix and all see the same batches. Not combinable with FSDP, DeepSpeed,
    adapters, local SGD, XLA or checkpoints (framework/backend/selection.py says why for each)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)


@dataclass
class PeftConfig:
    """Adapters (LoRA, through the peft library): the pretrained weights stay frozen and only small low-rank
    matrices (and ``modules_to_save``) train. A recipe turns them on by having a ``peft:`` section."""

    r: int = _bounded(8, gt=0)
    """LoRA rank: the inner size of each pair of low-rank matrices."""
    alpha: float = _bounded(16.0, gt=0.0)
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    dropout: float = _bounded(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input."""
    target_modules: Optional[Union[str, List[str]]] = None
    """Module names (suffixes, or one regular expression) that get adapters, or ``all-linear``; default peft's
    choice for the architecture (query/value projections for BERT, c_attn for GPT-2, q_proj/v_proj for Llama)."""
    modules_to_save: List[str] = field(default_factory=list)
    """Modules trained in full next to the adapters (e.g. an embedding). The classification head always is."""
    merge: bool = False
    """Also write the adapters merged into the base weights: ``model/`` then holds a plain model that
    ``pipeline()`` loads without peft, and the adapter moves to ``model/adapter/``."""
    quantize: Optional[Literal["4bit"]] = None
    """QLoRA: keep the frozen base linear layers in 4-bit NF4 (bitsandbytes), the adapters in full precision."""


@dataclass
class RunConfig:
    task: str = "text_classification"
    """What is trained: text_classification, causal_lm, masked_lm, sft or dpo (``framework/tasks/``, one module each),
    or a Task subclass of your own as ``path/to/file.py:ClassName`` or ``package.module:ClassName``
    (docs/adding-a-task.md). A task with options of its own reads them from its section (``sft``, ``dpo``)."""
    seed: int = _bounded(42, ge=0, lt=2**32)
    """Seeds Python, NumPy and torch on every process, the eval split and the data order."""
    output_dir: str = "runs/text_classification"
    """Where the run writes config.yaml, metrics.jsonl, summary.json, model/ and checkpoints/."""
    overwrite: bool = False
    """Allow replacing the outputs of an earlier run in ``output_dir``: a finished run, or an unfinished run of
    another recipe. An unfinished run of this same recipe is resumed instead (add checkpoint.resume=never to
    start over), so rerunning an interrupted command never wipes it."""
    backend: Literal["auto", "cpu", "gpu", "xla"] = "auto"
    """Where to train; auto takes what the launch provides (XLA, else a GPU, else the CPU)."""
    precision: Literal["no", "fp16", "bf16", "fp8"] = "no"
    """Mixed precision through accelerate."""
    report_to: List[str] = field(default_factory=list)
    """Experiment trackers accelerate logs to: tensorboard, wandb, mlflow (or any of accelerate's: comet_ml, aim,
    clearml, dvclive, swanlab, trackio). Their files go into output_dir (wandb and mlflow offline too)."""
    report: ReportConfig = field(default_factory=ReportConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    peft: Optional[PeftConfig] = None
    """Adapters instead of full fine-tuning (see PeftConfig); null: every weight trains."""
    env_templates: Dict[str, Any] = field(default_factory=dict, repr=False, metadata={"internal": True})
    """Not a recipe key: dotted key -> the recipe's own text (``${oc.env:...}``) for values that came from the
    environment, written out instead of the values."""


def schema() -> type:
    """The recipe's schema: RunConfig with one more section for each registered task's options (``Task.options``)."""
    from framework.tasks import sections  # the tasks read this module's schema

    return _with_sections(tuple(sections().items()))


@functools.lru_cache(maxsize=None)
def _with_sections(extra: tuple) -> type:
    return dataclasses.make_dataclass("RunConfig", [(name, cls, field(default_factory=cls)) for name, cls in extra],
                                      bases=(RunConfig,))


def core_keys() -> List[str]:
    """The top-level recipe keys and sections that are not a task's own section."""
    return [f.name for f in _schema_fields(RunConfig)]


def _schema_fields(cls: type) -> list:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


# Keys a resumed run may change: they cannot change the weights it trains (printed as notes on resume).
# Every other key changes the training trajectory, and a resume with a different value is refused.
RESUME_FREE_KEYS = ("output_dir", "overwrite", "report_to", "report.enabled", "report.every_minutes", "model.token",
                    "data.num_workers", "train.log_every", "train.eval_batch_size", "train.cpu_threads",
                    "train.profile_steps", "distributed.timeout_minutes", "checkpoint.every_steps",
                    "checkpoint.every_epoch",
                    "checkpoint.every_minutes", "checkpoint.keep_last", "checkpoint.resume")
# Free only while no metric picks the best model or stops early: then evaluation points decide the result.
RESUME_FREE_WITHOUT_METRIC = ("eval.every_steps",)
# The harness reads the model and leaves the random state alone: its keys never change what is trained.
RESUME_FREE_PREFIXES = ("eval.harness",)


# ---------------------------------------------------------------- loading


def load_config(path: Optional[str | Path], overrides: List[str]) -> RunConfig:
    """Load a recipe (with its ``extends`` chain), apply ``KEY=VALUE`` overrides, validate, and return it."""
    raw = _load_recipe(Path(path), ()) if path is not None else OmegaConf.create({})
    raw = _merge(raw, _parse_overrides(overrides), f"overrides {' '.join(overrides)}")
    try:
        data = OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise UserError(f"{key or 'recipe'}: cannot resolve its interpolation ({reason}); write ${{other.key}} or "
                        "${oc.env:VARIABLE} with a key or variable that exists") from None
    data.pop("extends", None)
    task = data.get("task")
    if isinstance(task, str) and ":" in task:
        from framework.tasks import get_task

        get_task(task)  # a task outside the framework: loaded and registered (its section joins the schema), or refused
    problems = _moved_keys(data)
    cfg, built = _build(schema(), data, "")
    problems += built
    cfg.env_templates = _env_templates(flatten(OmegaConf.to_container(raw, resolve=False)), flatten(data))
    problems += _cross_checks(cfg) + _unread_keys(cfg.task, data)
    if problems:
        where = f"recipe {path}" if path is not None else "recipe"
        raise UserError(f"{where} has {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    return cfg


def to_dict(cfg: RunConfig) -> Dict[str, Any]:
    """The resolved recipe as plain data, with values from the environment as their templates."""
    data = dataclasses.asdict(cfg)
    data.pop("env_templates")
    for key, template in cfg.env_templates.items():
        *parents, last = key.split(".")
        node = data
        for name in parents:
            node = node[name]
        node[last] = template
    return data


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)), sort_keys=False)


def flatten(data: Any, prefix: str = "") -> Dict[str, Any]:
    """Nested mappings as {dotted key: value}; lists stay whole values."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data}
    flat = {}
    for key, value in data.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat


def _env_templates(unresolved: Dict[str, Any], resolved: Dict[str, Any]) -> Dict[str, Any]:
    """The keys whose value comes from the environment (``${oc.env:VAR}``, or an interpolation of such a
    value), with their unresolved text."""
    def text(value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value, default=str)

    from_env = {key: value for key, value in unresolved.items() if re.search(r"\$\{\s*(oc\.)?env:", text(value))}
    secrets = [text(resolved[key]) for key in from_env if key in resolved and text(resolved[key]).strip()]
    for key, value in unresolved.items():
        if "${" in text(value) and any(secret in text(resolved.get(key)) for secret in secrets):
            from_env[key] = value
    return {key: value for key, value in from_env.items() if key != "extends"}


def resume_differences(saved: Dict[str, Any], cfg: RunConfig) -> tuple[List[str], List[str]]:
    """Compare the recipe a checkpoint was trained with (``to_dict`` output) with ``cfg``. Returns
    (differences that change the training trajectory, differences that cannot), each 'key: old -> new'.
    Keys the saved recipe lacks (added to the schema since) count as their defaults."""
    old = {**flatten(to_dict(schema()())), **_moved_saved_keys(flatten(saved))}
    new = flatten(to_dict(cfg))
    free = RESUME_FREE_KEYS + (RESUME_FREE_WITHOUT_METRIC if cfg.eval.metric is None else ())
    changed, harmless = [], []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            line = f"{key}: {_show(old.get(key))} -> {_show(new.get(key))}"
            (harmless if key in free or key.startswith(RESUME_FREE_PREFIXES) else changed).append(line)
    return changed, harmless


def _load_recipe(path: Path, chain: tuple) -> Any:
    if not path.is_file():
        raise UserError(f"recipe file {path} does not exist; pass an existing file to --config (see recipes/)")
    if path.resolve() in chain:
        raise UserError(f"recipe {path}: 'extends' forms a cycle")
    try:
        conf = OmegaConf.load(path)
    except Exception as e:  # yaml errors come in several types; all mean the same to the user
        raise UserError(f"recipe {path} is not valid YAML: {e}") from None
    if not OmegaConf.is_dict(conf):
        raise UserError(f"recipe {path} must be a mapping of keys to values, not {type(conf).__name__}")
    parents = conf.get("extends") or []
    if isinstance(parents, str):
        parents = [parents]
    if not OmegaConf.is_list(parents) and not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise UserError(f"recipe {path}: extends must be a recipe path or a list of them, not {_show(parents)}")
    merged = OmegaConf.create({})
    for parent in parents:
        parent_path = path.parent / str(parent)
        if not parent_path.is_file():
            raise UserError(f"recipe {path}: extends '{parent}', but {parent_path} does not exist")
        merged = _merge(merged, _load_recipe(parent_path, chain + (path.resolve(),)), f"recipe {path}")
    return _merge(merged, conf, f"recipe {path}")


def _merge(base: Any, over: Any, what: str) -> Any:
    """``over`` merged onto ``base``; a key that is a section in one and a list in the other is refused."""
    try:
        return OmegaConf.merge(base, over)
    except (OmegaConfBaseException, TypeError, ValueError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        key = getattr(e, "full_key", None)
        raise UserError(f"{what}: cannot merge {'key ' + key if key else 'it'} onto the recipe ({reason}); a section "
                        "(a mapping) can only be replaced by a mapping, a list by a list") from None


_KEY_PATH = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


def _parse_overrides(overrides: List[str]) -> Any:
    """``KEY=VALUE`` pairs, each value read as YAML, as one config; a malformed one is refused by name."""
    merged = OmegaConf.create({})
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not _KEY_PATH.fullmatch(key):
            raise UserError(f"override '{item}' must look like KEY=VALUE with KEY a dotted key path, for example "
                            "train.batch_size=16")
        try:
            parsed = OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
            reason = (str(e).splitlines() or [type(e).__name__])[0]
            raise UserError(f"override '{item}': the value of {key} is not valid YAML ({reason}); write a "
                            f"complete value (a list as [1, 2]) or quote it as text ({key}='{value}')") from None
        merged = _merge(merged, parsed, f"override '{item}'")
    return merged


# ---------------------------------------------------------------- validation


def _all_keys(cls: type, prefix: str = "") -> List[str]:
    keys = []
    for f in _schema_fields(cls):
        section = _section(typing.get_type_hints(cls)[f.name])
        if section is not None:
            keys += _all_keys(section, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _suggest(key: str, prefix: str, cls: type) -> str:
    siblings = [f.name for f in _schema_fields(cls)]
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    # The key may belong to another section: lr at the top level means optim.lr.
    everywhere = _all_keys(schema())
    same_name = [k for k in everywhere if k.rsplit(".", 1)[-1] == key]
    close = same_name or difflib.get_close_matches(key, [k.rsplit(".", 1)[-1] for k in everywhere], n=1)
    if close:
        full = same_name[0] if same_name else next(k for k in everywhere if k.endswith("." + close[0]) or k == close[0])
        return f"; did you mean '{full}'?"
    return f"; valid keys here: {', '.join(siblings)}"


def _section(kind: Any) -> Optional[type]:
    """The dataclass of a section key (``Section`` or ``Optional[Section]``), else None."""
    if dataclasses.is_dataclass(kind):
        return kind
    inner = [a for a in typing.get_args(kind) if a is not type(None)]
    optional = typing.get_origin(kind) is Union and len(inner) == 1 and dataclasses.is_dataclass(inner[0])
    return inner[0] if optional else None


def _build(cls: type, data: Any, prefix: str) -> tuple[Any, List[str]]:
    """Turn a plain dict into ``cls``, collecting (not raising) every problem."""
    where = prefix.rstrip(".") or "the recipe"
    if not isinstance(data, dict):
        return cls(), [f"{where} must be a mapping, got {_show(data)}"]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in _schema_fields(cls)}
    problems, values = [], {}
    for key, value in data.items():
        if key not in fields:
            problems.append(f"unknown key '{prefix}{key}'{_suggest(str(key), prefix, cls)}")
            continue
        kind = hints[key]
        item = (typing.get_args(kind) or [None])[0]
        if typing.get_origin(kind) in (list, List) and dataclasses.is_dataclass(item):
            if not isinstance(value, list):
                problems.append(f"{prefix}{key}: {_show(value)} is not allowed; expected a list of mappings")
                continue
            built = [_build(item, v, f"{prefix}{key}[{i}].") for i, v in enumerate(value)]
            values[key] = [b[0] for b in built]
            problems += [p for b in built for p in b[1]]
            continue
        section = _section(kind)
        if section is not None:
            if value is None and section is not kind:  # an optional section (peft), off
                values[key] = None
                continue
            values[key], sub = _build(section, value if value is not None else {}, f"{prefix}{key}.")
            problems += sub
            continue
        ok, value, allowed = _coerce(value, kind)
        if not ok:
            problems.append(f"{prefix}{key}: {_show(value)} is not allowed; expected {allowed}")
            continue
        bound = _check_bounds(value, fields[key].metadata)
        if bound:
            problems.append(f"{prefix}{key}: {_show(value)} is out of range; it must be {bound}")
            continue
        values[key] = value
    return cls(**values), problems


def _coerce(value: Any, kind: Any) -> tuple[bool, Any, str]:
    """Return (ok, value, description of what is allowed) for ``value`` against the type hint ``kind``."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        if value is None and type(None) in args:
            return True, None, ""
        results = [_coerce(value, a) for a in inner]
        for ok, coerced, _ in results:
            if ok:
                return True, coerced, ""
        nullable = " or null" if type(None) in args else ""
        return False, value, " or ".join(r[2] for r in results) + nullable
    if origin is Literal:
        return value in args, value, "one of " + ", ".join(str(a) for a in args)
    if origin in (dict, Dict):
        return isinstance(value, dict), value, "a mapping"
    if origin in (list, List):
        (item,) = args
        if not isinstance(value, list):
            return False, value, f"a list of {item.__name__}"
        coerced = [_coerce(v, item) for v in value]
        return all(c[0] for c in coerced), [c[1] for c in coerced], f"a list of {item.__name__}"
    if kind is bool:
        return isinstance(value, bool), value, "true or false"
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool), value, "an integer"
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value, "a number"
    if kind is str:
        ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
        return ok, str(value) if ok else value, "a string"
    raise TypeError(f"unsupported schema type {kind}")


def _check_bounds(value: Any, bounds: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""  # None, or the word of a word-or-number key (cpu_threads: auto)
    if isinstance(value, float) and not math.isfinite(value):
        return "a finite number"
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        return "a 64-bit integer"
    if not bounds:
        return ""
    rules = {"gt": (lambda v, b: v > b, "> {}"), "ge": (lambda v, b: v >= b, ">= {}"),
             "lt": (lambda v, b: v < b, "< {}"), "le": (lambda v, b: v <= b, "<= {}")}
    failed = any(not rules[k][0](value, b) for k, b in bounds.items())
    return " and ".join(rules[k][1].format(b) for k, b in bounds.items()) if failed else ""


def _cross_checks(cfg: RunConfig) -> List[str]:
    """Rules that involve more than one key; the task checks its own keys."""
    from framework import adapters
    from framework.tasks import get_task, registered  # the tasks read this module's schema

    problems = []
    d = cfg.data
    if d.sources:
        if d.train_file or d.dataset:
            problems.append("data.sources replaces data.train_file and data.dataset; remove those")
        for i, source in enumerate(d.sources):
            if bool(source.train_file) == bool(source.dataset):
                problems.append(f"data.sources[{i}]: set train_file (files) or dataset (a Hub dataset), one of them")
    elif not d.train_file and not d.dataset:
        problems.append("data.train_file is required (or data.dataset for a Hub dataset, or data.sources for a mix)")
    if d.train_file and d.dataset:
        problems.append("set data.train_file or data.dataset, not both")
    if d.streaming:
        if cfg.train.max_steps is None:
            problems.append("train.max_steps is required with data.streaming: a stream's length is unknown "
                            "until it is read, so runs are sized in optimizer steps")
        if d.num_workers:
            problems.append("data.num_workers: a stream is read in the training process (so that checkpoints "
                            "hold its exact position); set data.num_workers=0")
        if d.group_by_length:
            problems.append("data.group_by_length: a stream has no lengths to sort by; remove it or set "
                            "data.streaming=false")
        if cfg.checkpoint.every_epoch:
            problems.append("checkpoint.every_epoch: with data.streaming each process ends its epochs at its "
                            "own step; use checkpoint.every_steps")
    if d.pad_buckets is not None and (not d.pad_buckets or any(b <= 0 for b in d.pad_buckets)):
        problems.append(f"data.pad_buckets: {d.pad_buckets} must be a non-empty list of positive lengths")
    if cfg.model.name_or_path and cfg.model.config is not None:
        problems.append("set model.name_or_path (a pretrained model) or model.config (a model from scratch), not both; "
                        "without --config the default recipe sets model.name_or_path: start from --config "
                        "recipes/examples/causal_lm_from_scratch.yaml, or add model.name_or_path=null")
    if cfg.task not in registered():
        problems.append(f"task: {cfg.task!r} is not a task; use one of {', '.join(registered())}")
    else:
        task = get_task(cfg.task)
        problems += task.check(cfg)
        by_column: Dict[str, List[str]] = {}
        for key, column in task.columns(cfg).items():
            by_column.setdefault(column, []).append(key)
        problems += [f"{' and '.join(keys)} name the same column {column!r}; each must name its own column"
                     for column, keys in by_column.items() if len(keys) > 1]
        if cfg.eval.metric is not None and cfg.eval.metric not in task.metric_names():
            problems.append(f"eval.metric: {cfg.eval.metric!r} is not a metric of {cfg.task}; use one of "
                            f"{', '.join(task.metric_names())}")
    problems += adapters.check(cfg, cfg.distributed.strategy)
    mesh = cfg.distributed.mesh
    if mesh is not None and (len(mesh) != 2 or min(mesh) < 1):
        problems.append(f"distributed.mesh: {mesh} must be [data, fsdp], two positive device counts")
    if mesh is not None and cfg.distributed.strategy != "xla_fsdp":
        problems.append("distributed.mesh: only distributed.strategy=xla_fsdp takes a mesh (xla_spmd splits the batch "
                        "over every device); remove it or set distributed.strategy=xla_fsdp")
    steps = cfg.train.profile_steps
    if steps is not None and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
        problems.append(f"train.profile_steps: {steps} must be [START, END] with 1 <= START <= END (optimizer steps)")
    for name in cfg.report_to:
        if name not in TRACKER_PACKAGES:
            problems.append(f"report_to: {name!r} is not a tracker; use any of {', '.join(TRACKER_PACKAGES)}")
    harness = cfg.eval.harness
    if harness is not None:
        if cfg.task in registered() and not get_task(cfg.task).harness:
            problems.append(f"eval.harness: lm-evaluation-harness scores causal language models, not {cfg.task}; "
                            "remove eval.harness")
        if not harness.tasks:
            problems.append("eval.harness.tasks: name at least one lm-eval task, e.g. [rt_sentiment, hamlet_next_line]")
    if cfg.train.early_stopping_patience and cfg.eval.metric is None:
        problems.append("train.early_stopping_patience needs eval.metric (the metric that must keep improving)")
    o = cfg.optim
    if o.lr is None and not (o.name == "adafactor" and o.relative_step):
        problems.append("optim.lr: null is only allowed with optim.name=adafactor and optim.relative_step=true")
    for i, group in enumerate(o.param_groups):
        try:
            re.compile(group.pattern)
            if not group.pattern:
                raise re.error("empty")
        except re.error as e:
            problems.append(f"optim.param_groups[{i}].pattern: {group.pattern!r} is not a usable regular expression ({e})")
    if o.relative_step and o.name != "adafactor":
        problems.append(f"optim.relative_step: only Adafactor has a relative-step mode, not {o.name}")
    if o.relative_step and (o.lr is not None or o.scheduler != "constant"):
        problems.append("optim.relative_step: Adafactor then sets its own learning rate; use optim.lr=null "
                        "and optim.scheduler=constant")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        problems.append(f"optim.betas: {o.betas} must be two numbers in [0, 1)")
    return problems


def _unread_keys(task_name: str, data: Dict[str, Any]) -> List[str]:
    """Task-specific keys (``Task.reads`` of any task) that the recipe sets, to something else than their
    default, but its task does not read: a setting that would be silently ignored. (A key at its default is
    let through: ``--print-config`` and config.yaml write every key, and must load again.)"""
    from framework.tasks import get_task, registered, task_keys

    if task_name not in registered():
        return []
    reads = get_task(task_name).reads
    defaults = flatten(dataclasses.asdict(schema()()))
    present = {key for key, value in flatten(data).items() if value is not None and value != defaults.get(key)}
    problems = []
    for key in task_keys():
        if key in reads or not any(p == key or p.startswith(key + ".") for p in present):
            continue
        problems.append(f"{key}: {task_name} does not read it (it reads {', '.join(reads) or 'none of these keys'}); "
                        "remove it")
    return problems


def _moved_keys(data: Dict[str, Any]) -> List[str]:
    """Keys the recipe's task took from ``data`` into its own section (``Task.moved_from_data``), still read under
    their old name, with a note on stderr; giving both names different values is a problem."""
    from framework.tasks import get_task, registered

    name, old = data.get("task", RunConfig.task), data.get("data")
    if not isinstance(name, str) or name not in registered() or not isinstance(old, dict):
        return []
    task, problems = get_task(name), []
    for key in [key for key in task.moved_from_data if key in old]:
        section = task.options[0]
        new = data.setdefault(section, {})
        if not isinstance(new, dict):
            continue  # the schema names a section that is not a mapping
        value = old.pop(key)
        if key in new and new[key] != value:
            problems.append(f"data.{key} is now {section}.{key}, and the recipe sets both ({_show(value)} and "
                            f"{_show(new[key])}); keep {section}.{key} only")
            continue
        new[key] = value
        print(f"note: data.{key} is now {section}.{key}; write it there", file=sys.stderr)
    return problems


def _moved_saved_keys(saved: Dict[str, Any]) -> Dict[str, Any]:
    """A flattened recipe saved before the tasks' keys moved into their sections, as it reads now: its task's
    moved keys under their new names, every task's old ``data.*`` names dropped."""
    from framework.tasks import get_task, registered

    tasks = [get_task(name) for name in registered()]
    own = [t for t in tasks if t.name == saved.get("task")]
    moved = {f"{t.options[0]}.{key}": saved[f"data.{key}"]
             for t in own for key in t.moved_from_data if f"data.{key}" in saved}
    old = {f"data.{key}" for t in tasks for key in t.moved_from_data}
    return {**{k: v for k, v in saved.items() if k not in old}, **moved}


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value, default=str)

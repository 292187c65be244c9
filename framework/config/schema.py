"""The recipe's schema: typed dataclasses, one per section, a docstring under every field (``python -m
framework.keys`` turns them into docs/keys.md). Nothing here reads a file or knows a task: loading is
framework/config/loading.py, type checks framework/config/validation.py, and the schema a recipe is checked
against (these sections plus each registered task's own) is composed above both, in framework/recipe.py."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Union

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
    """Causal LMs (``causal_lm``, ``sft``, ``dpo``, ``grpo``, ``rloo``): attributes set on the pretrained model's config before its
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
    """Post-training (sft, dpo, reward_model, grpo, rloo): the chat template: a jinja file, or a built-in name (chatml,
    or chatml-tools: chatml that renders tools, tool calls and their results); default the tokenizer's own."""
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
    """The longest tokenized input: classification's text (longer texts are truncated), dpo's prompt and completion
    (cut from the end), reward_model's (a longer pair is dropped), online RL's (grpo, rloo) prompt (a longer one keeps
    its last tokens)."""
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
    adapters, local SGD or XLA (framework/backend/selection.py says why for each)."""
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
class ExportConfig:
    """What the run writes from ``model/`` at its end, beside it (framework/export.py; docs/export.md). The model
    card, ``model/README.md``, is written by every run."""

    gguf: List[str] = field(default_factory=list)
    """GGUF types to write for llama.cpp (f16, q8_0, q4_1), each as ``output_dir/model-<type>.gguf`` after ``model/``:
    causal LMs of the Llama family (llama, SmolLM2, mistral) or qwen2 with a byte-level BPE tokenizer. Empty: none
    (``python -m framework.export`` writes them later from a finished run)."""


@dataclass
class RunConfig:
    task: str = "text_classification"
    """What is trained: text_classification, causal_lm, masked_lm, sft, dpo, reward_model, grpo or rloo
    (``framework/tasks/``, one module each), or a Task subclass of your own as ``path/to/file.py:ClassName`` or
    ``package.module:ClassName`` (docs/adding-a-task.md). A task with options of its own reads them from its section
    (``sft``, ``dpo``, ``reward_model``, ``grpo``, ``rloo``)."""
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
    precision: Literal["no", "fp16", "bf16", "fp8", "auto"] = "no"
    """Mixed precision through accelerate: no (fp32), fp16 (a GPU), bf16, fp8 (an fp8-capable GPU); auto: bf16 where
    the device computes it natively and it pays (a GPU with bf16, a TPU, a CPU with AMX: measured 1.38x on the
    default recipe), else no. The plan prints the choice."""
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
    export: ExportConfig = field(default_factory=ExportConfig)
    env_templates: Dict[str, Any] = field(default_factory=dict, repr=False, metadata={"internal": True})
    """Not a recipe key: dotted key -> the recipe's own text (``${oc.env:...}``) for values that came from the
    environment, written out instead of the values."""


@functools.lru_cache(maxsize=None)
def with_sections(extra: tuple) -> type:
    """RunConfig with one more section for each ``(name, dataclass)`` of ``extra`` (the tasks' own sections)."""
    return dataclasses.make_dataclass("RunConfig", [(name, cls, field(default_factory=cls)) for name, cls in extra],
                                      bases=(RunConfig,))


def core_keys() -> List[str]:
    """The top-level recipe keys and sections that are not a task's own section."""
    return [f.name for f in schema_fields(RunConfig)]


def schema_fields(cls: type) -> list:
    """The recipe keys of a section (its dataclass fields, without the internal ones)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]

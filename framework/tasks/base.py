"""The task interface (:class:`Task`, what a task declares, and :class:`TaskRun`, the task bound to one run;
documented in framework/tasks/__init__.py and docs/adding-a-task.md) and the registry of tasks by recipe name."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import datasets
import numpy as np
import torch
from huggingface_hub.errors import StrictDataclassError

from framework import backend
from framework.config import core_keys
from framework.errors import UserError
from framework.memory import Workload
from framework.step import Step, SupervisedStep
from framework.user_code import module_of

# What transformers raises on a model, config or tokenizer the user got wrong (a missing or damaged file, a
# size that does not divide, a config value of the wrong type: transformers 5 configs are strict dataclasses).
MODEL_ERRORS = (OSError, ValueError, TypeError, KeyError, StrictDataclassError)


@dataclasses.dataclass
class ReportSection:
    """A section a task adds to report.html: a table, and the plots it drew for it."""

    title: str
    header: Sequence[str]
    rows: List[Sequence]
    plots: List[Path] = dataclasses.field(default_factory=list)


class Task:
    """What a task declares, the same for every run: its recipe keys and their checks, its data and model, and which
    step the loop runs. One instance per task sits in the registry and holds nothing of a run: ``bind`` makes the
    ``TaskRun`` a run trains with."""

    name: str
    pipeline: str  # what model/ loads as in transformers.pipeline()
    metric: str  # the headline metric, printed at the end
    lower_is_better = ("loss", "perplexity")
    reads: Tuple[str, ...] = ()  # the task-specific recipe keys (dotted) or sections it reads
    options: Optional[Tuple[str, type]] = None  # (section, dataclass): the recipe section of its own keys (in reads)
    moved_from_data: Tuple[str, ...] = ()  # keys of that section once spelt data.KEY: still read so, with a note
    harness = False  # whether lm-evaluation-harness can score its model (eval.harness): causal language models
    keeps_other_columns = False  # rows keep every column of the data, not only columns(cfg) (online RL's rewards)
    # peft's task type for its model (LoRA): what the wrapped model's forward accepts and, for classification, the
    # new head (``classifier`` or ``score``) kept trainable; None: peft's default.
    peft_task_type: Optional[str] = None

    def check(self, cfg, strategy: backend.Strategy) -> List[str]:
        """Problems with the recipe keys this task reads, and with the ``strategy`` the run will have (the launch
        resolved), each naming its key: called before anything is loaded."""
        return []

    def metric_names(self) -> Tuple[str, ...]:
        raise NotImplementedError

    def greater_is_better(self, name: str) -> bool:
        return name not in self.lower_is_better

    def columns(self, cfg) -> Dict[str, str]:
        """Recipe key -> column name, for every column a row must have."""
        raise NotImplementedError

    def optional_columns(self, cfg) -> Dict[str, str]:
        """Recipe key -> column name, for columns a row may have: kept where the data has them (sft's tools)."""
        return {}

    def keep_row(self, cfg):
        """A row filter (``row -> bool``) for unusable rows, or None."""
        return None

    def load(self, cfg, train: datasets.Dataset, evaluation: datasets.Dataset) -> Tuple[torch.nn.Module, object]:
        """(model, tokenizer); the raw rows are there for what the model's shape depends on (the labels)."""
        raise NotImplementedError

    def prepare(self, ds: datasets.Dataset, tokenizer, model: torch.nn.Module, cfg) -> datasets.Dataset:
        """Raw rows -> features (cached by the datasets fingerprint of everything they depend on)."""
        raise NotImplementedError

    def sequence_length(self, cfg, model: torch.nn.Module) -> int:
        """The longest row, in tokens: the largest padding bucket on XLA."""
        return cfg.data.max_length

    def collator(self, tokenizer, cfg, buckets: Optional[List[int]], rows: Optional[int] = None):
        """Features -> a batch. ``buckets``: the lengths to pad to (static shapes), None for dynamic padding;
        ``rows``: evaluation on static shapes fills a short last batch up to ``rows`` and marks the real rows
        in a ``valid`` column."""
        raise NotImplementedError

    def notes(self, cfg, train_ds: Optional[datasets.Dataset], eval_ds: datasets.Dataset) -> List[str]:
        """Lines for the plan about the prepared data (rows dropped or truncated); ``train_ds`` is None for a stream."""
        return []

    def step(self, cfg) -> Step:
        """The step the loop runs over each step's micro-batches (framework/step.py)."""
        return SupervisedStep(cfg)

    def bind(self, cfg, model: torch.nn.Module, accelerator) -> "TaskRun":
        """The task as one run uses it, given the model as loaded (adapters applied, not yet placed nor wrapped):
        the recipe's settings of its loss and what it holds beside the model (placed on ``accelerator.device``)."""
        raise NotImplementedError

    def report_sections(self, output_dir: Path, summary: Dict, plots_dir: Path) -> List[ReportSection]:
        """Sections of report.html from a finished run (its summary.json, ``summary``; the files in
        ``output_dir``), their plots drawn into ``plots_dir``."""
        return []


class TaskRun:
    """A task bound to one run (``Task.bind``): its loss and evaluation, with the run's settings and whatever it holds
    beside the trained model. The step, the evaluation and the memory plan call it; ``task`` is its declaration."""

    # Whether its generation (the step's, the sample's) keeps shapes static, so that on XLA it runs on the device
    # itself rather than on a host copy (backend.generating's ``static_shapes``): online RL's generator.
    static_generation = False
    # XLA graphs its own work compiles beside the training step's (CompileWatch's expectation): online RL's
    # generation, in the step and in evaluation.
    compiled_graphs = 0
    # Whether its generation gathers the sharded weights once (FSDP2, ZeRO-3, where the memory plan says they fit:
    # memory.plan's gathers_weights, set by train.setup), instead of block by block in each forward.
    gathers_weights = False

    def __init__(self, task: Task, cfg):
        self.task, self.cfg = task, cfg

    def workload(self, model: torch.nn.Module) -> Workload:
        """What the memory plan counts of this task beside the model's states: its sequences (length, rows per
        example), its logits, the models it holds beside the trained one, what it generates."""
        return Workload(seq_length=self.task.sequence_length(self.cfg, model))

    def targets(self, batch: Dict[str, torch.Tensor]):
        """What the batch's loss is normalised by (an int, or a device tensor for a count only the data knows)."""
        raise NotImplementedError

    def loss_sum(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def eval_outputs(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Per-example tensors, gathered over the processes for ``metrics``."""
        raise NotImplementedError

    def metrics(self, gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
        """The evaluation's figures (``loss`` among them) from every example's ``eval_outputs``."""
        raise NotImplementedError

    def sample(self, model: torch.nn.Module, tokenizer, eval_ds: datasets.Dataset) -> Optional[Dict[str, str]]:
        """Something to read at the end of a run (a generation), logged and written into summary.json."""
        return None


_REGISTRY: Dict[str, Task] = {}


def register(name: str):
    """Class decorator: the task ``task: NAME`` in a recipe trains (one instance of the class)."""
    def add(cls: type) -> type:
        cls.name = name
        _REGISTRY[name] = cls()
        return cls
    return add


def registered() -> Tuple[str, ...]:
    """The names of the tasks registered so far: the built-in ones, then those recipes named by their class."""
    return tuple(_REGISTRY)


def get_task(name: str) -> Task:
    """The task a recipe's ``task`` names: a registered one, or ``FILE.py:Class`` / ``package.module:Class``,
    loaded and registered on first use. A name that is neither is a UserError naming ``task``."""
    if name not in _REGISTRY:
        if ":" not in name:
            raise UserError(f"task: {name!r} is not a task; use one of {', '.join(registered())}, or name your own "
                            "Task subclass as path/to/file.py:ClassName or package.module:ClassName")
        _load(name)
    return _REGISTRY[name]


def _load(spec: str) -> None:
    fix = "write task: path/to/file.py:ClassName or task: package.module:ClassName, naming a Task subclass"
    module, class_name = module_of(spec, "task", fix, "framework_user_task_")
    where = spec.rpartition(":")[0]
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise UserError(f"task: {spec!r}: {where} has no Task subclass named {class_name!r}; {fix}")
    same = [task for task in _REGISTRY.values() if type(task) is cls]
    if same:  # already registered under another spelling
        _REGISTRY[spec] = same[0]
        return
    options = cls.options
    if options is not None:
        name = options[0] if isinstance(options, tuple) and len(options) == 2 else None
        if not (isinstance(name, str) and dataclasses.is_dataclass(options[1])) or name in core_keys() or any(
                t.options and t.options[0] == name for t in _REGISTRY.values()):
            raise UserError(f"task: {spec!r}: {class_name}.options must be (section name, dataclass) with a section "
                            "name no other key or task uses, e.g. options = (\"mytask\", MyTaskConfig)")
    try:
        register(spec)(cls)
    except Exception as e:
        raise UserError(f"task: {spec!r}: {class_name}() failed ({type(e).__name__}: {e}); a task must be "
                        "constructible without arguments") from None


def sections() -> Dict[str, type]:
    """Section name -> its dataclass, for every registered task that has options."""
    return dict(t.options for t in _REGISTRY.values() if t.options)


def task_keys() -> Tuple[str, ...]:
    """Every task-specific key: those some task reads (the others are shared by all tasks)."""
    return tuple(dict.fromkeys(key for task in _REGISTRY.values() for key in task.reads))

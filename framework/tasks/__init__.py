"""Tasks: everything that differs between what is trained, behind one interface.

A task is a module of this package holding ``TASK``, an instance of a :class:`Task` subclass. The loop, the
devices, checkpoints and reports know nothing else about it. A task owns:

- its recipe keys: ``reads``, the task-specific keys (dotted, or whole sections) it reads: a key that another
  task reads and this one does not is refused when a recipe sets it, instead of being silently ignored;
  ``check(cfg)`` returns the problems of the keys it reads (or refuses), like the config core;
- model loading: ``load(cfg, raw)`` -> (model, tokenizer), pretrained (``model.name_or_path``) or from a
  config (``model.config``); ``pipeline``: what the saved ``model/`` loads as in ``transformers.pipeline``;
- data preparation: ``columns(cfg)`` (the columns its rows need) and ``keep_row`` (which rows are usable),
  ``prepare(raw, tokenizer, model, cfg)`` -> features (tokenizing, labels, packing), and ``collator(...)``:
  features -> batches, in dynamic or static shapes;
- its loss, returned as a sum with what it is normalised by: ``targets(batch)`` counts the batch's targets
  (examples, or target tokens) and ``loss_sum(model, batch)`` sums their losses. The loop divides by the
  targets of the whole optimizer step (every micro-batch, every process), so a token loss is exact whatever
  the accumulation and process count; ``logits_chunk(model)``: what the memory plan counts of the logits;
- ``eval_outputs(model, batch)``: per-example tensors, gathered across processes; ``metrics(gathered)``: the
  evaluation's figures (``loss`` always); ``metric``: the headline one, with ``greater_is_better(name)``;
- ``notes(cfg, train_ds, eval_ds)``: lines for the plan about the prepared data (rows it dropped or truncated);
- ``sample(model, tokenizer, cfg, eval_ds)``: an optional human-readable sample for the log and summary (a generation);
- ``for_run(model, accelerator, cfg)``: the task as one run uses it: a copy holding the recipe's settings of its
  loss (language models' chunked loss) and what it needs beside the trained model (DPO's frozen reference, on the
  accelerator's device, which ``frozen_models()`` lists for the memory plan); the loop only ever calls the task.
- ``step(cfg)``: the optimizer step the loop runs (framework/step.py): supervised micro-batches with accumulation
  unless the task brings its own (online RL generates, scores, then updates);
- ``harness``: whether its model is a causal LM that lm-evaluation-harness can score (``eval.harness``).
"""

from __future__ import annotations

import importlib
from typing import Dict, List, Optional, Tuple

import datasets
import numpy as np
import torch
from huggingface_hub.errors import StrictDataclassError

from framework.step import Step, SupervisedStep

TASKS = ("text_classification", "causal_lm", "masked_lm", "sft", "dpo")
# What transformers raises on a model, config or tokenizer the user got wrong (a missing or damaged file, a
# size that does not divide, a config value of the wrong type: transformers 5 configs are strict dataclasses).
MODEL_ERRORS = (OSError, ValueError, TypeError, KeyError, StrictDataclassError)


class Task:
    name: str
    pipeline: str  # what model/ loads as in transformers.pipeline()
    metric: str  # the headline metric, printed at the end
    lower_is_better = ("loss", "perplexity")
    token_logits = False  # language models: logits over the vocabulary for every token (the memory plan counts them)
    reads: Tuple[str, ...] = ()  # the task-specific recipe keys (dotted) or sections it reads
    harness = False  # whether lm-evaluation-harness can score its model (eval.harness): causal language models
    sequences_per_example = 1  # rows each example puts through the model (DPO: its chosen and rejected sequences)

    def for_run(self, model: torch.nn.Module, accelerator, cfg) -> "Task":
        """The task for one run, given its model as loaded (adapters applied, not yet placed nor wrapped): itself,
        or a copy holding the recipe's loss settings and what the run needs beside the model (placed on
        ``accelerator.device``)."""
        return self

    def frozen_models(self) -> List[torch.nn.Module]:
        """Models this task holds on the device beside the trained one, never trained nor saved (the memory plan
        counts their weights)."""
        return []

    def check(self, cfg) -> List[str]:
        """Problems with the recipe keys this task reads, each naming its key."""
        return []

    def logits_chunk(self, model: torch.nn.Module) -> Optional[int]:
        """Tokens whose logits the loss holds at once (the memory plan counts them), None for all of them."""
        return None

    def columns(self, cfg) -> Dict[str, str]:
        """Recipe key -> column name, for every column a row must have."""
        raise NotImplementedError

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

    def targets(self, batch: Dict[str, torch.Tensor]):
        """What the batch's loss is normalised by (an int, or a device tensor for a count only the data knows)."""
        raise NotImplementedError

    def loss_sum(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def step(self, cfg) -> "Step":
        """The optimizer step the loop runs over each step's micro-batches."""
        return SupervisedStep()

    def eval_outputs(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def metrics(self, gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
        raise NotImplementedError

    def metric_names(self) -> Tuple[str, ...]:
        raise NotImplementedError

    def greater_is_better(self, name: str) -> bool:
        return name not in self.lower_is_better

    def notes(self, cfg, train_ds: Optional[datasets.Dataset], eval_ds: datasets.Dataset) -> List[str]:
        """Lines for the plan about the prepared data (rows dropped or truncated); ``train_ds`` is None for a stream."""
        return []

    def sample(self, model: torch.nn.Module, tokenizer, cfg, eval_ds: datasets.Dataset) -> Optional[Dict[str, str]]:
        """Something to read at the end of a run (a generation), logged and written into summary.json."""
        return None


def get_task(name: str) -> Task:
    return importlib.import_module(f"framework.tasks.{name}").TASK


def task_keys() -> Tuple[str, ...]:
    """Every task-specific key: those some task reads (the others are shared by all tasks)."""
    return tuple(dict.fromkeys(key for name in TASKS for key in get_task(name).reads))

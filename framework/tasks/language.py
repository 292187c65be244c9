"""What the language-model tasks share: their model keys (pretrained, or a config and a tokenizer), one text
column, the tokenizer, and the loss and metrics per target token (``LanguageModel``); per-row token losses.
The loss goes through framework/losses.py (the head and cross-entropy chunk by chunk) unless the recipe sets
``train.chunked_loss: false`` or the architecture is not one it is exact for. The causal LM tasks (causal_lm,
sft, dpo) and ``evaluate.py`` share the loading of a pretrained causal LM and the check that a model is one
(``pretrained_causal_config``, ``pretrained_causal_lm``, ``check_causal``)."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from framework import backend, hub, losses
from framework.errors import UserError
from framework.losses import IGNORE  # the target value cross-entropy skips: padding, nothing to predict
from framework.memory import Workload
from framework.tasks.base import MODEL_ERRORS, Task, TaskRun


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of every counted target (fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def token_outputs(logits: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """From full logits, per token: the loss (0 where ignored) and whether the argmax is the target."""
    token_losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                                   reduction="none").view(targets.shape)
    return token_losses, (logits.argmax(dim=-1) == targets) & (targets != IGNORE)


def row_outputs(token_losses: torch.Tensor, correct: torch.Tensor, targets: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per row: summed loss, counted targets and correct predictions (summed over rows and processes later,
    so every token weighs the same whatever its row)."""
    return {"loss_sum": token_losses.sum(dim=1), "targets": (targets != IGNORE).sum(dim=1),
            "correct": correct.sum(dim=1)}


def metrics(gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
    """Loss per target token, perplexity (its exponential), token accuracy, and the tokens counted."""
    targets = int(gathered["targets"].sum())
    loss = float(gathered["loss_sum"].sum(dtype=np.float64) / max(targets, 1))
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "accuracy": float(gathered["correct"].sum() / max(targets, 1)), "tokens": targets}


class LanguageModel(Task):
    """A task whose targets are tokens: its model keys (pretrained, or a config and a tokenizer), one text column, the
    tokenizer. Its run is a ``LanguageRun``."""

    metric = "perplexity"
    architectures = ""  # examples for messages, e.g. "gpt2, llama, ..."

    def check(self, cfg, strategy) -> List[str]:
        m, problems = cfg.model, []
        if not m.name_or_path and m.config is None:
            problems.append("model.name_or_path (a pretrained model) or model.config (a model to train from "
                            "scratch) is required")
        if m.config is not None:
            if not m.tokenizer:
                problems.append("model.tokenizer is required with model.config: the tokenizer to train with")
            if not isinstance(m.config.get("model_type"), str):
                problems.append(f"model.config.model_type is required ({self.architectures}): the architecture to build")
        return problems

    def metric_names(self):
        return ("loss", "perplexity", "accuracy")

    def columns(self, cfg) -> Dict[str, str]:
        return {"data.text_column": cfg.data.text_column}

    def keep_row(self, cfg):
        column = cfg.data.text_column
        return lambda row: row[column] is not None and bool(str(row[column]).strip())

    def tokenizer(self, cfg):
        """(tokenizer, the recipe key it came from): ``model.tokenizer``, else the pretrained model's."""
        m = cfg.model
        key, name = ("model.tokenizer", m.tokenizer) if m.tokenizer else ("model.name_or_path", m.name_or_path)
        try:
            return hub.from_pretrained(AutoTokenizer, name), key
        except MODEL_ERRORS as e:
            raise UserError(f"{key}: cannot load a tokenizer from '{name}': {str(e).splitlines()[0]}") from None

    def new_config(self, cfg, defaults: Dict):
        """The config of a model to train from scratch: ``model.config`` over ``defaults`` (from the tokenizer)."""
        try:
            return AutoConfig.for_model(**{**defaults, **cfg.model.config})
        except MODEL_ERRORS as e:
            raise UserError(f"model.config: cannot build a model config from {cfg.model.config}: "
                            f"{str(e).splitlines()[0]}") from None

    def from_config(self, auto, config):
        """``auto.from_config(config)``: a new model; the config's own validation (sizes that do not divide) is
        the user's to fix."""
        try:
            return auto.from_config(config)
        except MODEL_ERRORS as e:
            raise UserError(f"model.config: cannot build the model: {str(e).splitlines()[0]}") from None


class LanguageRun(TaskRun):
    """A language model's loss and evaluation per target token. Subclasses give ``inputs(model, batch) -> (model
    keyword arguments, targets)``, the targets aligned with the model's outputs, ``IGNORE`` where there is nothing to
    predict, and ``targets`` (the count, before the forward).

    ``loss_chunk``: tokens per chunk of the loss (``train.loss_chunk_tokens`` with ``train.chunked_loss``), None for
    full logits, which a head sharded by tensor parallelism or partitioned by ZeRO-3 outside its forward needs (its
    own forward gathers the logits); ``select_targets``: chunk only the target tokens (dynamic shapes: not on XLA).
    Without an ``accelerator`` (a loss computed outside a run): one process, dynamic shapes."""

    def __init__(self, task: Task, cfg, accelerator=None):
        super().__init__(task, cfg)
        whole_head = accelerator is not None and (backend.is_tensor_parallel(accelerator)
                                                  or backend.is_zero3(accelerator))
        self.loss_chunk = cfg.train.loss_chunk_tokens if cfg.train.chunked_loss and not whole_head else None
        self.select_targets = accelerator is None or not backend.needs_static_shapes(accelerator)

    def logits_chunk(self, model) -> Optional[int]:
        """Tokens whose logits the loss holds at once, None for all of them."""
        return self.loss_chunk if self.loss_chunk and losses.output_head(model) is not None else None

    def workload(self, model) -> Workload:
        return Workload(seq_length=self.task.sequence_length(self.cfg, model), token_logits=True,
                        logits_chunk=self.logits_chunk(model))

    def inputs(self, model, batch) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        raise NotImplementedError

    def forward(self, model, batch):
        """(the model's full logits, targets)."""
        inputs, targets = self.inputs(model, batch)
        return model(**inputs).logits, targets

    def _outputs(self, model, batch):
        """(hidden states, the head to apply to them, targets) with a chunked loss, else (logits, None, targets)."""
        inputs, targets = self.inputs(model, batch)
        head = losses.output_head(model) if self.loss_chunk else None
        if head is None:
            return model(**inputs).logits, None, targets
        out, called = losses.hidden_states(model, head, **inputs)
        return out, head if called else None, targets

    def loss_sum(self, model, batch) -> torch.Tensor:
        out, head, targets = self._outputs(model, batch)
        if head is None:
            return loss_sum(out, targets)
        return losses.linear_cross_entropy(out, head, targets, self.loss_chunk, self.select_targets)

    def token_results(self, model, batch) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token: (loss, whether the argmax is the target, the target), chunk by chunk with a chunked loss."""
        out, head, targets = self._outputs(model, batch)
        if head is None:
            return (*token_outputs(out, targets), targets)
        return (*losses.token_outputs(out, head, targets, self.loss_chunk, self.select_targets), targets)

    def eval_outputs(self, model, batch) -> Dict[str, torch.Tensor]:
        return row_outputs(*self.token_results(model, batch))

    def metrics(self, gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
        return metrics(gathered)


def pretrained_causal_config(m):
    """The config of the pretrained model ``m.name_or_path`` (the recipe's ``model`` section), with
    ``m.config_overrides`` set on it, checked to be a causal LM's; None for a model trained from ``m.config``."""
    if m.config is not None:
        return None
    try:
        config = hub.from_pretrained(AutoConfig, m.name_or_path)
    except MODEL_ERRORS as e:
        raise UserError(f"model.name_or_path: cannot load '{m.name_or_path}': {str(e).splitlines()[0]}") from None
    overrides = m.config_overrides or {}
    unknown = [key for key in overrides if not hasattr(config, key)]
    if unknown:  # a misspelt attribute would otherwise be stored and silently ignored
        raise UserError(f"model.config_overrides: {', '.join(unknown)}: not an attribute of the {config.model_type} "
                        f"config of '{m.name_or_path}'; remove it or correct its name")
    for key, value in overrides.items():
        setattr(config, key, value)
    check_causal(config, f"model.name_or_path: '{m.name_or_path}'")
    return config


def pretrained_causal_lm(m, config):
    """The pretrained causal LM of the recipe's ``model`` section, with its config (``pretrained_causal_config``)."""
    try:
        return hub.from_pretrained(AutoModelForCausalLM, m.name_or_path, config=config)
    except MODEL_ERRORS as e:
        raise UserError(f"model.name_or_path: cannot load '{m.name_or_path}' as a causal language model: "
                        f"{str(e).splitlines()[0]}") from None


def check_causal(config, what: str) -> None:
    """Causal LMs only: encoders (BERT-like, which also have a decoder head in transformers) would attend to
    future tokens unless configured as decoders."""
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
            config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)):
        raise UserError(f"{what} is not a causal language model (an encoder or another kind); use task: causal_lm "
                        "with a decoder (gpt2, llama, ...), or task: masked_lm for an encoder")


"""What the language-model tasks share: their model keys (pretrained, or a config and a tokenizer), one text
column, the tokenizer, and the loss and metrics per target token (``LanguageModel``); per-row token losses."""

from __future__ import annotations

import math
from typing import Dict, List

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoTokenizer

from framework.errors import UserError
from framework.tasks import MODEL_ERRORS, Task

IGNORE = -100  # the target value cross-entropy skips: padding, and positions with nothing to predict


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of every counted target (fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def row_outputs(logits: torch.Tensor, targets: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per row: summed loss, counted targets and correct predictions (summed over rows and processes later,
    so every token weighs the same whatever its row)."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                             reduction="none").view(targets.shape)
    counted = targets != IGNORE
    return {"loss_sum": losses.sum(dim=1), "targets": counted.sum(dim=1),
            "correct": ((logits.argmax(dim=-1) == targets) & counted).sum(dim=1)}


def metrics(gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
    """Loss per target token, perplexity (its exponential), token accuracy, and the tokens counted."""
    targets = int(gathered["targets"].sum())
    loss = float(gathered["loss_sum"].sum(dtype=np.float64) / max(targets, 1))
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "accuracy": float(gathered["correct"].sum() / max(targets, 1)), "tokens": targets}


class LanguageModel(Task):
    """A task whose targets are tokens. Subclasses give ``forward(model, batch) -> (logits, targets)``, with
    ``IGNORE`` where there is nothing to predict, and ``targets`` (the count, before the forward)."""

    metric = "perplexity"
    token_logits = True
    architectures = ""  # examples for messages, e.g. "gpt2, llama, ..."

    def check(self, cfg) -> List[str]:
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
            return AutoTokenizer.from_pretrained(name), key
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

    def forward(self, model, batch):
        raise NotImplementedError

    def loss_sum(self, model, batch) -> torch.Tensor:
        return loss_sum(*self.forward(model, batch))

    def eval_outputs(self, model, batch) -> Dict[str, torch.Tensor]:
        return row_outputs(*self.forward(model, batch))

    def metrics(self, gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
        return metrics(gathered)

"""A task defined outside framework/, as a user would write one (docs/adding-a-task.md): regression of a number
from a text, on a pretrained encoder with a one-output head, trained on the mean squared error.

A recipe names it ``task: tests/toy_task.py:ToyTask``. Its own section, ``toy:``, has one column key
(``toy.target_column``) and one option (``toy.scale``: the targets are multiplied by it); its eval metrics are
the loss (the mean squared error) and ``mae``; report.html gets its section of figures. What it declares is
``ToyTask``; what a run binds, its loss and evaluation, ``ToyRun``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from framework import data
from framework.errors import UserError
from framework.tasks import MODEL_ERRORS, ReportSection, Task, TaskRun

TARGETS = "labels"  # the column the collator pads alongside the tokens


@dataclass
class ToyConfig:
    """The toy regression task (``task: tests/toy_task.py:ToyTask``)."""

    target_column: str = "score"
    """The column holding each row's number."""
    scale: float = field(default=1.0, metadata={"gt": 0.0})
    """The targets are the column's numbers times this."""


class ToyTask(Task):
    pipeline = "text-classification"
    metric = "mae"
    lower_is_better = ("loss", "mae")
    options = ("toy", ToyConfig)
    reads = ("data.max_length", "toy")

    def check(self, cfg, strategy) -> List[str]:
        problems = []
        if not cfg.model.name_or_path:
            problems.append("model.name_or_path is required: the toy task fine-tunes a pretrained encoder")
        if cfg.toy.scale > 1000:
            problems.append(f"toy.scale: {cfg.toy.scale} is too large for a toy; use at most 1000")
        return problems

    def metric_names(self):
        return ("loss", "mae")

    def columns(self, cfg) -> Dict[str, str]:
        return {"data.text_column": cfg.data.text_column, "toy.target_column": cfg.toy.target_column}

    def load(self, cfg, train, evaluation):
        name = cfg.model.name_or_path
        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or name)
            model = AutoModelForSequenceClassification.from_pretrained(  # a classifier's head becomes one output
                name, num_labels=1, problem_type="regression", ignore_mismatched_sizes=True)
        except MODEL_ERRORS as e:
            raise UserError(f"model.name_or_path: cannot load '{name}': {str(e).splitlines()[0]}") from None
        return model, tokenizer

    def prepare(self, ds, tokenizer, model, cfg):
        d, toy = cfg.data, cfg.toy

        def encode(batch):
            features = tokenizer([str(t) for t in batch[d.text_column]], truncation=True, max_length=d.max_length)
            features[TARGETS] = [float(v) * toy.scale for v in batch[toy.target_column]]
            return features

        return data.map_rows(ds, encode, (data.tokenizer_identity(tokenizer), d.max_length, d.text_column,
                                          toy.target_column, toy.scale), "Tokenizing")

    def collator(self, tokenizer, cfg, buckets, rows=None):
        return data.collator(tokenizer, buckets, rows)

    def bind(self, cfg, model, accelerator) -> "ToyRun":
        return ToyRun(self, cfg)

    def report_sections(self, output_dir, summary, plots_dir) -> List[ReportSection]:
        evaluation = summary.get("eval") or {}
        return [ReportSection("Toy regression (eval)", ["figure", "value"],
                              [(k, evaluation[k]) for k in ("mae", "examples") if k in evaluation])]


class ToyRun(TaskRun):
    """The mean squared error of one run's predictions."""

    def targets(self, batch: Dict[str, torch.Tensor]) -> int:
        return batch[TARGETS].shape[0]

    def _predictions(self, model, batch) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != TARGETS}
        return model(**inputs).logits.float().squeeze(-1)

    def loss_sum(self, model, batch) -> torch.Tensor:
        return F.mse_loss(self._predictions(model, batch), batch[TARGETS].float(), reduction="sum")

    def eval_outputs(self, model, batch) -> Dict[str, torch.Tensor]:
        predictions = self._predictions(model, batch)
        targets = batch[TARGETS].float()
        return {"predictions": predictions, "targets": targets,
                "loss": F.mse_loss(predictions, targets, reduction="none")}

    def metrics(self, gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
        errors = gathered["predictions"].astype(np.float64) - gathered["targets"]
        return {"loss": float(np.mean(gathered["loss"], dtype=np.float64)), "mae": float(np.mean(np.abs(errors))),
                "examples": int(len(errors))}

"""Sequence classification with ``AutoModelForSequenceClassification``: accuracy, macro F1, and per class
precision, recall, F1 and the confusion matrix.

Recipe keys: ``data.text_column``, ``data.text_pair_column``, ``data.label_column``, ``data.labels``,
``data.max_length``; the model is pretrained (``model.name_or_path``). The loss is normalised by examples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from framework import data, hub, plots
from framework.errors import UserError
from framework.tasks.base import MODEL_ERRORS, ReportSection, Task, TaskRun, register

LABELS = "labels"  # the column transformers models read the targets from


@register("text_classification")
class TextClassification(Task):
    pipeline = "text-classification"
    peft_task_type = "SEQ_CLS"
    metric = "accuracy"
    reads = ("data.text_pair_column", "data.label_column", "data.labels", "data.max_length")

    def check(self, cfg, strategy) -> List[str]:
        problems = []
        if not cfg.model.name_or_path:
            problems.append("model.name_or_path is required: text_classification fine-tunes a pretrained model")
        if cfg.model.config is not None:
            problems.append("model.config: text_classification fine-tunes a pretrained model; use model.name_or_path")
        if cfg.data.streaming and not cfg.data.labels:
            problems.append("data.labels is required with data.streaming: the label set (and the model's head) "
                            "must be known before the stream is read, e.g. data.labels=[negative,positive]")
        if cfg.data.labels is not None and len(set(cfg.data.labels)) < 2:
            problems.append(f"data.labels: {cfg.data.labels} must name at least two distinct labels")
        return problems

    def metric_names(self):
        return ("loss", "accuracy", "f1")

    def columns(self, cfg) -> Dict[str, str]:
        d = cfg.data
        wanted = {"data.text_column": d.text_column, "data.label_column": d.label_column}
        if d.text_pair_column:
            wanted["data.text_pair_column"] = d.text_pair_column
        return wanted

    def keep_row(self, cfg):
        """Rows with a label (one of ``data.labels`` when set) and non-empty texts."""
        d = cfg.data
        texts = [c for c in (d.text_column, d.text_pair_column) if c]
        keep = set(d.labels) if d.labels else None

        def usable(row: Dict) -> bool:
            if row[d.label_column] is None or any(row[c] is None or not str(row[c]).strip() for c in texts):
                return False
            return keep is None or str(row[d.label_column]) in keep
        return usable

    def load(self, cfg, train: datasets.Dataset, evaluation: datasets.Dataset):
        label_names = _label_names(train, evaluation, cfg.data)
        name = cfg.model.name_or_path
        try:
            tokenizer = hub.from_pretrained(AutoTokenizer, cfg.model.tokenizer or name)
            model = hub.from_pretrained(
                AutoModelForSequenceClassification, name,
                num_labels=len(label_names),
                id2label=dict(enumerate(label_names)),
                label2id={label: i for i, label in enumerate(label_names)},
                # Set now rather than by the first forward: a config changed after the first step would make
                # torch.compile recompile the model.
                problem_type="single_label_classification",
                # A checkpoint fine-tuned on other labels gets a fresh head of the right size.
                ignore_mismatched_sizes=True,
            )
        except MODEL_ERRORS as e:
            raise UserError(f"model.name_or_path: cannot load '{name}' for text_classification: "
                            f"{str(e).splitlines()[0]}") from None
        data.check_length("data.max_length", cfg.data.max_length, tokenizer, model)
        return model, tokenizer

    def prepare(self, ds: datasets.Dataset, tokenizer, model, cfg) -> datasets.Dataset:
        """Label ids, then tokens with truncation and no padding (the collator pads)."""
        d = cfg.data
        to_id = model.config.label2id
        columns = [d.text_column] + ([d.text_pair_column] if d.text_pair_column else [])

        def encode(batch):
            features = tokenizer(*[[str(t) for t in batch[c]] for c in columns], truncation=True,
                                 max_length=d.max_length)
            features[LABELS] = [to_id[str(v)] for v in batch[d.label_column]]
            return features

        return data.map_rows(ds, encode, (data.tokenizer_identity(tokenizer), d.max_length, columns, d.label_column,
                                          sorted(to_id.items())), "Tokenizing")

    def collator(self, tokenizer, cfg, buckets, rows=None):
        return data.collator(tokenizer, buckets, rows)

    def bind(self, cfg, model, accelerator) -> "ClassificationRun":
        return ClassificationRun(self, cfg)

    def report_sections(self, output_dir: Path, summary: Dict, plots_dir: Path) -> List[ReportSection]:
        """Precision, recall and F1 per class, and the confusion matrix, the classes by name."""
        evaluation = summary.get("eval") or {}
        per_class, matrix = evaluation.get("per_class"), evaluation.get("confusion_matrix")
        if not per_class:
            return []
        names = class_names(output_dir, len(per_class))
        rows = [(names[int(c)], v["precision"], v["recall"], v["f1"], v["support"]) for c, v in per_class.items()]
        drawn = [plots.confusion(matrix, class_names(output_dir, len(matrix)), plots_dir / "confusion.png")] if matrix \
            else []
        return [ReportSection("Classes (eval)", ["class", "precision", "recall", "f1", "support"], rows, drawn)]


class ClassificationRun(TaskRun):
    """The loss (cross-entropy, summed over examples) and the evaluation of one run."""

    def targets(self, batch: Dict[str, torch.Tensor]) -> int:
        return batch[LABELS].shape[0]

    def loss_sum(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(**{k: v for k, v in batch.items() if k != LABELS}).logits
        return F.cross_entropy(logits.float(), batch[LABELS], reduction="sum")

    def eval_outputs(self, model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        logits = model(**{k: v for k, v in batch.items() if k != LABELS}).logits.float()
        labels = batch[LABELS]
        return {
            "predictions": logits.argmax(dim=-1),
            "labels": labels,
            "loss": F.cross_entropy(logits, labels, reduction="none"),
        }

    def metrics(self, gathered: Dict[str, np.ndarray]) -> Dict[str, object]:
        """Loss, accuracy and macro F1 (over the classes present), the examples, and per class (by label id, 0 up
        to the largest id seen): precision, recall, F1 and support, and the confusion matrix (rows: the true
        class, columns: the predicted one). A class never predicted has precision 0, as scikit-learn gives it."""
        preds, labels = gathered["predictions"], gathered["labels"]
        classes = int(max(preds.max(), labels.max())) + 1
        confusion = np.zeros((classes, classes), dtype=np.int64)
        np.add.at(confusion, (labels, preds), 1)
        tp = np.diag(confusion)
        predicted, support = confusion.sum(axis=0), confusion.sum(axis=1)
        precision = np.divide(tp, predicted, out=np.zeros(classes), where=predicted > 0)
        recall = np.divide(tp, support, out=np.zeros(classes), where=support > 0)
        # 2tp / (2tp + fp + fn): 0 for a class with no true or predicted example (none are counted in the mean).
        f1 = np.divide(2 * tp, predicted + support, out=np.zeros(classes), where=predicted + support > 0)
        present = (predicted + support) > 0
        return {
            "loss": float(np.mean(gathered["loss"], dtype=np.float64)),
            "accuracy": float(np.mean(preds == labels)),
            "f1": float(np.mean(f1[present])),
            "examples": int(len(labels)),
            "per_class": {str(c): {"precision": float(precision[c]), "recall": float(recall[c]), "f1": float(f1[c]),
                                   "support": int(support[c])} for c in range(classes)},
            "confusion_matrix": confusion.tolist(),
        }


def class_names(output_dir: Path, count: int) -> List[str]:
    """Class id -> name, from the saved model's ``id2label`` (the ids themselves where it has none)."""
    config = output_dir / "model" / "config.json"
    names = (json.loads(config.read_text()) if config.is_file() else {}).get("id2label") or {}
    return [str(names.get(str(i), i)) for i in range(count)]


def _label_names(train: datasets.Dataset, evaluation: datasets.Dataset, d) -> List[str]:
    """Label id -> name: ``data.labels`` in its order, else the sorted values (integers: 0..max)."""
    if d.labels:
        return list(d.labels)
    values = set(train.unique(d.label_column))
    if len(values) < 2:
        raise UserError(f"data.label_column '{d.label_column}' has a single class {values} in the training data; "
                        "classification needs at least two")
    unseen = set(evaluation.unique(d.label_column)) - values
    if unseen:
        raise UserError(f"the eval data has labels {sorted(map(str, unseen))} that the training data lacks")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise UserError(f"data.label_column '{d.label_column}': integer labels must be >= 0, found {min(values)}")
        return [str(i) for i in range(max(values) + 1)]
    return sorted(str(v) for v in values)


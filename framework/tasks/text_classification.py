"""Sequence classification with ``AutoModelForSequenceClassification``: accuracy and macro F1."""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from framework.config import ModelConfig
from framework.errors import UserError


def load(cfg: ModelConfig, label_names: List[str]):
    label2id = {name: i for i, name in enumerate(label_names)}
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.name_or_path)
        model = AutoModelForSequenceClassification.from_pretrained(
            cfg.name_or_path,
            num_labels=len(label_names),
            id2label=dict(enumerate(label_names)),
            label2id=label2id,
            # Set now rather than by the first forward: a config changed after the first step would make
            # torch.compile recompile the model.
            problem_type="single_label_classification",
            # A checkpoint fine-tuned on other labels gets a fresh head of the right size.
            ignore_mismatched_sizes=True,
        )
    except (OSError, ValueError) as e:
        raise UserError(f"model.name_or_path: cannot load '{cfg.name_or_path}': {str(e).splitlines()[0]}") from None
    return model, tokenizer


def train_loss(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def eval_outputs(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    logits = model(**batch).logits.float()
    labels = batch["labels"]
    return {
        "predictions": logits.argmax(dim=-1),
        "labels": labels,
        "loss": F.cross_entropy(logits, labels, reduction="none"),
    }


def metrics(gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
    preds, labels = gathered["predictions"], gathered["labels"]
    classes = np.union1d(preds, labels)
    f1s = []
    for c in classes:
        tp = np.sum((preds == c) & (labels == c))
        fp = np.sum((preds == c) & (labels != c))
        fn = np.sum((preds != c) & (labels == c))
        f1s.append(2 * tp / (2 * tp + fp + fn))
    return {
        "loss": float(np.mean(gathered["loss"], dtype=np.float64)),
        "accuracy": float(np.mean(preds == labels)),
        "f1": float(np.mean(f1s)),
        "examples": int(len(labels)),
    }

"""Tasks: one module each, exposing the same four functions.

- ``load(model_cfg, label_names) -> (model, tokenizer)``
- ``train_loss(model, batch) -> loss`` (a scalar tensor, mean over the batch)
- ``eval_outputs(model, batch) -> dict`` of per-example tensors to gather across processes
- ``metrics(gathered) -> dict`` of floats from the gathered per-example tensors
"""

from __future__ import annotations

import importlib
from types import ModuleType


def get_task(name: str) -> ModuleType:
    return importlib.import_module(f"framework.tasks.{name}")

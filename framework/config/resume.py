"""Which recipe keys a resumed run may change: those that cannot change the weights it trains, and those of its
layout (the strategy, the processes' share of the batch), which framework/resharding.py checks instead: a resume on
another layout keeps the checkpoint's effective batch. Every other key changes the training trajectory, and a
resume with a different value is refused (framework/checkpoint.py)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from framework.config.loading import flatten, show, to_dict
from framework.config.schema import RunConfig

# Keys a resumed run may change (printed as notes on resume).
RESUME_FREE_KEYS = ("output_dir", "overwrite", "report_to", "report.enabled", "report.every_minutes", "model.token",
                    "data.num_workers", "train.log_every", "train.eval_batch_size", "train.cpu_threads",
                    "train.profile_steps", "distributed.timeout_minutes", "checkpoint.every_steps",
                    "checkpoint.every_epoch", "checkpoint.every_minutes", "checkpoint.keep_last", "checkpoint.resume",
                    # The layout: how the processes share the work (resharding.py keeps the effective batch).
                    "distributed.strategy", "distributed.tensor_parallel", "distributed.num_processes",
                    "train.batch_size", "train.gradient_accumulation_steps")
# Free only while no metric picks the best model or stops early: then evaluation points decide the result.
RESUME_FREE_WITHOUT_METRIC = ("eval.every_steps",)
# The harness reads the model and leaves the random state alone, and exports are written from the finished model:
# their keys never change what is trained. The strategies' own settings are the layout's.
RESUME_FREE_PREFIXES = ("eval.harness", "export.", "distributed.fsdp.", "distributed.deepspeed.")


def differences(old: Dict[str, Any], cfg: RunConfig) -> Tuple[List[str], List[str]]:
    """Compare a checkpoint's recipe (flattened, every key of today's schema present) with ``cfg``. Returns
    (differences that change the training trajectory, differences that cannot), each 'key: old -> new'."""
    new = flatten(to_dict(cfg))
    free = RESUME_FREE_KEYS + (RESUME_FREE_WITHOUT_METRIC if cfg.eval.metric is None else ())
    changed, harmless = [], []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            line = f"{key}: {show(old.get(key))} -> {show(new.get(key))}"
            (harmless if key in free or key.startswith(RESUME_FREE_PREFIXES) else changed).append(line)
    return changed, harmless

"""EleutherAI's lm-evaluation-harness on a causal language model held in memory: the run's model at the end of
training and every ``eval.harness.every_steps`` (framework/train.py), or a finished run's ``model/``
(``python -m framework.evaluate``).

The model goes through the harness's own Hugging Face wrapper (``lm_eval.models.huggingface.HFLM``, given the
model object and its tokenizer); an adapted model goes as the peft model, whose forward adds the adapters (what
the merged model computes). Tasks are found by name in ``framework/harness_tasks`` (local task files over data
``make install`` writes to ``assets/harness``), in ``eval.harness.include_path``, then among lm-eval's own tasks,
which read their data from the Hub: offline, those are refused before any work, naming them and the fix.

In a run of several processes every process runs the harness on the same requests (world size one each), as
they generate the final sample together: a sharded model (FSDP, DeepSpeed ZeRO-3) needs every process in each
forward pass; only the main process writes the results. lm-eval is imported only when a harness runs (5 s).
"""

from __future__ import annotations

import logging
import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import numpy as np
import torch

from framework import hub
from framework.config import HarnessConfig
from framework.errors import UserError

LOCAL_TASKS = Path(__file__).resolve().parent / "harness_tasks"  # TASK.yaml reads LOCAL_DATA/TASK.jsonl
LOCAL_DATA = Path(__file__).resolve().parents[1] / "assets" / "harness"  # written by tools/assets.py
PREFIX = "harness/"  # metrics.jsonl and tracker keys: harness/TASK/METRIC


class Harness:
    """The tasks of one ``HarnessConfig``, found and checked once (at setup), run as often as asked."""

    def __init__(self, cfg: HarnessConfig, seed: int,
                 keys: Tuple[str, str] = ("eval.harness.tasks", "eval.harness.include_path")):
        """``keys``: what the user set the task names and the task folders with, for messages."""
        self.cfg, self.seed, self.keys = cfg, seed, keys
        self.manager = task_manager(cfg.tasks, cfg.include_path, keys)

    def due(self, step: int) -> bool:
        return bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0

    def evaluate(self, model: torch.nn.Module, tokenizer) -> Dict[str, object]:
        """Run the tasks on ``model``: {tasks: {task: {metric: value, samples: n}}, seconds, num_fewshot, limit,
        lm_eval}. The model is put back in the mode it was in; the random states are left as they were."""
        import lm_eval
        from lm_eval import evaluator
        from lm_eval.models.huggingface import HFLM

        start, was_training = time.perf_counter(), model.training
        with _quiet(), _random_states_kept():
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=self.cfg.batch_size)
            try:
                out = evaluator.simple_evaluate(
                    model=lm, tasks=list(self.cfg.tasks), num_fewshot=self.cfg.num_fewshot, limit=self.cfg.limit,
                    task_manager=self.manager, log_samples=False, random_seed=None, numpy_random_seed=None,
                    torch_random_seed=None, fewshot_random_seed=self.seed)
            except FileNotFoundError as e:  # a local task's data is missing (assets/harness)
                raise UserError(f"{self.keys[0]}: {e}") from None
        model.train(was_training)
        tasks = {}
        for name, values in out["results"].items():
            # lm-eval's keys are METRIC,FILTER; the unfiltered ones (",none") keep the metric's name alone.
            figures = {metric.removesuffix(",none"): float(value) for metric, value in values.items()
                       if isinstance(value, (int, float)) and metric != "sample_len"}
            samples = out.get("n-samples", {}).get(name)
            tasks[name] = {**figures, **({"samples": samples["effective"]} if samples else {})}
        return {"tasks": tasks, "seconds": time.perf_counter() - start, "num_fewshot": self.cfg.num_fewshot,
                "limit": self.cfg.limit, "lm_eval": lm_eval.__version__}


def scalars(result: Dict[str, object]) -> Dict[str, float]:
    """A result as flat numbers for metrics.jsonl and the trackers: harness/TASK/METRIC, harness/seconds."""
    flat = {f"{PREFIX}{task}/{metric}": value for task, figures in result["tasks"].items()
            for metric, value in figures.items()}
    return {**flat, f"{PREFIX}seconds": result["seconds"]}


def task_manager(tasks: List[str], include_path: List[str], keys: Tuple[str, str]):
    """lm-eval's TaskManager over the local task folders, or over lm-eval's own tasks too when a name is not
    local (indexing their 15,000 files takes 10-20 s). Unknown names and, offline, names of tasks whose data
    is on the Hub raise one UserError naming them and the fix."""
    from lm_eval.tasks import TaskManager

    key, folders_key = keys
    folders = [LOCAL_TASKS]
    for folder in map(Path, include_path):
        if not folder.is_dir():
            raise UserError(f"{folders_key}: folder {folder} does not exist (relative paths start at "
                            f"{Path.cwd()}); pass a folder of lm-eval task YAML files")
        folders.append(folder)
    for name in tasks:  # the shipped tasks' rows (TASK.jsonl, by TASK.yaml): checked now, not at the run's end
        data = LOCAL_DATA / f"{name}.jsonl"
        if (LOCAL_TASKS / f"{name}.yaml").is_file() and not data.is_file():
            raise UserError(f"{key}: {name}'s rows {data} are missing; run `make install` (or "
                            "`python tools/assets.py assets`)")
    local = TaskManager(include_path=[str(f) for f in folders], include_defaults=False)
    missing = [t for t in tasks if t not in local.all_tasks]
    if not missing:
        return local
    every = TaskManager(include_path=[str(f) for f in folders], include_defaults=True)
    known = ", ".join(local.all_subtasks)
    unknown = [t for t in missing if t not in every.all_tasks]
    problems = []
    if unknown:
        verb = "is not an lm-eval task" if len(unknown) == 1 else "are not lm-eval tasks"
        problems.append(f"{key}: {_names(unknown)} {verb} (local tasks: {known}); check the name, or add the folder "
                        f"of its task YAML file to {folders_key}")
    reason = hub.hub_unreachable()
    on_hub = [t for t in missing if t not in unknown]
    if on_hub and reason:
        problems.append(f"{key}: {_names(on_hub)} {'reads its' if len(on_hub) == 1 else 'read their'} data from the "
                        f"Hugging Face Hub and {reason}; use a local task ({known}) or write one (a task YAML "
                        f"file over local data) into a folder of {folders_key}, or set HF_HUB_OFFLINE=1 "
                        "with the dataset in the Hugging Face cache")
    if problems:
        raise UserError("; ".join(problems))
    return every


def _names(names: List[str]) -> str:
    return ", ".join(repr(n) for n in names)


@contextmanager
def _random_states_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's CPU generators as they were: a harness during training never shifts dropout
    or the data order (lm-eval seeds its few-shot sampler with a generator of its own)."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


@contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's per-call warnings (an in-memory model ignores its loading options) off while it runs."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def format_result(result: Dict[str, object]) -> str:
    """One line per task: its figures."""
    lines = []
    for task, figures in result["tasks"].items():
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
        lines.append(f"harness {task}: {shown}")
    return "\n".join(lines + [f"harness: {result['seconds']:.1f} s"])


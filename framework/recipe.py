"""The recipe layer, above the schema (framework/config/) and the tasks (framework/tasks/): the schema a recipe is
checked against, the core sections plus each registered task's own (``Task.options``), and a recipe loaded with
every check at once: types, the core keys' rules, the task's own (``Task.check``, with the strategy the recipe and
the launch give, so a combination the task refuses stops the run before anything is loaded), the adapters',
columns named twice, keys the task does not read, and renamed keys. Every problem is collected and reported
together, each naming its dotted key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from framework import adapters, backend, export
from framework.config import loading, renamed, resume, validation
from framework.config.checks import cross_checks
from framework.config.schema import RunConfig, with_sections
from framework.errors import UserError
from framework.tasks import get_task, registered, sections, task_keys


def schema() -> type:
    """The recipe's schema: RunConfig with one more section for each registered task's options."""
    return with_sections(tuple(sections().items()))


def load_config(path: Optional[str | Path], overrides: List[str]) -> RunConfig:
    """Load a recipe (with its ``extends`` chain), apply ``KEY=VALUE`` overrides, validate, and return it."""
    data, templates = loading.read(path, overrides)
    name = data.get("task", RunConfig.task)
    if isinstance(name, str) and ":" in name:
        get_task(name)  # a task outside the framework: loaded and registered (its section joins the schema), or refused
    problems = []
    if isinstance(name, str) and name in registered() and get_task(name).moved_from_data:
        task = get_task(name)
        problems += renamed.move(data, task.options[0], task.moved_from_data)
    cfg, built = validation.build(schema(), data)
    cfg.env_templates = templates
    problems += built + cross_checks(cfg) + _task_checks(cfg) + _export_checks(cfg) + _unread_keys(cfg.task, data)
    if problems:
        where = f"recipe {path}" if path is not None else "recipe"
        raise UserError(f"{where} has {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    return cfg


def resume_differences(saved: Dict[str, Any], cfg: RunConfig) -> Tuple[List[str], List[str]]:
    """Compare the recipe a checkpoint was trained with (``config.to_dict`` output) with ``cfg``: (differences that
    change the training trajectory, differences that cannot). Keys the saved recipe lacks (added to the schema
    since) count as their defaults; keys that moved since are read under their new names."""
    tasks = [get_task(name) for name in registered()]
    moves = [(t.options[0], t.moved_from_data) for t in tasks if t.moved_from_data]
    own = [(t.options[0], t.moved_from_data) for t in tasks if t.moved_from_data and t.name == saved.get("task")]
    old = {**loading.flatten(loading.to_dict(schema()())), **renamed.saved(loading.flatten(saved), own, moves)}
    return resume.differences(old, cfg)


def _task_checks(cfg: RunConfig) -> List[str]:
    """The task's own checks and those of how it meets the rest of the recipe: the strategy (as the launch resolves
    it), the adapters, the columns, the metric, the harness."""
    if cfg.task not in registered():
        return [f"task: {cfg.task!r} is not a task; use one of {', '.join(registered())}"]
    task = get_task(cfg.task)
    strategy = backend.planned_strategy(cfg)
    problems = task.check(cfg, strategy) + adapters.check(cfg, strategy)
    by_column: Dict[str, List[str]] = {}
    for key, column in task.columns(cfg).items():
        by_column.setdefault(column, []).append(key)
    problems += [f"{' and '.join(keys)} name the same column {column!r}; each must name its own column"
                 for column, keys in by_column.items() if len(keys) > 1]
    if cfg.eval.metric is not None and cfg.eval.metric not in task.metric_names():
        problems.append(f"eval.metric: {cfg.eval.metric!r} is not a metric of {cfg.task}; use one of "
                        f"{', '.join(task.metric_names())}")
    if cfg.eval.harness is not None and not task.harness:
        problems.append(f"eval.harness: lm-evaluation-harness scores causal language models, not {cfg.task}; "
                        "remove eval.harness")
    return problems


def _export_checks(cfg: RunConfig) -> List[str]:
    """``export.gguf``: types the GGUF writer has, for a task whose model it writes (a causal LM), of a model type and
    with a tokenizer it maps where the recipe names them locally (framework/export.py; the rest is checked when the
    file is written, at the end of the run)."""
    if not cfg.export.gguf or cfg.task not in registered():
        return []
    problems = []
    for name in cfg.export.gguf:
        try:
            export.kind_of(name, "export.gguf")
        except UserError as e:
            problems.append(str(e))
    pipeline = getattr(get_task(cfg.task), "pipeline", None)
    if pipeline != "text-generation":
        return problems + [f"export.gguf: GGUF files hold causal language models, and {cfg.task} trains a "
                           f"{pipeline or 'other'} model; remove export.gguf"]
    m = cfg.model
    model_type = m.config.get("model_type") if m.config is not None else _local_model_type(m.name_or_path)
    tokenizer = m.tokenizer or m.name_or_path
    folder = Path(tokenizer) if tokenizer and Path(tokenizer).is_dir() else None
    return problems + export.recipe_problems(model_type, folder)


def _local_model_type(name: Optional[str]) -> Optional[str]:
    """The model_type of a local model folder's config.json; None for anything else (a Hub id, a GGUF file)."""
    config = Path(name) / "config.json" if name else None
    if config is None or not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def _unread_keys(task_name: str, data: Dict[str, Any]) -> List[str]:
    """Task-specific keys (``Task.reads`` of any task) that the recipe sets, to something else than their default,
    but its task does not read: a setting that would be silently ignored. (A key at its default is let through:
    ``--print-config`` and config.yaml write every key, and must load again.)"""
    if task_name not in registered():
        return []
    reads = get_task(task_name).reads
    defaults = loading.flatten(dataclasses.asdict(schema()()))
    present = {key for key, value in loading.flatten(data).items() if value is not None and value != defaults.get(key)}
    return [f"{key}: {task_name} does not read it (it reads {', '.join(reads) or 'none of these keys'}); remove it"
            for key in task_keys() if key not in reads and any(p == key or p.startswith(key + ".") for p in present)]

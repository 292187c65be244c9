"""Rules of the core recipe keys that involve more than one key (a task's own keys are its ``check``, run with
these by framework/recipe.py). Each problem names its key."""

from __future__ import annotations

import re
from typing import List

from framework.config.schema import RunConfig
from framework.trackers import TRACKER_PACKAGES


def cross_checks(cfg: RunConfig) -> List[str]:
    """The problems of the core keys taken together."""
    return _data(cfg) + _model(cfg) + _distributed(cfg) + _train_and_eval(cfg) + _optim(cfg)


def _data(cfg: RunConfig) -> List[str]:
    problems = []
    d = cfg.data
    if d.sources:
        if d.train_file or d.dataset:
            problems.append("data.sources replaces data.train_file and data.dataset; remove those")
        for i, source in enumerate(d.sources):
            if bool(source.train_file) == bool(source.dataset):
                problems.append(f"data.sources[{i}]: set train_file (files) or dataset (a Hub dataset), one of them")
    elif not d.train_file and not d.dataset:
        problems.append("data.train_file is required (or data.dataset for a Hub dataset, or data.sources for a mix)")
    if d.train_file and d.dataset:
        problems.append("set data.train_file or data.dataset, not both")
    if d.streaming:
        if cfg.train.max_steps is None:
            problems.append("train.max_steps is required with data.streaming: a stream's length is unknown "
                            "until it is read, so runs are sized in optimizer steps")
        if d.num_workers:
            problems.append("data.num_workers: a stream is read in the training process (so that checkpoints "
                            "hold its exact position); set data.num_workers=0")
        if d.group_by_length:
            problems.append("data.group_by_length: a stream has no lengths to sort by; remove it or set "
                            "data.streaming=false")
        if cfg.checkpoint.every_epoch:
            problems.append("checkpoint.every_epoch: with data.streaming each process ends its epochs at its "
                            "own step; use checkpoint.every_steps")
    if d.pad_buckets is not None and (not d.pad_buckets or any(b <= 0 for b in d.pad_buckets)):
        problems.append(f"data.pad_buckets: {d.pad_buckets} must be a non-empty list of positive lengths")
    return problems


def _model(cfg: RunConfig) -> List[str]:
    if cfg.model.name_or_path and cfg.model.config is not None:
        return ["set model.name_or_path (a pretrained model) or model.config (a model from scratch), not both; "
                "without --config the default recipe sets model.name_or_path: start from --config "
                "recipes/examples/causal_lm_from_scratch.yaml, or add model.name_or_path=null"]
    return []


def _distributed(cfg: RunConfig) -> List[str]:
    problems = []
    mesh = cfg.distributed.mesh
    if mesh is not None and (len(mesh) != 2 or min(mesh) < 1):
        problems.append(f"distributed.mesh: {mesh} must be [data, fsdp], two positive device counts")
    if mesh is not None and cfg.distributed.strategy != "xla_fsdp":
        problems.append("distributed.mesh: only distributed.strategy=xla_fsdp takes a mesh (xla_spmd splits the batch "
                        "over every device); remove it or set distributed.strategy=xla_fsdp")
    return problems


def _train_and_eval(cfg: RunConfig) -> List[str]:
    problems = []
    steps = cfg.train.profile_steps
    if steps is not None and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
        problems.append(f"train.profile_steps: {steps} must be [START, END] with 1 <= START <= END (optimizer steps)")
    for name in cfg.report_to:
        if name not in TRACKER_PACKAGES:
            problems.append(f"report_to: {name!r} is not a tracker; use any of {', '.join(TRACKER_PACKAGES)}")
    harness = cfg.eval.harness
    if harness is not None and not harness.tasks:
        problems.append("eval.harness.tasks: name at least one lm-eval task, e.g. [rt_sentiment, hamlet_next_line]")
    if cfg.train.early_stopping_patience and cfg.eval.metric is None:
        problems.append("train.early_stopping_patience needs eval.metric (the metric that must keep improving)")
    return problems


def _optim(cfg: RunConfig) -> List[str]:
    problems = []
    o = cfg.optim
    if o.lr is None and not (o.name == "adafactor" and o.relative_step):
        problems.append("optim.lr: null is only allowed with optim.name=adafactor and optim.relative_step=true")
    for i, group in enumerate(o.param_groups):
        try:
            re.compile(group.pattern)
            if not group.pattern:
                raise re.error("empty")
        except re.error as e:
            problems.append(f"optim.param_groups[{i}].pattern: {group.pattern!r} is not a usable regular expression ({e})")
    if o.relative_step and o.name != "adafactor":
        problems.append(f"optim.relative_step: only Adafactor has a relative-step mode, not {o.name}")
    if o.relative_step and (o.lr is not None or o.scheduler != "constant"):
        problems.append("optim.relative_step: Adafactor then sets its own learning rate; use optim.lr=null "
                        "and optim.scheduler=constant")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        problems.append(f"optim.betas: {o.betas} must be two numbers in [0, 1)")
    return problems

"""Recipes as data: the schema (``schema``), reading YAML (``loading``), typed validation (``validation``), the core
keys' cross-checks (``checks``), which keys a resume may change (``resume``) and renamed keys (``renamed``). None of
it knows a task: framework/recipe.py composes the schema with the registered tasks' sections and runs every check,
the tasks' included, above both.

The schema's sections are importable from here (``from framework.config import RunConfig``), and so are the
functions that write a resolved recipe out."""

from framework.config.loading import flatten, to_dict, to_yaml
from framework.config.schema import (CheckpointConfig, DataConfig, DeepSpeedConfig, DistributedConfig, EvalConfig,
                                     ExportConfig, FSDPConfig, HarnessConfig, ModelConfig, OptimConfig,
                                     ParamGroupConfig, PeftConfig, ReportConfig, RunConfig, SourceConfig, TrainConfig,
                                     core_keys)

__all__ = ["CheckpointConfig", "DataConfig", "DeepSpeedConfig", "DistributedConfig", "EvalConfig", "ExportConfig",
           "FSDPConfig", "HarnessConfig", "ModelConfig", "OptimConfig", "ParamGroupConfig", "PeftConfig", "ReportConfig",
           "RunConfig", "SourceConfig", "TrainConfig", "core_keys", "flatten", "to_dict", "to_yaml"]

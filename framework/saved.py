"""What a run saved, loaded back as a causal LM to use (the chat command): a model folder (a run's ``model/``, its
``output_dir``, any folder ``save_pretrained`` wrote, a LoRA adapter folder merged into its local base), a checkpoint
(``checkpoints/step_N``: its weights, in the model the run's recipe builds, with the run's tokenizer), or a GGUF file
(read by transformers, dequantized to float32). Whatever cannot be loaded is a UserError naming the path.

A checkpoint is the state of the model being trained, not a model folder: its trained parameters (the DCP states,
framework/backend/states.py, of any layout: one process, DDP, FSDP2, tensor parallelism) are put into the model the
recipe it records builds (the task's own loading: the pretrained model or a new one from ``model.config``, the chat
template, the adapters), and an adapter is merged. Checkpoints that only the training setup reads are refused,
pointing at the run's ``model/``: DeepSpeed's and XLA's own, QLoRA's (4-bit weights), and those of a task whose
model is not a causal LM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Tuple

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from framework import adapters, backend, hub
from framework.checkpoint import STATE_FILE
from framework.config import validation
from framework.errors import UserError
from framework.recipe import schema
from framework.tasks import MODEL_ERRORS, get_task, registered

MODEL_DIR_HINT = "pass a run's model/ (or its output_dir), a checkpoint folder (checkpoints/step_N) or a .gguf file"


def load_causal_lm(path: Path) -> Tuple[torch.nn.Module, object, str]:
    """(model in eval mode, tokenizer, what it is: "model folder", "checkpoint step_N", "GGUF file") of ``path``."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist (relative paths start at {Path.cwd()}); {MODEL_DIR_HINT}")
    if path.is_file():
        if not hub.is_gguf(str(path)):
            raise UserError(f"{path} is a file but not a .gguf one; {MODEL_DIR_HINT}")
        return (*_gguf(path), "GGUF file")
    folder = path / "model" if (path / "model").is_dir() and not (path / "config.json").is_file() else path
    if (folder / STATE_FILE).is_file():
        return (*_checkpoint(folder), f"checkpoint {folder.name}")
    if (folder / "config.json").is_file():
        return (*_folder(folder), "model folder")
    if (folder / "adapter_config.json").is_file():
        return (*_adapter(folder), "adapter merged into its base")
    raise UserError(f"{path} holds no model (no config.json, adapter_config.json or {STATE_FILE}); {MODEL_DIR_HINT}")


def _gguf(path: Path):
    try:
        model = hub.from_pretrained(AutoModelForCausalLM, str(path))
        tokenizer = hub.from_pretrained(AutoTokenizer, str(path))
    except (*MODEL_ERRORS, RuntimeError) as e:
        raise UserError(f"{path}: transformers cannot read this GGUF file as a causal LM: "
                        f"{_first_line(e)}") from None
    return model.eval(), tokenizer


def _folder(folder: Path):
    """A folder ``save_pretrained`` wrote: a causal LM (a classifier, a reward model, an encoder is refused)."""
    try:
        config = AutoConfig.from_pretrained(folder)
    except MODEL_ERRORS as e:
        raise UserError(f"{folder}: config.json is not a transformers config: {_first_line(e)}") from None
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not architecture.endswith(("ForCausalLM",
                                                                                                "LMHeadModel")):
        raise UserError(f"{folder} holds a {architecture} (model_type {config.model_type}), not a causal language "
                        "model: only a model that generates text can chat")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except MODEL_ERRORS as e:
        raise UserError(f"{folder}: cannot load it as a causal LM: {_first_line(e)}") from None
    return model.eval(), tokenizer


def _adapter(folder: Path):
    """A LoRA adapter folder (a run's model/ without ``peft.merge``) merged into the base it names."""
    from peft import PeftModel  # only here: peft's import is slow and only adapters need it

    base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    if not (Path(base) / "config.json").is_file():
        raise UserError(f"{folder} holds a LoRA adapter whose base '{base}' is not a local model folder; train with "
                        "peft.merge=true (model/ then holds the merged model), or merge it with peft first")
    model, _ = _folder(Path(base))
    model = PeftModel.from_pretrained(model, folder).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(folder if (folder / "tokenizer_config.json").is_file() else base)
    return model.eval(), tokenizer


def _checkpoint(folder: Path):
    """The checkpoint's weights in the model its recipe builds, with the tokenizer the run trained with."""
    hint = f"chat with the run's model/ ({folder.parent.parent / 'model'}), which the run writes at its end"
    recipe = json.loads((folder / STATE_FILE).read_text()).get("recipe") or {}
    cfg = recipe_of(recipe, folder)
    task = get_task(cfg.task) if cfg.task in registered() else None
    if task is None or getattr(task, "pipeline", None) != "text-generation":
        raise UserError(f"{folder}: a checkpoint of task {cfg.task}, whose model does not generate text; {hint}")
    if cfg.peft is not None and cfg.peft.quantize:
        raise UserError(f"{folder}: a QLoRA checkpoint (4-bit weights, peft.quantize), which only the training setup "
                        f"reads back; {hint}")
    try:
        model, tokenizer = task.load(cfg, None, None)
    except UserError as e:
        raise UserError(f"{folder}: rebuilding the model its recipe names failed: {e}") from None
    model = adapters.apply(model, cfg, "cpu", task.peft_task_type)
    if not backend.load_model_states(model, folder):
        raise UserError(f"{folder}: DeepSpeed's or XLA's own checkpoint, which only the training setup reads back; "
                        f"{hint}")
    if adapters.is_adapted(model):
        model = adapters.merged(model)
    return model.eval(), tokenizer


def recipe_of(recipe: dict, where: Path):
    """The RunConfig of a recipe a run recorded (``config.to_dict``: values from the environment as their
    templates, resolved again here), typed as a recipe is."""
    try:
        data = OmegaConf.to_container(OmegaConf.create(recipe), resolve=True)
    except OmegaConfBaseException as e:
        raise UserError(f"{where}: its recipe's {getattr(e, 'full_key', None) or 'values'} cannot be resolved "
                        f"({_first_line(e)})") from None
    cfg, problems = validation.build(schema(), data)
    if problems:
        raise UserError(f"{where}: its recipe does not fit this version's schema: {problems[0]}")
    return cfg


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]

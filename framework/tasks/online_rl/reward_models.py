"""Trained reward models as reward functions: ``SECTION.reward_functions: [model:PATH]`` (``grpo``, ``rloo``), PATH a
folder holding a sequence classifier with one output (a ``reward_model`` run's ``model/``, or its ``output_dir``).

Each completion is scored with its prompt as the reward model was trained on pairs (framework/tasks/pairs.py, TRL's
RewardTrainer): a conversation prompt and the completion as an assistant message, rendered with the reward model's
own chat template; a text prompt followed by the completion and the reward model's EOS. (Where the reward model pads
with its EOS, as SmolLM2 does, this is what TRL's GRPOTrainer scores: the reward is read at the last token that is
not padding.) Completions are scored in batches of ``BATCH`` on the run's device, without gradients; the model is
frozen, whole on every process (under ZeRO-3 too), and counted by the memory plan as a frozen model.

``check`` refuses, by key and before anything loads, a path that holds no model and a model that is not a sequence
classifier with one output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, List

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from framework import backend, templates
from framework.errors import UserError
from framework.tasks.base import MODEL_ERRORS

PREFIX = "model:"
BATCH = 16  # completions per forward pass of the reward model
TRAIN_IT = "a reward_model run's model/ (task: reward_model)"


def is_model(spec: str) -> bool:
    return spec.startswith(PREFIX)


def folder_of(spec: str) -> Path:
    """The model folder ``model:PATH`` names: PATH, or PATH/model for a run's output_dir."""
    path = Path(spec[len(PREFIX):])
    return path / "model" if not (path / "config.json").is_file() and (path / "model").is_dir() else path


def check(spec: str, key: str) -> List[str]:
    """The problems of ``model:PATH`` that its config shows: no model there, or not a sequence classifier with one
    output."""
    folder = folder_of(spec)
    config = folder / "config.json"
    if not config.is_file():
        lora = " (a LoRA adapter only: train it with peft.merge=true)" if (folder / "adapter_config.json").is_file() \
            else ""
        where = "does not exist" if not folder.exists() else f"holds no model (no config.json){lora}"
        return [f"{key}: {spec!r}: {folder} {where} (relative paths start at {Path.cwd()}); name {TRAIN_IT}"]
    try:
        fields = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        return [f"{key}: {spec!r}: {config} is not a readable config ({e})"]
    architecture = (fields.get("architectures") or ["?"])[0]
    if not architecture.endswith("ForSequenceClassification"):
        return [f"{key}: {spec!r}: {folder} holds a {architecture}, not a sequence classifier; a reward model is a "
                f"sequence classifier with one output: {TRAIN_IT}"]
    outputs = len(fields.get("id2label") or {}) or fields.get("num_labels", 2)
    if outputs != 1:
        return [f"{key}: {spec!r}: {folder} holds a {architecture} with {outputs} outputs; a reward model has one "
                f"(num_labels 1): {TRAIN_IT}"]
    return []


class ModelReward:
    """A reward model as a reward function with TRL's signature (framework/tasks/online_rl/rewards.py)."""

    def __init__(self, spec: str, key: str, accelerator):
        problems = check(spec, key)
        if problems:
            raise UserError(problems[0])
        folder = folder_of(spec)
        self.key, self.spec, self.device = key, spec, accelerator.device
        self.__name__ = f"{PREFIX}{folder.parent.name if folder.name == 'model' else folder.name}"  # in its metrics
        try:
            with backend.loading_whole_models(accelerator):  # whole on every process, also under ZeRO-3
                model = AutoModelForSequenceClassification.from_pretrained(folder)
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
        except MODEL_ERRORS as e:
            raise UserError(f"{key}: {spec!r}: cannot load {folder}: {(str(e).splitlines() or [''])[0]}") from None
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.requires_grad_(False).eval().to(self.device)

    def ids(self, prompt, completion) -> List[int]:
        """The token ids of a prompt and its completion as the reward model was trained on them."""
        if isinstance(prompt, list):
            messages = prompt + (completion if isinstance(completion, list)
                                 else [{"role": "assistant", "content": completion}])
            text = templates.render(self.tokenizer, messages, f"{self.key}: {self.spec!r}")
            return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        eos = self.tokenizer.eos_token or ""
        text = prompt + completion
        return self.tokenizer(text if text.endswith(eos) else text + eos, verbose=False)["input_ids"]

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> List[float]:
        sequences = [self.ids(p, c) for p, c in zip(prompts, completions)]
        scores: List[float] = []
        for start in range(0, len(sequences), BATCH):
            batch = self.tokenizer.pad({"input_ids": sequences[start:start + BATCH]}, return_tensors="pt")
            with torch.no_grad():
                logits = self.model(input_ids=batch["input_ids"].to(self.device),
                                    attention_mask=batch["attention_mask"].to(self.device)).logits
            scores += logits[:, 0].float().tolist()
        return scores


def models(functions: Iterable) -> List[torch.nn.Module]:
    """The reward models among a run's reward functions (what the memory plan counts)."""
    return [f.model for f in functions if isinstance(f, ModelReward)]

"""What the tasks on prompts and their completions (dpo, grpo) share: the tokenizer that ends every completion,
the model they start from, and the frozen reference their losses compare it with."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from framework import adapters, chat, data
from framework.errors import UserError
from framework.tasks.causal_lm import CausalLM
from framework.tasks.language import pretrained_causal_config, pretrained_causal_lm

ADAPTER_OFF = "adapter off"  # the reference under peft: the trained model with its adapter disabled


def completion_tokenizer(task: CausalLM, cfg):
    """(tokenizer, the recipe key it came from) for prompts and completions: with ``data.chat_template`` (a
    built-in one gives an EOS-less tokenizer its end of turn as EOS), an EOS token (it ends every completion, as
    in TRL), and padding that reuses EOS where it has no padding token (padding is never a target)."""
    tokenizer, key = task.tokenizer(cfg)
    chat.use_template(tokenizer, cfg.data.chat_template, needed=False)
    if tokenizer.eos_token_id is None:
        raise UserError(f"{key}: the tokenizer has no EOS token, which ends every completion (as TRL does); "
                        "use a tokenizer with one, or data.chat_template=chatml (its end of turn is then EOS)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, key


def load_completion_model(task: CausalLM, cfg):
    """(model, tokenizer) of a task on prompts and completions (dpo, grpo): the pretrained causal LM or a new
    one from ``model.config``, its embeddings grown for a built-in template's special tokens, checked to take
    ``data.max_length`` tokens."""
    config = pretrained_causal_config(cfg.model)  # the model's kind first: the most basic mistake
    tokenizer, _ = completion_tokenizer(task, cfg)  # before a new model sizes its vocabulary
    model = task._from_config(cfg, tokenizer) if config is None else pretrained_causal_lm(cfg.model, config)
    chat.resize_embeddings(model, tokenizer)  # a built-in template's special tokens
    data.check_length("data.max_length", cfg.data.max_length, tokenizer, model)
    return model, tokenizer


def reference_model(model: torch.nn.Module, accelerator):
    """The frozen reference of a model as loaded (its starting weights): with peft the model itself with its
    adapter switched off (``ADAPTER_OFF``: no second copy), else a frozen copy on the accelerator's device."""
    if adapters.is_adapted(model):
        return ADAPTER_OFF
    return copy.deepcopy(model).requires_grad_(False).eval().to(accelerator.device)


@contextmanager
def evaluating(model: torch.nn.Module):
    """``model`` in eval mode (no dropout: the reference is deterministic and draws no random numbers)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)

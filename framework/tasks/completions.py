"""What the tasks on prompts and their completions (dpo, and online RL: grpo, rloo) share: the tokenizer that ends
every completion, the model they start from, the log-probabilities of a completion's tokens (through the chunked
head where it is exact, else the full logits), and the frozen reference their losses compare the model with."""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from typing import Callable, Dict, List, Optional

import torch

from framework import adapters, data, losses, templates
from framework.errors import UserError
from framework.losses import IGNORE
from framework.tasks.causal_lm import CausalLM
from framework.tasks.language import pretrained_causal_config, pretrained_causal_lm


def completion_tokenizer(task: CausalLM, cfg):
    """(tokenizer, the recipe key it came from) for prompts and completions: with ``data.chat_template`` (a
    built-in one gives an EOS-less tokenizer its end of turn as EOS), an EOS token (it ends every completion, as
    in TRL), and padding that reuses EOS where it has no padding token (padding is never a target)."""
    tokenizer, key = task.tokenizer(cfg)
    templates.use_template(tokenizer, cfg.data.chat_template, needed=False)
    if tokenizer.eos_token_id is None:
        raise UserError(f"{key}: the tokenizer has no EOS token, which ends every completion (as TRL does); "
                        "use a tokenizer with one, or data.chat_template=chatml (its end of turn is then EOS)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, key


def load_completion_model(task: CausalLM, cfg):
    """(model, tokenizer) of a task on prompts and completions: the pretrained causal LM or a new one from
    ``model.config``, its embeddings grown for a built-in template's special tokens, checked to take
    ``data.max_length`` tokens."""
    config = pretrained_causal_config(cfg.model)  # the model's kind first: the most basic mistake
    tokenizer, _ = completion_tokenizer(task, cfg)  # before a new model sizes its vocabulary
    model = task._from_config(cfg, tokenizer) if config is None else pretrained_causal_lm(cfg.model, config)
    templates.resize_embeddings(model, tokenizer)  # a built-in template's special tokens
    data.check_length("data.max_length", cfg.data.max_length, tokenizer, model)
    return model, tokenizer


class _Tempered(torch.nn.Module):
    """The output head with its logits divided by the temperature (the chunked loss calls it chunk by chunk)."""

    def __init__(self, head: torch.nn.Module, temperature: float):
        super().__init__()
        self.head, self.temperature = head, temperature

    def forward(self, x):
        return self.head(x) / self.temperature


def target_logprobs(model: torch.nn.Module, batch: Dict[str, torch.Tensor], targets: torch.Tensor,
                    chunk: Optional[int], select: bool, temperature: float = 1.0, with_entropy: bool = False):
    """Per token of ``batch`` (its ``input_ids`` and ``attention_mask``), the log-probability (fp32) of its target
    (``targets``: the next token where it is a completion token, ``IGNORE`` elsewhere, where it is 0) under the
    model's logits over ``temperature``. ``chunk``: the head and log-softmax that many tokens at a time
    (framework/losses.py, where exact for the architecture), never the whole batch's logits; None: full logits.
    ``select``: the head on the target tokens only (dynamic shapes). ``with_entropy``: (log-probabilities, each
    target token's entropy of that distribution, not differentiable, 0 elsewhere)."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    head = losses.output_head(model) if chunk else None
    if head is not None:
        hidden, called = losses.hidden_states(model, head, **inputs)
        if called:
            tempered = head if temperature == 1.0 else _Tempered(head, temperature)
            return losses.token_logprobs(hidden, tempered, targets, chunk, select, with_entropy)
        logits = hidden  # the model did not call its head module: these are its logits
    else:
        logits = model(**inputs).logits
    counted = targets != IGNORE
    logp = torch.log_softmax(logits[counted].float() / temperature, dim=-1)
    chosen = logp.gather(1, targets[counted].unsqueeze(1)).squeeze(1)
    out = torch.zeros(targets.shape, dtype=chosen.dtype, device=chosen.device).masked_scatter(counted, chosen)
    if not with_entropy:
        return out
    entropy = -(logp.detach().exp() * logp.detach()).sum(dim=-1)
    return out, torch.zeros_like(out).masked_scatter(counted, entropy)


class Reference:
    """The frozen reference of a model as loaded (its starting weights), which preference and RL losses compare the
    trained model with: ``frozen``, a frozen copy (rebuilt from the starting weights on a resume: never in a
    checkpoint), or None for the trained model itself with its adapter switched off (peft: no second copy)."""

    def __init__(self, frozen: Optional[torch.nn.Module], autocast=nullcontext, unwrap=lambda model: model):
        self.frozen, self.autocast, self.unwrap = frozen, autocast, unwrap

    @classmethod
    def of(cls, model: torch.nn.Module, accelerator) -> "Reference":
        """The reference of ``model`` as loaded, for a run on ``accelerator`` (the copy on its device)."""
        frozen = None if adapters.is_adapted(model) else \
            copy.deepcopy(model).requires_grad_(False).eval().to(accelerator.device)
        return cls(frozen, accelerator.autocast, accelerator.unwrap_model)

    def models(self) -> List[torch.nn.Module]:
        """The models it holds beside the trained one (the memory plan counts their weights)."""
        return [self.frozen] if self.frozen is not None else []

    def logprobs(self, model: torch.nn.Module, compute: Callable[[torch.nn.Module], torch.Tensor]) -> torch.Tensor:
        """``compute(reference model)`` without gradients, under the run's autocast; ``model``: the trained one (as
        prepared), whose adapter is switched off when it is its own reference."""
        with torch.no_grad(), self.autocast():
            if self.frozen is not None:
                return compute(self.frozen)
            inner = self.unwrap(model)
            with inner.disable_adapter(), evaluating(inner):
                return compute(inner)


@contextmanager
def evaluating(model: torch.nn.Module):
    """``model`` in eval mode (no dropout: the reference is deterministic and draws no random numbers)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)

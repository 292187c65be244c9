"""Causal language modelling (next-token prediction): fine-tune a pretrained model or train one from scratch.

Recipe keys: ``model.name_or_path`` (pretrained) or ``model.config`` + ``model.tokenizer`` (from scratch);
``data.text_column`` (``.txt`` files: ``data.sample_by``), ``data.packing``, ``data.block_size``,
``eval.prompt``, ``eval.max_new_tokens``.

Packing (the default) concatenates documents, an EOS after each, into blocks of ``block_size`` tokens: one
shape, no padding. A document cut at a block's end continues in the next block as a new segment. Inside a
block every token attends only to earlier tokens of its own segment (a block-diagonal causal mask built on
the device from ``position_ids``, which restart at 0 at each segment), and the first token of a segment is
not a target: the packed loss and logits equal those of each segment computed alone. transformers does
not isolate documents from packed ``position_ids`` alone under sdpa or eager attention, so the mask is
explicit (4D).

The loss is a sum over target tokens; the loop divides it by the target tokens of the whole optimizer step.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from framework import data
from framework.errors import UserError
from framework.tasks.base import register
from framework.tasks.language import (IGNORE, LanguageModel, LanguageRun, check_causal, pretrained_causal_config,
                                      pretrained_causal_lm)

DEFAULT_BLOCK = 1024  # the block size cap when the recipe sets none: the model's positions, at most this


@register("causal_lm")
class CausalLM(LanguageModel):
    pipeline = "text-generation"
    peft_task_type = "CAUSAL_LM"
    architectures = "gpt2, llama, ..."
    harness = True
    reads = ("model.config_overrides", "data.packing", "data.block_size", "eval.prompt", "eval.max_new_tokens",
             "eval.harness")

    def load(self, cfg, train, evaluation):
        config = pretrained_causal_config(cfg.model)  # the model's kind first: the most basic mistake
        tokenizer, key = self.tokenizer(cfg)
        if packing(cfg) and tokenizer.eos_token_id is None:
            raise UserError(f"{key}: the tokenizer has no EOS token, which packing puts between documents; use a "
                            "tokenizer with one, or data.packing=false")
        if tokenizer.pad_token is None:  # padding (unpacked rows, generation) reuses EOS; padding is never a target
            tokenizer.pad_token = tokenizer.eos_token
        model = self._from_config(cfg, tokenizer) if config is None else pretrained_causal_lm(cfg.model, config)
        data.check_length("data.block_size", self.sequence_length(cfg, model), tokenizer, model)
        return model, tokenizer

    def _from_config(self, cfg, tokenizer):
        """A new model from ``model.config``, its vocabulary and special tokens the tokenizer's by default (the
        architecture's own defaults, GPT-2's 50256, would point outside another tokenizer's vocabulary)."""
        config = self.new_config(cfg, {
            "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id})
        check_causal(config, f"model.config: model_type '{config.model_type}'")
        if config.vocab_size < len(tokenizer):
            raise UserError(f"model.config.vocab_size={config.vocab_size} is smaller than the tokenizer's "
                            f"{len(tokenizer)} tokens; remove it (it defaults to the tokenizer's) or raise it")
        return self.from_config(AutoModelForCausalLM, config)

    def sequence_length(self, cfg, model) -> int:
        if cfg.data.block_size:
            return cfg.data.block_size
        positions = getattr(model.config, "max_position_embeddings", None) or DEFAULT_BLOCK
        return min(positions, DEFAULT_BLOCK)

    def prepare(self, ds: datasets.Dataset, tokenizer, model, cfg) -> datasets.Dataset:
        """Tokens with EOS after each document; then blocks (packing) or truncated rows."""
        column, length, packed = cfg.data.text_column, self.sequence_length(cfg, model), packing(cfg)
        eos = tokenizer.eos_token_id

        def tokenize(batch):
            ids = tokenizer([str(t) for t in batch[column]], add_special_tokens=False, verbose=False)["input_ids"]
            ids = [doc + [eos] if eos is not None else doc for doc in ids]
            if packed:
                return pack(ids, length)
            ids = [doc[:length] for doc in ids]
            return {"input_ids": ids, "attention_mask": [[1] * len(doc) for doc in ids]}

        ds = data.map_rows(ds, tokenize, (data.tokenizer_identity(tokenizer), column, length, packed),
                           "Packing" if packed else "Tokenizing")
        if isinstance(ds, datasets.Dataset) and len(ds) == 0:  # a stream finds out when it is read
            raise UserError(f"data.block_size={length}: the training or eval documents hold fewer tokens than one "
                            "block; lower data.block_size (or add data)")
        return ds

    def collator(self, tokenizer, cfg, buckets, rows=None):
        if packing(cfg):
            return PackedCollator(rows)
        return PaddedCollator(tokenizer, buckets, rows)

    def default_prompt(self, tokenizer, eval_ds) -> str:
        """What the sample continues without ``eval.prompt``: the first 8 tokens of the first eval row."""
        return tokenizer.decode(eval_ds[0]["input_ids"][:8])

    def bind(self, cfg, model, accelerator) -> "CausalRun":
        return CausalRun(self, cfg, accelerator)


class CausalRun(LanguageRun):
    """Next-token prediction: the targets are the next tokens; the end-of-run sample is a greedy continuation."""

    def targets(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return (batch["labels"][:, 1:] != IGNORE).sum()

    def inputs(self, model, batch):
        return _inputs_and_targets(model, batch)

    def sample(self, model, tokenizer, eval_ds) -> Optional[Dict[str, str]]:
        """A short greedy generation from ``eval.prompt`` (default: ``default_prompt``)."""
        cfg = self.cfg
        prompt = cfg.eval.prompt
        if prompt is None:
            prompt = self.task.default_prompt(tokenizer, eval_ds)
        device = next(model.parameters()).device
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(device)
        if inputs["input_ids"].shape[1] == 0:
            return None
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=cfg.eval.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        model.train(was_training)
        return {"prompt": prompt, "generated": tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])}


def packing(cfg) -> bool:
    return cfg.data.packing is not False


def pack(docs: List[List[int]], length: int) -> Dict[str, list]:
    """Concatenated documents cut into blocks of ``length`` (the remainder dropped), with ``position_ids``
    restarting at 0 at each document and at each block's start (a document cut there is a new segment)."""
    sizes = [len(doc) for doc in docs]
    n = sum(sizes) // length * length
    if n == 0:
        return {"input_ids": [], "position_ids": [], "attention_mask": []}
    ids = np.fromiter((t for doc in docs for t in doc), dtype=np.int64, count=sum(sizes))
    starts = np.zeros(len(ids), dtype=bool)
    starts[np.cumsum([0] + sizes[:-1])] = True
    ids, starts = ids[:n].reshape(-1, length), starts[:n].reshape(-1, length)
    starts[:, 0] = True
    index = np.arange(length)
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {"input_ids": ids.tolist(), "position_ids": positions.tolist(), "attention_mask": np.ones_like(ids).tolist()}


class PackedCollator:
    """Blocks -> tensors; labels are the inputs, except each segment's first token (no target within it)."""

    def __init__(self, rows: Optional[int] = None):
        self.rows = rows

    def __call__(self, features: List[Dict]) -> Dict[str, torch.Tensor]:
        features, real = data.fill_rows(features, self.rows)
        batch = {key: torch.tensor([f[key] for f in features]) for key in ("input_ids", "position_ids", "attention_mask")}
        batch["labels"] = batch["input_ids"].masked_fill(batch["position_ids"] == 0, IGNORE)
        if self.rows is not None:
            batch["valid"] = torch.arange(self.rows) < real
        return batch


class PaddedCollator:
    """One document per row, padded (dynamically or to a bucket); padding is never a target."""

    def __init__(self, tokenizer, buckets: Optional[List[int]], rows: Optional[int] = None):
        self.pad = data.collator(tokenizer, buckets, rows)

    def __call__(self, features: List[Dict]) -> Dict[str, torch.Tensor]:
        batch = self.pad(features)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
        return batch


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, length, length) bool, True where query i may attend key j: j <= i in the same segment.
    Built on the device from the positions (a segment starts where they restart at 0): static shapes."""
    segments = torch.cumsum((position_ids == 0).long(), dim=1)
    same = segments[:, :, None] == segments[:, None, :]
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def _inputs_and_targets(model, batch):
    """The model's inputs and the targets of its outputs at every position, the next tokens (the last
    position has none). The targets are shifted rather than the outputs: slicing (batch x length x
    vocabulary) logits would copy them, and their gradient, every step."""
    inputs = {"input_ids": batch["input_ids"], "use_cache": False}
    if "position_ids" in batch:
        mask = document_mask(batch["position_ids"])
        config = getattr(model, "module", model).config  # under DDP, FSDP or DeepSpeed: the wrapped model's
        if getattr(config, "_attn_implementation", "sdpa") == "eager":  # eager adds the mask to the scores
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        inputs.update(attention_mask=mask, position_ids=batch["position_ids"])
    else:
        inputs["attention_mask"] = batch["attention_mask"]
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE)
    return inputs, targets

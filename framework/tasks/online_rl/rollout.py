"""Rollout data: prompts as prepared rows and collated batches, the keys each completion is sampled by, and a
step's rollouts (each prompt followed by its completion) as micro-batches for the update.

A prepared row holds its columns as they are, the prompt's token ids (``PROMPT_IDS``: a string tokenized as TRL
does, a conversation rendered with the chat template and its generation prompt; the last ``data.max_length``
tokens) and its key (``INDEX``): its index in the dataset or, for a streamed row (whose index depends on the
process count), a hash of its columns. A completion's sampling seed comes from (the run's seed, the epoch, that
key, the completion's number): the process count and the accumulation do not change what is drawn. The epoch
stands in the key where the step could: within an epoch each prompt index comes at most once, so (epoch, index)
names one draw as (step, index) would, and the collator knows the epoch (the loop sets it, on a resume too) where
nothing in a step knows the step's number. A mix of sources that repeats a row within an epoch draws the same
completions for its repeats."""

from __future__ import annotations

import hashlib
import json
from typing import Dict, List, Optional, Tuple

import datasets
import torch
import torch.nn.functional as F

from framework import data, templates
from framework.errors import UserError
from framework.losses import IGNORE
from framework.tasks.online_rl import sampling

# The prepared rows' own columns, beside the data's: the prompt's tokens (``input_ids``, as the framework's length
# ordering reads them) and the row's key in its sampling seed.
PROMPT_IDS, INDEX = "input_ids", "prompt_index"


def row_key(row: Dict) -> int:
    """A streamed row's stand-in for its index: 63 bits of a hash of its columns, so that whichever process reads
    it, it draws the same completions (rows repeated within an epoch draw the same ones, as repeated sources')."""
    text = json.dumps(row, sort_keys=True, default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def prompt_ids(tokenizer, prompt, where: str, tools: Optional[List[Dict]] = None) -> List[int]:
    """A prompt's token ids as TRL's trainers make them: a conversation rendered with the generation prompt (and
    ``tools``' JSON schemas: a text prompt cannot list them), text tokenized with the tokenizer's special tokens."""
    conversation = templates.maybe_conversation(prompt, where)
    if conversation is not None:
        ids = templates.encode(tokenizer, templates.render(tokenizer, conversation, where, add_generation_prompt=True,
                                                           tools=tools or None))[0]
    elif tools:
        raise UserError(f"{where}: is text, and the tools can only be listed in a conversation's chat template; "
                        "make the prompts conversations (a list of {role, content})")
    else:
        ids = tokenizer(prompt, verbose=False)["input_ids"]
    if not ids:
        raise UserError(f"{where}: has no tokens; fix or remove the row")
    return ids


def prepare_prompts(ds, tokenizer, column: str, length: int, key: str, tools: Optional[List[Dict]] = None):
    """Rows -> their columns as they are, the prompt's token ids (the last ``length``; ``tools``: their schemas
    listed by the template) and the row's key (``INDEX``); ``key``: the recipe key naming ``column``, for
    messages."""
    streamed = isinstance(ds, datasets.IterableDataset)

    def tokenize(batch, indices):
        out = dict(batch)
        out[PROMPT_IDS] = [prompt_ids(tokenizer, prompt, f"{key}: the prompt {templates.snippet(prompt)}",
                                      tools)[-length:] for prompt in batch[column]]
        out[INDEX] = [row_key({k: v[i] for k, v in batch.items()}) for i in range(len(indices))] if streamed \
            else indices
        return out

    identity = (data.tokenizer_identity(tokenizer), tokenizer.chat_template, column, length, PROMPT_IDS, INDEX,
                json.dumps(tools, sort_keys=True) if tools else None)
    return data.map_rows(ds, tokenize, identity, "Tokenizing prompts", with_indices=True)


class PromptCollator:
    """Prompts -> a batch: their token ids (unpadded: the step pads every completion of the step together), their
    keys, the epoch (``set_epoch``; with the key, what seeds the sampling) and the rows' other columns for the
    reward functions. ``rows`` (evaluation on static shapes): a short last batch filled up to ``rows`` with copies
    of its first prompt, a ``valid`` column marking the real ones (framework/data.py's ``fill_rows``)."""

    def __init__(self, rows: Optional[int] = None):
        self.epoch, self.rows = 0, rows

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @staticmethod
    def columns(feature: Dict) -> Dict:
        return {k: v for k, v in feature.items() if k not in (PROMPT_IDS, INDEX)}

    def __call__(self, features: List[Dict]) -> Dict:
        features, real = data.fill_rows(features, self.rows)
        batch = {"prompt_ids": [f[PROMPT_IDS] for f in features], "index": [f[INDEX] for f in features],
                 "epoch": self.epoch, "rows": [self.columns(f) for f in features]}
        if self.rows is not None:
            batch["valid"] = torch.arange(self.rows) < real
        return batch


def generation_batch(batches: List[Dict], group: int, seed: int) -> Tuple[List[List[int]], List[int]]:
    """A step's generation: each prompt of its micro-batches ``group`` times, and each completion row's sampling seed
    (keyed by the run's seed, the epoch, the prompt's key and the completion's number)."""
    prompts = [ids for batch in batches for ids in batch["prompt_ids"] for _ in range(group)]
    seeds = [sampling.row_seed(seed, batch["epoch"], index, j)
             for batch in batches for index in batch["index"] for j in range(group)]
    return prompts, seeds


def rollout_batch(prompts: List[List[int]], completions: List[List[int]], trained: List[bool], pad_id: int,
                  device, buckets: Optional[List[int]] = None,
                  sampled: Optional[List[List[int]]] = None) -> Dict[str, torch.Tensor]:
    """One micro-batch of rollouts: each prompt followed by its completion, right-padded (positions 0..n-1, as
    generation had them) to the longest or, with ``buckets`` (static shapes), to the smallest bucket that holds it;
    the completion's tokens the targets (``trained``: False leaves a completion out of the loss; ``sampled``: per
    completion token, 1 where the model sampled it, 0 where a tool turn inserted it, which is no target)."""
    longest = data.padded_length(max(len(p) + len(c) for p, c in zip(prompts, completions)), buckets)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    labels = torch.full((len(prompts), longest), IGNORE, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        attention_mask[i, :len(p) + len(c)] = 1
        if trained[i]:
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
            if sampled is not None:
                inserted = torch.tensor(sampled[i], dtype=torch.bool).logical_not()
                labels[i, len(p):len(p) + len(c)][inserted] = IGNORE
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)  # the next token at each position
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
            "targets": targets.to(device)}

"""Preference pairs, as the tasks that learn from them read them (``dpo``, ``reward_model``): rows of a prompt and a
chosen and a rejected completion (strings, or conversations rendered with the chat template) in the columns the
task's section names (``PairColumns``), checked row by row (``PreferencePairs.keep_row``), tokenized as TRL tokenizes
them (``tokenize_pair``) and batched as one forward pass over both completions (``PairCollator``: every chosen
sequence, then every rejected one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from framework import data, templates
from framework.errors import UserError
from framework.losses import IGNORE

COLUMNS = ("prompt_column", "chosen_column", "rejected_column")


@dataclass
class PairColumns:
    """The columns of a preference pair (the base of the sections of the tasks on pairs)."""

    prompt_column: str = "prompt"
    """The column holding the prompt (a string, or a conversation: a list of {role, content})."""
    chosen_column: str = "chosen"
    """The column holding the preferred completion of ``prompt_column`` (a string or a conversation)."""
    rejected_column: str = "rejected"
    """The column holding the dispreferred completion of ``prompt_column`` (a string or a conversation)."""


class PreferencePairs:
    """A task on preference pairs (mixed in before its ``Task`` base): its rows' columns are its section's
    (``options``: a subclass of ``PairColumns``), every row must be a usable pair, a bad one stops the run."""

    def pair_keys(self) -> Tuple[str, str, str]:
        """The recipe keys of the prompt, chosen and rejected columns, in that order."""
        section = self.options[0]
        return tuple(f"{section}.{name}" for name in COLUMNS)

    def columns(self, cfg) -> Dict[str, str]:
        settings = getattr(cfg, self.options[0])
        return {key: getattr(settings, name) for key, name in zip(self.pair_keys(), COLUMNS)}

    def keep_row(self, cfg):
        """Every row must be usable: a bad one stops the run with its prompt in the message."""
        columns = self.columns(cfg)
        prompt_key, chosen_key, rejected_key = self.pair_keys()

        def check(row) -> bool:
            prompt = row[columns[prompt_key]]
            where = f"the row with prompt {short(prompt)}"
            if not isinstance(prompt, (str, list)):
                raise UserError(f"{prompt_key}: {where}: the prompt is {type(prompt).__name__}, not a string "
                                "or a conversation (a list of {role, content}); fix or remove the row")
            values = {key: row[columns[key]] for key in (chosen_key, rejected_key)}
            kinds = {key: templates.maybe_conversation(value, f"{key}: {where}") is not None
                     if isinstance(value, (str, list)) else None for key, value in {prompt_key: prompt, **values}.items()}
            for key, value in values.items():
                if kinds[key] is None or not content(value).strip():
                    raise UserError(f"{key}: {where}: the completion '{columns[key]}' is empty (or not a string or a "
                                    "conversation); every pair needs two completions: fix or remove the row")
            if len(set(kinds.values())) > 1:
                raise UserError(f"{prompt_key}: {where}: the prompt and completions mix text and "
                                "conversations; make all three text, or all three conversations")
            if values[chosen_key] == values[rejected_key]:
                raise UserError(f"{chosen_key}: {where}: chosen equals rejected ({short(values[chosen_key])}), "
                                "which teaches nothing; fix or remove the row")
            return True

        return check


def tokenize_pair(tokenizer, prompt, chosen, rejected) -> Tuple[int, List[List[int]]]:
    """(where the completions start, [prompt + chosen ids, prompt + rejected ids]) as TRL's DPOTrainer and
    RewardTrainer tokenize them (``templates.prompt_completion_tokens``: text with EOS after the completion,
    conversations through the chat template); the completions start where the prompt ends in both (the shorter of
    their common prefixes with the tokenized prompt, as TRL takes it)."""
    where = f"the row with prompt {short(prompt)}"
    if templates.maybe_conversation(prompt, where) is not None and not tokenizer.chat_template:
        templates.use_template(tokenizer, None, needed=True)  # the error that names data.chat_template
    pairs = [templates.prompt_completion_tokens(tokenizer, prompt, c, where) for c in (chosen, rejected)]
    start = min(len(ids) - sum(mask) for ids, mask in pairs)
    return start, [ids for ids, _ in pairs]


class PairCollator:
    """Pairs -> one batch of 2 x pairs rows (every chosen sequence, then every rejected one), padded to the
    longest (or to the smallest bucket that fits: static shapes); labels are the completion tokens only.
    ``values``: per-pair numbers the features carry, each a float32 tensor of the batch (a margin)."""

    def __init__(self, pad_id: int, buckets: Optional[List[int]], rows: Optional[int] = None,
                 values: Sequence[str] = ()):
        self.pad_id, self.buckets, self.rows, self.values = pad_id, buckets, rows, tuple(values)

    def __call__(self, features: List[Dict]) -> Dict[str, torch.Tensor]:
        features, real = data.fill_rows(features, self.rows)
        sequences = [f["chosen_ids"] for f in features] + [f["rejected_ids"] for f in features]
        starts = [f["prompt_length"] for f in features] * 2
        length = data.padded_length(max(len(ids) for ids in sequences), self.buckets)
        input_ids = torch.full((len(sequences), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        labels = torch.full((len(sequences), length), IGNORE, dtype=torch.long)
        for i, (ids, start) in enumerate(zip(sequences, starts)):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            attention_mask[i, :len(ids)] = 1
            labels[i, start:len(ids)] = input_ids[i, start:len(ids)]
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if "ref_chosen_logps" in features[0]:
            batch["reference_logps"] = torch.tensor([f["ref_chosen_logps"] for f in features]
                                                    + [f["ref_rejected_logps"] for f in features], dtype=torch.float32)
        for name in self.values:
            batch[name] = torch.tensor([f[name] for f in features], dtype=torch.float32)
        if self.rows is not None:
            batch["valid"] = torch.arange(self.rows) < real
        return batch


def content(value) -> str:
    """The text of a completion: a string, or a conversation's message contents."""
    if isinstance(value, str):
        return value
    return "".join(str(m.get("content") or "") if isinstance(m, dict) else "" for m in value)


def short(value) -> str:
    text = content(value) if isinstance(value, (str, list)) else str(value)
    return repr(text if len(text) <= 60 else text[:57] + "...")


def pair_figures(gathered: Dict[str, np.ndarray], prefix: str = "") -> Dict[str, float]:
    """Means over the held-out pairs of what every task on pairs reports: the loss, the share whose chosen reward is
    the higher (a tie as wrong), the mean margin r_chosen - r_rejected (named ``{prefix}accuracy`` and
    ``{prefix}margin``), each side's mean reward, and the pairs counted."""
    chosen, rejected = gathered["rewards_chosen"], gathered["rewards_rejected"]
    return {"loss": float(gathered["loss"].mean(dtype=np.float64)),
            f"{prefix}accuracy": float((chosen > rejected).mean()),
            f"{prefix}margin": float((chosen - rejected).mean(dtype=np.float64)),
            "rewards_chosen": float(chosen.mean(dtype=np.float64)),
            "rewards_rejected": float(rejected.mean(dtype=np.float64)),
            "pairs": int(len(chosen))}

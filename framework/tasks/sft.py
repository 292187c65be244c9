"""Supervised fine-tuning (SFT) on conversations: a causal LM trained on the tokens its assistant turns generate.

Recipe keys: the causal LM's model keys (``model.name_or_path``, or ``model.config`` + ``model.tokenizer``);
``sft.messages_column`` (conversations: lists of ``{role, content}``, or their JSON text), or with
``sft.train_on: completion`` ``sft.prompt_column`` + ``sft.completion_column`` (strings or conversations);
``sft.tools_column`` (each conversation's tool schemas, when the data has them); ``data.chat_template``
(framework/templates.py); ``sft.train_on``, ``sft.overflow``; ``data.packing``, ``data.block_size``;
``eval.prompt``, ``eval.max_new_tokens``.

Rows become token ids and labels (``IGNORE`` where nothing is trained on: role headers, system (and its list of
tools), user and tool messages, prompts, and each conversation's first token); framework/templates.py finds what to
train on from the rendered conversation. An assistant message's tool calls are what it generates, so they are
trained on; the tools' results (tool messages) are not. Packing (the default) puts whole conversations one after another into blocks of at most
``data.block_size`` tokens, each conversation a segment that attends only to itself (causal_lm's block-diagonal
mask); a conversation is never split across blocks. A conversation longer than a block is truncated or dropped
(``sft.overflow``); the plan counts those and the rows without an assistant turn (dropped).

The loss, exact per target token across accumulation and processes, and the perplexity are causal_lm's
(``LanguageModel``: ``forward`` returns logits and targets). Evaluation adds ``answer_accuracy``: the share of
held-out answers (assistant turns, or completions) whose every token is the model's greedy choice given the
conversation before it, i.e. the answers greedy decoding reproduces exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Literal, Optional

import datasets
import numpy as np
import torch

from framework import data, templates
from framework.errors import UserError
from framework.tasks import language
from framework.tasks.base import register
from framework.tasks.causal_lm import CausalLM, CausalRun, packing
from framework.tasks.language import IGNORE, pretrained_causal_config, pretrained_causal_lm

# A row's fate in preparation, counted for the plan ("counts" of every feature row: see ``prepare``).
KEPT, TRUNCATED, TOO_LONG, NO_ASSISTANT, NOTHING_LEFT = range(5)
COUNTS = "sft_counts"


@dataclass
class SftConfig:
    """Supervised fine-tuning (``task: sft``): its columns, which tokens are trained on, and what becomes of a
    conversation longer than ``data.block_size``."""

    train_on: Literal["assistant", "completion", "all"] = "assistant"
    """assistant: the tokens each assistant message generates in ``sft.messages_column`` conversations (after
    its role header, through its end-of-turn text), as TRL's ``assistant_only_loss``; completion: rows of
    ``sft.prompt_column`` + ``sft.completion_column``, trained on the completion only (TRL's
    ``completion_only_loss``); all: every token of the conversations."""
    overflow: Literal["truncate", "drop"] = "truncate"
    """A conversation longer than ``data.block_size`` tokens: truncate (keep its first block_size tokens; one
    left with no token to train on is dropped) or drop it. Either way the plan counts them."""
    messages_column: str = "messages"
    """The column holding conversations (a list of {role, content}, or its JSON text as a csv holds it)."""
    prompt_column: str = "prompt"
    """With ``train_on: completion``: the column holding the prompt (a string, or a conversation: a list of
    {role, content})."""
    completion_column: str = "completion"
    """With ``train_on: completion``: the column holding the completion of ``prompt_column`` (a string or a
    conversation)."""
    tools_column: str = "tools"
    """The column holding each conversation's tools: a list of JSON schemas ({"type": "function", "function":
    {"name", "description", "parameters"}}, as transformers' get_json_schema writes them; TRL's ``tools``), or
    its JSON text; null or empty: none. The template lists them in the system turn (``data.chat_template:
    chatml-tools``); they are never trained on. The default ``tools`` is read where the data has that column;
    another name must be a column of the data."""


@register("sft")
class Sft(CausalLM):
    pipeline = "text-generation"
    options = ("sft", SftConfig)
    moved_from_data = ("messages_column", "prompt_column", "completion_column")
    reads = ("model.config_overrides", "data.block_size", "data.packing", "data.chat_template", "eval.prompt",
             "eval.max_new_tokens", "eval.harness", "sft")

    def check(self, cfg, strategy) -> List[str]:
        problems = super().check(cfg, strategy)
        name = cfg.data.chat_template
        if name is not None and name not in templates.BUILTIN and not Path(name).is_file():
            problems.append(f"data.chat_template: '{name}' is neither a built-in template "
                            f"({', '.join(templates.BUILTIN)}) nor a file (relative paths start at {Path.cwd()})")
        return problems

    def columns(self, cfg) -> Dict[str, str]:
        s = cfg.sft
        if s.train_on == "completion":
            columns = {"sft.prompt_column": s.prompt_column, "sft.completion_column": s.completion_column}
        else:
            columns = {"sft.messages_column (prompt/completion rows: sft.train_on=completion)": s.messages_column}
        if s.tools_column != SftConfig.tools_column:  # named by the recipe: the data must have it
            columns["sft.tools_column"] = s.tools_column
        return columns

    def optional_columns(self, cfg) -> Dict[str, str]:
        s = cfg.sft
        return {"sft.tools_column": s.tools_column} if s.tools_column == SftConfig.tools_column else {}

    def keep_row(self, cfg):
        return None  # every row is checked, and its problem named, when it is tokenized

    def metric_names(self):
        return super().metric_names() + ("answer_accuracy",)

    def load(self, cfg, train, evaluation):
        config = pretrained_causal_config(cfg.model)  # the model's kind first: the most basic mistake
        tokenizer, _ = self.tokenizer(cfg)
        templates.use_template(tokenizer, cfg.data.chat_template, needed=cfg.sft.train_on != "completion")
        if tokenizer.pad_token is None:  # padding is never a target
            tokenizer.pad_token = tokenizer.eos_token
        if config is None:
            model = self._from_config(cfg, tokenizer)
        else:
            model = pretrained_causal_lm(cfg.model, config)
            templates.resize_embeddings(model, tokenizer)  # the template's new special tokens
        stop = templates.end_of_turn_ids(tokenizer, cfg.data.chat_template)
        if stop:  # model/ then answers a pipeline("text-generation") conversation up to the end of its turn
            model.generation_config.eos_token_id = stop if len(stop) > 1 else stop[0]
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        data.check_length("data.block_size", self.sequence_length(cfg, model), tokenizer, model)
        return model, tokenizer

    def prepare(self, ds, tokenizer, model, cfg):
        """Rows -> token ids and labels (with each row's fate), then blocks (packing) or rows. Every feature row
        of an in-memory dataset carries the counts of the rows' fates (``sft_counts``) for the plan."""
        s = cfg.sft
        length, packed = self.sequence_length(cfg, model), packing(cfg)
        identity = (data.tokenizer_identity(tokenizer), tokenizer.chat_template, s.messages_column, s.prompt_column,
                    s.completion_column, s.tools_column, s.train_on, s.overflow, length)

        def tokenize(batch):
            out = {"input_ids": [], "labels": [], "status": []}
            for row in (dict(zip(batch, values)) for values in zip(*batch.values())):
                ids, labels, status = encode_row(tokenizer, row, cfg, length)
                out["input_ids"].append(ids)
                out["labels"].append(labels)
                out["status"].append(status)
            return out

        rows = data.map_rows(ds, tokenize, identity, "Tokenizing conversations")
        counts = None
        if isinstance(rows, datasets.Dataset):  # a stream's rows are only known as they are read
            counts = np.bincount(np.asarray(rows["status"], dtype=np.int64), minlength=5).tolist()
            if counts[KEPT] + counts[TRUNCATED] == 0:
                raise UserError(f"no usable conversation in {len(rows)} rows: {describe(counts, cfg)}")

        def assemble(batch):
            keep = [i for i, status in enumerate(batch["status"]) if status in (KEPT, TRUNCATED)]
            ids, labels = [batch["input_ids"][i] for i in keep], [batch["labels"][i] for i in keep]
            out = pack(ids, labels, length) if packed else {
                "input_ids": ids, "labels": labels, "attention_mask": [[1] * len(x) for x in ids]}
            if counts is not None:
                out[COUNTS] = [counts] * len(out["input_ids"])
            return out

        return data.map_rows(rows, assemble, (packed, counts), "Packing" if packed else "Keeping usable rows")

    def notes(self, cfg, train_ds, eval_ds) -> List[str]:
        lines = []
        for name, ds in (("train", train_ds), ("eval", eval_ds)):
            if isinstance(ds, datasets.Dataset) and COUNTS in ds.column_names and len(ds):
                counts = ds[0][COUNTS]
                if counts[KEPT] != sum(counts):
                    lines.append(f"sft: {name}: {describe(counts, cfg)}")
        if cfg.data.streaming:
            lines.append(f"sft: streaming: conversations longer than data.block_size are {cfg.sft.overflow}d and "
                         "rows without an assistant turn dropped as they are read (not counted in advance)")
        return lines

    def collator(self, tokenizer, cfg, buckets, rows=None):
        return SftCollator(tokenizer.pad_token_id, buckets, rows)

    def bind(self, cfg, model, accelerator) -> "SftRun":
        return SftRun(self, cfg, accelerator)


class SftRun(CausalRun):
    """causal_lm's loss on the trained tokens; evaluation adds ``answer_accuracy``; the sample answers a prompt."""

    def eval_outputs(self, model, batch) -> Dict[str, torch.Tensor]:
        token_losses, correct, targets = self.token_results(model, batch)
        return {**language.row_outputs(token_losses, correct, targets), **answer_outputs(correct, targets)}

    def metrics(self, gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
        answers = int(gathered["answers"].sum())
        return {**language.metrics(gathered), "answer_accuracy": float(gathered["answers_correct"].sum() / max(answers, 1)),
                "answers": answers}

    def sample(self, model, tokenizer, eval_ds) -> Optional[Dict[str, str]]:
        """A greedy answer to ``eval.prompt`` (a user message) or, by default, to the first held-out
        conversation's prompt (its tokens before its first answer), with the answer it holds."""
        cfg, expected = self.cfg, None
        if cfg.eval.prompt is not None:
            if not tokenizer.chat_template:
                return None
            prompt = templates.render(tokenizer, [{"role": "user", "content": cfg.eval.prompt}], "eval.prompt",
                                 add_generation_prompt=True)
            ids = templates.encode(tokenizer, prompt)[0]
        else:
            if len(eval_ds) == 0:
                return None
            row = eval_ds[0]
            ids, labels = row["input_ids"], row["labels"]
            if "position_ids" in row:  # the block's first conversation
                starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(ids)]
                ids, labels = ids[:starts[1]], labels[:starts[1]]
            first = next((i for i, label in enumerate(labels) if label != IGNORE), None)
            if first is None:
                return None
            end = next((i for i in range(first, len(labels)) if labels[i] == IGNORE), len(labels))
            ids, expected = ids[:first], tokenizer.decode(ids[first:end], skip_special_tokens=True).strip()
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        with torch.no_grad():
            inputs = torch.tensor([ids], device=device)
            out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                 max_new_tokens=cfg.eval.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
        model.train(was_training)
        sample = {"prompt": tokenizer.decode(ids),
                  "generated": tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)}
        if expected is not None:
            sample["expected"] = expected
        return sample


def encode_row(tokenizer, row: Dict, cfg, length: int):
    """(token ids, labels, fate) of one row; the labels are the ids where trained on, else ``IGNORE``."""
    s = cfg.sft
    tools = templates.tool_schemas(row.get(s.tools_column), f"sft.tools_column, the row {templates.snippet(row)}")
    if s.train_on == "completion":
        where = f"sft.prompt_column/sft.completion_column, the row {templates.snippet(row)}"
        ids, mask = templates.prompt_completion_tokens(tokenizer, row[s.prompt_column], row[s.completion_column], where,
                                                       tools)
    else:
        value = row[s.messages_column]
        where = f"sft.messages_column, the row {templates.snippet(value)}"
        messages = templates.conversation(value, where)
        if not any(m["role"] == "assistant" for m in messages):
            return [], [], NO_ASSISTANT
        templates.check_tool_support(tokenizer, messages, tools, where)
        ids, mask = templates.conversation_tokens(tokenizer, messages, where, tools)
        if s.train_on == "all":
            mask = [1] * len(ids)
    labels = [t if m else IGNORE for t, m in zip(ids, mask)]
    if labels:
        labels[0] = IGNORE  # nothing before it to predict it from
    status = KEPT
    if len(ids) > length:
        if s.overflow == "drop":
            return [], [], TOO_LONG
        ids, labels, status = ids[:length], labels[:length], TRUNCATED
    if all(label == IGNORE for label in labels):
        return [], [], NOTHING_LEFT
    return ids, labels, status


def describe(counts: List[int], cfg) -> str:
    """What became of the rows, in words."""
    parts = [f"{counts[KEPT]} kept"]
    if counts[TRUNCATED]:
        parts.append(f"{counts[TRUNCATED]} longer than data.block_size={cfg.data.block_size or 'the model positions'} "
                     "truncated to it (sft.overflow=truncate)")
    if counts[TOO_LONG]:
        parts.append(f"{counts[TOO_LONG]} longer than data.block_size dropped (sft.overflow=drop)")
    if counts[NO_ASSISTANT]:
        parts.append(f"{counts[NO_ASSISTANT]} without an assistant turn dropped")
    if counts[NOTHING_LEFT]:
        parts.append(f"{counts[NOTHING_LEFT]} dropped with no token left to train on (an answer past "
                     "data.block_size: raise it, or sft.overflow=drop)")
    return ", ".join(parts)


def pack(ids: List[List[int]], labels: List[List[int]], length: int) -> Dict[str, list]:
    """Whole conversations, in order, into blocks of at most ``length`` tokens (a new block when the next one
    does not fit); ``position_ids`` restart at 0 at each conversation (its own segment)."""
    blocks = {"input_ids": [], "labels": [], "position_ids": [], "attention_mask": []}
    current = ([], [], [])

    def close():
        if current[0]:
            blocks["input_ids"].append(current[0])
            blocks["labels"].append(current[1])
            blocks["position_ids"].append(current[2])
            blocks["attention_mask"].append([1] * len(current[0]))

    for conversation, targets in zip(ids, labels):
        if len(current[0]) + len(conversation) > length:
            close()
            current = ([], [], [])
        current[0].extend(conversation)
        current[1].extend(targets)
        current[2].extend(range(len(conversation)))
    close()
    return blocks


class SftCollator:
    """Rows or blocks -> a batch padded to its longest (or to a bucket: static shapes); padding is never a
    target, and in blocks it is a segment of its own. ``rows``: evaluation fills a short last batch (``valid``)."""

    def __init__(self, pad_id: int, buckets: Optional[List[int]], rows: Optional[int] = None):
        self.pad_id, self.buckets, self.rows = pad_id, buckets, rows

    def __call__(self, features: List[Dict]) -> Dict[str, torch.Tensor]:
        features, real = data.fill_rows(features, self.rows)
        length = data.padded_length(max(len(f["input_ids"]) for f in features), self.buckets)

        def padded(key: str, value: int) -> torch.Tensor:
            return torch.tensor([list(f[key]) + [value] * (length - len(f[key])) for f in features])

        batch = {"input_ids": padded("input_ids", self.pad_id), "labels": padded("labels", IGNORE),
                 "attention_mask": padded("attention_mask", 0)}
        if "position_ids" in features[0]:
            batch["position_ids"] = torch.tensor([list(f["position_ids"]) + list(range(length - len(f["position_ids"])))
                                                  for f in features])
        if self.rows is not None:
            batch["valid"] = torch.arange(self.rows) < real
        return batch


def answer_outputs(correct: torch.Tensor, targets: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per row: the answers (runs of consecutive targets: an assistant turn or a completion) and those whose every
    token is the greedy choice (``correct``: per token, the argmax is the target). Static shapes (cumulative sums,
    no data-dependent indexing) for XLA."""
    counted = targets != IGNORE
    wrong = (counted & ~correct).long()
    before = torch.nn.functional.pad(counted[:, :-1], (1, 0), value=False)
    after = torch.nn.functional.pad(counted[:, 1:], (0, 1), value=False)
    starts, ends = counted & ~before, counted & ~after
    errors = torch.cumsum(wrong, dim=1)
    # The errors before each answer, carried along it: the running maximum of (errors before a start), as the
    # cumulative count never decreases.
    base = torch.cummax(torch.where(starts, errors - wrong, torch.zeros_like(errors)), dim=1).values
    return {"answers": ends.sum(dim=1), "answers_correct": (ends & (errors == base)).sum(dim=1)}


"""Reward models: a sequence classifier with one output, trained on preference pairs to score the chosen completion
above the rejected one, as TRL 1.16's RewardTrainer trains it.

Recipe keys: the model keys (``model.name_or_path``: a pretrained model, whose backbone gets a new score head, or a
reward model to train on; or ``model.config`` + ``model.tokenizer``), ``data.chat_template``, ``data.max_length``,
and the ``reward_model`` section (``RewardModelConfig``: the columns ``prompt_column``, ``chosen_column``,
``rejected_column`` as DPO reads them, the optional ``margin_column``, ``center_rewards_coefficient``).

The model is ``AutoModelForSequenceClassification`` with ``num_labels=1`` (a causal LM's backbone gets the ``score``
head, new), its padding token the tokenizer's (else its EOS, as TRL sets it): the reward of a sequence is the head's
output at its last token that is not padding. Rows are tokenized as DPO's (framework/tasks/pairs.py: text with EOS
after the completion, conversations through the chat template: what RewardTrainer tokenizes); a pair longer than
``data.max_length`` is dropped, as RewardTrainer drops it (the plan counts them). A pair's two sequences go through
the model in one forward pass.

The loss per pair is RewardTrainer's: -log sigmoid(r_chosen - r_rejected - margin) (margin 0 without
``margin_column``), plus ``center_rewards_coefficient`` x (r_chosen + r_rejected)^2; a sum over pairs, which the loop
divides by the pairs of the whole optimizer step (RewardTrainer's mean over the batch). Evaluation: the share of
held-out pairs whose chosen completion scores above the rejected one (``accuracy``, a tie as wrong) and the mean
margin r_chosen - r_rejected.

``model/`` loads as ``pipeline("text-classification")``; pass ``function_to_apply="none"`` for the raw reward (the
pipeline applies a sigmoid to a single output). Online RL scores completions with it as
``grpo.reward_functions: [model:PATH]`` (framework/tasks/online_rl/reward_models.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from datasets.fingerprint import Hasher
from transformers import AutoConfig, AutoModelForSequenceClassification
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

from framework import data, hub, templates
from framework.errors import UserError
from framework.tasks.base import MODEL_ERRORS, TaskRun, register
from framework.tasks.language import LanguageModel
from framework.tasks.pairs import PairCollator, PairColumns, PreferencePairs, pair_figures, short, tokenize_pair

MARGIN = "margin"  # the feature (and batch) name of a pair's margin, as RewardTrainer's collator names it
DROPPED = "reward_model_dropped"  # pairs longer than data.max_length, on every feature row (for the plan)
LABEL = "reward"  # the one output's name in model/'s config (id2label)


@dataclass
class RewardModelConfig(PairColumns):
    """Reward models (``task: reward_model``): a sequence classifier with one output, scoring the chosen completion of
    each pair above the rejected one."""

    margin_column: Optional[str] = None
    """A column holding a number per pair: how far above the rejected completion's reward the chosen one's should be
    (RewardTrainer's ``margin``: the loss is -log sigmoid(r_chosen - r_rejected - margin)); null: no margin."""
    center_rewards_coefficient: Optional[float] = field(default=None, metadata={"ge": 0.0})
    """Adds this x (r_chosen + r_rejected)^2 to each pair's loss, pulling rewards toward mean zero (RewardTrainer's
    ``center_rewards_coefficient``, Eisenstein et al. 2023; 0.01 is its recommended value); null: none."""


def rewards(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The reward of every row of the batch (fp32): the score head's one output at its last non-padding token."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1).float()


def pair_losses(settings: RewardModelConfig, scores: torch.Tensor,
                margin: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Per pair: RewardTrainer's loss and the two rewards, from the rewards of the [chosen; rejected] rows."""
    chosen, rejected = scores.chunk(2)
    difference = chosen - rejected if margin is None else chosen - rejected - margin
    loss = -F.logsigmoid(difference)
    if settings.center_rewards_coefficient is not None:
        loss = loss + settings.center_rewards_coefficient * (chosen + rejected) ** 2
    return {"loss": loss, "rewards_chosen": chosen.detach(), "rewards_rejected": rejected.detach()}


@register("reward_model")
class RewardModel(PreferencePairs, LanguageModel):
    """The model keys and tokenizer are the language models' (``LanguageModel``); the rows are preference pairs."""

    pipeline = "text-classification"
    peft_task_type = "SEQ_CLS"  # peft trains the new score head in full beside the adapters
    metric = "accuracy"
    options = ("reward_model", RewardModelConfig)
    reads = ("data.max_length", "data.chat_template", "reward_model")

    def metric_names(self):
        return ("loss", "accuracy", "margin", "rewards_chosen", "rewards_rejected")

    def columns(self, cfg) -> Dict[str, str]:
        columns = super().columns(cfg)
        if cfg.reward_model.margin_column:
            columns["reward_model.margin_column"] = cfg.reward_model.margin_column
        return columns

    def keep_row(self, cfg):
        """A usable pair (``PreferencePairs``) whose margin, where the recipe names one, is a finite number."""
        pair = super().keep_row(cfg)
        column = cfg.reward_model.margin_column
        prompt_column = cfg.reward_model.prompt_column
        if not column:
            return pair

        def check(row) -> bool:
            value = row[column]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                raise UserError(f"reward_model.margin_column: the row with prompt {short(row[prompt_column])}: the "
                                f"margin '{column}' is {value!r}, not a number; fix or remove the row")
            return pair(row)

        return check

    # ------------------------------------------------------------ model

    def load(self, cfg, train, evaluation):
        """(a sequence classifier with one output, its tokenizer): padding set (its EOS where it has none, as
        RewardTrainer sets it), the chat template of ``data.chat_template``, the embeddings grown for its tokens."""
        tokenizer, key = self.tokenizer(cfg)
        templates.use_template(tokenizer, cfg.data.chat_template, needed=False)
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise UserError(f"{key}: the tokenizer has neither a padding nor an EOS token; the reward is read at "
                                "the last token that is not padding: use a tokenizer with one")
            tokenizer.pad_token = tokenizer.eos_token
        one_output = {"num_labels": 1, "id2label": {0: LABEL}, "label2id": {LABEL: 0}}
        if cfg.model.config is not None:
            bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
            config = self.new_config(cfg, {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                                           "eos_token_id": tokenizer.eos_token_id, "bos_token_id": bos, **one_output})
            _check_classifier(config, f"model.config: model_type '{config.model_type}'")
            model = self.from_config(AutoModelForSequenceClassification, config)
        else:
            name = cfg.model.name_or_path
            try:
                _check_classifier(hub.from_pretrained(AutoConfig, name), f"model.name_or_path: '{name}'")
                # A model with another head (a causal LM's, a classifier's of other labels) gets a new score head.
                model = hub.from_pretrained(AutoModelForSequenceClassification, name, ignore_mismatched_sizes=True,
                                            **one_output)
            except MODEL_ERRORS as e:
                raise UserError(f"model.name_or_path: cannot load '{name}' as a reward model: "
                                f"{str(e).splitlines()[0]}") from None
        model.config.pad_token_id = tokenizer.pad_token_id  # where each row's last real token is
        if hasattr(model.config, "use_cache"):
            model.config.use_cache = False  # a classifier never generates: no key/value cache in its forward
        templates.resize_embeddings(model, tokenizer)
        data.check_length("data.max_length", cfg.data.max_length, tokenizer, model)
        return model, tokenizer

    def sequence_length(self, cfg, model) -> int:
        return cfg.data.max_length

    def bind(self, cfg, model, accelerator) -> "RewardRun":
        return RewardRun(self, cfg)

    # ------------------------------------------------------------ data

    def prepare(self, ds, tokenizer, model, cfg):
        """Rows -> each pair's chosen and rejected token sequences (and margin); pairs longer than
        ``data.max_length`` dropped, their count on every row (``DROPPED``) for the plan."""
        columns = self.columns(cfg)
        prompt_col, chosen_col, rejected_col = (columns[k] for k in self.pair_keys())
        margin_col, length = cfg.reward_model.margin_column, cfg.data.max_length

        def tokenize(batch):
            out = {"chosen_ids": [], "rejected_ids": [], "prompt_length": [], "length": []}
            for prompt, chosen, rejected in zip(batch[prompt_col], batch[chosen_col], batch[rejected_col]):
                start, (chosen_ids, rejected_ids) = tokenize_pair(tokenizer, prompt, chosen, rejected)
                out["chosen_ids"].append(chosen_ids)
                out["rejected_ids"].append(rejected_ids)
                out["prompt_length"].append(start)
                out["length"].append(max(len(chosen_ids), len(rejected_ids)))
            if margin_col:
                out[MARGIN] = [float(m) for m in batch[margin_col]]
            return out

        identity = (data.tokenizer_identity(tokenizer), tokenizer.chat_template, prompt_col, chosen_col, rejected_col,
                    margin_col)
        ds = data.map_rows(ds, tokenize, identity, "Tokenizing pairs")
        if not isinstance(ds, datasets.Dataset):  # a stream: dropped as read
            return ds.filter(lambda n: n <= length, input_columns="length")
        dropped = sum(1 for n in ds["length"] if n > length)
        if dropped == len(ds) and len(ds):
            raise UserError(f"data.max_length={length}: every pair is longer (the longest {max(ds['length'])} "
                            "tokens); raise data.max_length")
        ds = ds.filter(lambda n: n <= length, input_columns="length",
                       new_fingerprint=Hasher.hash((ds._fingerprint, length, "kept")))
        return ds.add_column(DROPPED, [dropped] * len(ds), new_fingerprint=Hasher.hash(
            (ds._fingerprint, dropped))) if dropped else ds

    def collator(self, tokenizer, cfg, buckets, rows=None):
        return PairCollator(tokenizer.pad_token_id, buckets, rows, values=(MARGIN,) if cfg.reward_model.margin_column
                            else ())

    def notes(self, cfg, train_ds, eval_ds) -> List[str]:
        lines = []
        for name, ds in (("train", train_ds), ("eval", eval_ds)):
            if isinstance(ds, datasets.Dataset) and DROPPED in ds.column_names and len(ds):
                lines.append(f"reward_model: {name}: {ds[0][DROPPED]} pairs longer than data.max_length="
                             f"{cfg.data.max_length} tokens dropped (as TRL's RewardTrainer drops them)")
        if cfg.data.streaming:
            lines.append("reward_model: streaming: pairs longer than data.max_length are dropped as they are read "
                         "(not counted in advance)")
        return lines


class RewardRun(TaskRun):
    """RewardTrainer's loss of one run (its ``reward_model`` keys) and the evaluation on held-out pairs."""

    def __init__(self, task, cfg):
        super().__init__(task, cfg)
        self.settings = cfg.reward_model

    def workload(self, model):
        return dataclasses.replace(super().workload(model), sequences=2)

    def targets(self, batch: Dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2  # pairs

    def _outputs(self, model, batch) -> Dict[str, torch.Tensor]:
        return pair_losses(self.settings, rewards(model, batch), batch.get(MARGIN))

    def loss_sum(self, model, batch) -> torch.Tensor:
        return self._outputs(model, batch)["loss"].sum()

    def eval_outputs(self, model, batch) -> Dict[str, torch.Tensor]:
        return self._outputs(model, batch)

    def metrics(self, gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
        """Means over the held-out pairs: the loss, the share scored the right way round (RewardTrainer's
        ``accuracy``, a tie as wrong), the mean margin r_chosen - r_rejected (its ``margin``), each side's mean."""
        return pair_figures(gathered)


def _check_classifier(config, what: str) -> None:
    """A model type transformers has a sequence classifier for."""
    if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise UserError(f"{what} has no sequence classifier in transformers (AutoModelForSequenceClassification), "
                        "which a reward model is; use a causal LM (llama, gpt2, qwen2, ...) or an encoder")

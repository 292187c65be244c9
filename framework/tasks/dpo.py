"""Preference tuning: DPO, IPO and SimPO on (prompt, chosen, rejected) rows.

Recipe keys: the language-model keys (``model.name_or_path``, or ``model.config`` + ``model.tokenizer``),
``data.chat_template``, ``data.max_length``, ``eval.prompt``, ``eval.max_new_tokens``, and the ``dpo`` section
(``DpoConfig``: ``loss``, ``beta``, ``simpo_gamma``, ``precompute_reference``, and the columns
``prompt_column``, ``chosen_column``, ``rejected_column``: strings, or conversations rendered with the chat
template).

Rows are tokenized as TRL's DPOTrainer does: the prompt, and the prompt followed by each completion (a string
completion gets the EOS token); the completion starts where the two token sequences part. A pair's chosen and
rejected sequences go through the model in one forward pass (one batch, chosen rows then rejected rows), and
each sequence's log-probability is the sum over its completion tokens only (``completion_logps``). Sequences
are cut at ``data.max_length`` from the end; a pair left without completion tokens is dropped. The columns, the
rows' checks, the tokenization and the batches are those of every task on pairs (framework/tasks/pairs.py).

The reference model, for the losses that have one (sigmoid, ipo): a frozen copy of the starting weights on the
accelerator's device (rebuilt from them on resume, so it is never in a checkpoint); with ``peft`` the trained
model itself with its adapter switched off (no second copy); with ``dpo.precompute_reference`` its
log-probabilities, computed once before training on the host and cached with the tokenized rows. SimPO has none.

The loss is a sum over pairs; the loop divides it by the pairs of the whole optimizer step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Literal, Optional, Tuple

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from datasets.fingerprint import Hasher

from framework import data
from framework.errors import UserError
from framework.tasks.base import register
from framework.tasks.causal_lm import CausalLM, CausalRun
from framework.tasks.completions import Reference, load_completion_model, target_logprobs
from framework.tasks.language import IGNORE
from framework.tasks.pairs import PairCollator, PairColumns, PreferencePairs, pair_figures, tokenize_pair


@dataclass
class DpoConfig(PairColumns):
    """Preference tuning (``task: dpo``): the policy learns to prefer ``chosen`` over ``rejected`` completions."""

    loss: Literal["sigmoid", "ipo", "simpo"] = "sigmoid"
    """sigmoid: DPO (Rafailov et al. 2023), -log sigmoid(beta * (chosen log-ratio - rejected log-ratio)), log-ratios
    against the reference model; ipo: IPO (Azar et al. 2023), the squared distance of the per-token log-ratio
    margin from 1/(2 beta), as TRL computes it; simpo: SimPO (Meng et al. 2024), reference-free,
    -log sigmoid(beta * (mean chosen log-prob - mean rejected log-prob) - gamma), with no reference model at all."""
    beta: float = field(default=0.1, metadata={"gt": 0.0})
    """How far the policy may move from the reference (sigmoid, ipo: the KL penalty's weight; ipo: the margin
    target is 1/(2 beta)); simpo: the reward scale (SimPO's paper uses 2 to 10)."""
    simpo_gamma: float = field(default=0.5, metadata={"ge": 0.0})
    """simpo: the target reward margin gamma (TRL's simpo_gamma; its paper's gamma/beta is 0.5 with beta 2)."""
    precompute_reference: bool = False
    """sigmoid, ipo: compute the reference model's log-probabilities of every pair once, before training (on the
    host, cached with the tokenized data), so that training holds one model and runs one forward per step.
    false: a frozen copy of the starting weights (with ``peft``: the same model with its adapter off) runs
    beside the policy at every step."""


def completion_logps(model: torch.nn.Module, batch: Dict[str, torch.Tensor], chunk: Optional[int] = None,
                     select: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its completion tokens (``labels`` other than IGNORE; fp32) and
    how many there are (``target_logprobs``' ``chunk`` and ``select``)."""
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE)  # shift the targets, not the logits (no copy)
    return target_logprobs(model, batch, targets, chunk, select).sum(dim=1), (targets != IGNORE).sum(dim=1)


def pair_losses(dpo, logps: torch.Tensor, counts: torch.Tensor,
                reference: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Per pair: the loss, the rewards of chosen and rejected, and the policy's log-probabilities, from the
    concatenated [chosen; rejected] rows' summed log-probabilities (``logps``), completion token ``counts``
    and the reference's summed log-probabilities (None for simpo). The formulas are TRL's: DPOTrainer's
    sigmoid and ipo (ipo on per-token log-ratios), CPOTrainer's simpo (per-token log-probabilities, with
    cpo_alpha 0: no NLL term)."""
    chosen, rejected = logps.chunk(2)
    chosen_n, rejected_n = counts.to(logps.dtype).clamp(min=1).chunk(2)
    beta = dpo.beta
    if dpo.loss == "simpo":
        chosen_score, rejected_score = chosen / chosen_n, rejected / rejected_n
        loss = -F.logsigmoid(beta * (chosen_score - rejected_score) - dpo.simpo_gamma)
    else:
        ref_chosen, ref_rejected = reference.chunk(2)
        chosen_score, rejected_score = chosen - ref_chosen, rejected - ref_rejected
        if dpo.loss == "sigmoid":
            loss = -F.logsigmoid(beta * (chosen_score - rejected_score))
        else:  # ipo
            loss = (chosen_score / chosen_n - rejected_score / rejected_n - 1 / (2 * beta)) ** 2
    return {"loss": loss, "rewards_chosen": beta * chosen_score.detach(),
            "rewards_rejected": beta * rejected_score.detach(), "logps_chosen": chosen.detach(),
            "logps_rejected": rejected.detach()}


@register("dpo")
class DPO(PreferencePairs, CausalLM):
    metric = "reward_accuracy"
    options = ("dpo", DpoConfig)
    moved_from_data = ("prompt_column", "chosen_column", "rejected_column")
    reads = ("model.config_overrides", "data.max_length", "data.chat_template", "eval.prompt", "eval.max_new_tokens",
             "eval.harness", "dpo")

    # ------------------------------------------------------------ recipe keys, model

    def check(self, cfg, strategy) -> List[str]:
        problems = super().check(cfg, strategy)
        d = cfg.dpo
        if strategy.shards_parameters and d.loss != "simpo":
            problems.append(f"dpo.loss: {d.loss}'s reference model is not built under FSDP or DeepSpeed yet (its "
                            "weights load on the first process only); use distributed.strategy=ddp, or "
                            "dpo.loss=simpo (no reference)")
        if strategy.tensor_parallel > 1 and d.loss != "simpo":
            problems.append(f"dpo.loss: {d.loss}'s reference model is not built under tensor parallelism yet (the "
                            "losses there did not follow one process's); remove distributed.tensor_parallel, or use "
                            "dpo.loss=simpo (no reference)")
        if d.precompute_reference and d.loss == "simpo":
            problems.append("dpo.precompute_reference: simpo has no reference model; remove it")
        if d.precompute_reference and cfg.data.streaming:
            problems.append("dpo.precompute_reference: a stream is never all read before training; set "
                            "data.streaming=false or dpo.precompute_reference=false")
        return problems

    def metric_names(self):
        return ("loss", "reward_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected")

    def load(self, cfg, train, evaluation):
        return load_completion_model(self, cfg)

    def sequence_length(self, cfg, model) -> int:
        return cfg.data.max_length

    def bind(self, cfg, model, accelerator) -> "DpoRun":
        """The run's ``dpo`` keys and, where a reference model runs at every step, that model: made from the model as
        loaded, so that it is the starting weights, on a resume too."""
        needed = cfg.dpo.loss != "simpo" and not cfg.dpo.precompute_reference
        return DpoRun(self, cfg, accelerator, Reference.of(model, accelerator) if needed else None)

    # ------------------------------------------------------------ data

    def prepare(self, ds, tokenizer, model, cfg):
        """Rows -> each pair's chosen and rejected token sequences, where its completion starts, and its
        length; with ``dpo.precompute_reference``, the reference log-probabilities of both."""
        columns = self.columns(cfg)
        prompt_col, chosen_col, rejected_col = (columns[k] for k in self.pair_keys())
        length = cfg.data.max_length

        def tokenize(batch):
            out = {"chosen_ids": [], "rejected_ids": [], "prompt_length": [], "length": []}
            for prompt, chosen, rejected in zip(batch[prompt_col], batch[chosen_col], batch[rejected_col]):
                start, sequences = tokenize_pair(tokenizer, prompt, chosen, rejected)
                sequences = [ids[:length] for ids in sequences]
                if min(len(ids) for ids in sequences) <= start:  # a completion cut away entirely
                    continue
                out["prompt_length"].append(start)
                out["chosen_ids"].append(sequences[0])
                out["rejected_ids"].append(sequences[1])
                out["length"].append(max(len(ids) for ids in sequences))
            return out

        identity = (data.tokenizer_identity(tokenizer), tokenizer.chat_template, prompt_col, chosen_col, rejected_col,
                    length)
        ds = data.map_rows(ds, tokenize, identity, "Tokenizing pairs")
        if isinstance(ds, datasets.Dataset) and len(ds) == 0:
            raise UserError(f"data.max_length={length}: every pair's prompt fills data.max_length, leaving no "
                            "completion token; raise data.max_length (or shorten the prompts)")
        if cfg.dpo.precompute_reference:
            ds = self._with_reference(ds, tokenizer, model, cfg)
        return ds

    def _with_reference(self, ds: datasets.Dataset, tokenizer, model, cfg) -> datasets.Dataset:
        """The reference log-probabilities as two more columns, computed with the starting weights (``model``
        as loaded, on the host) and cached under a fingerprint of the rows and of those weights."""
        collate = self.collator(tokenizer, cfg, None)
        chunk = cfg.train.loss_chunk_tokens if cfg.train.chunked_loss else None  # as the frozen copy would compute them
        was_training = model.training
        model.eval()

        def reference(batch):
            rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
            with torch.no_grad():
                logps = completion_logps(model, collate(rows), chunk, select=True)[0]  # on the host: dynamic
            chosen, rejected = logps.chunk(2)
            return {"ref_chosen_logps": chosen.tolist(), "ref_rejected_logps": rejected.tolist()}

        batch_size = cfg.train.eval_batch_size or 2 * cfg.train.batch_size
        ds = ds.map(reference, batched=True, batch_size=batch_size, desc="Reference log-probabilities",
                    new_fingerprint=Hasher.hash((ds._fingerprint, weights_digest(model), chunk, "selected reference")))
        model.train(was_training)
        return ds

    def collator(self, tokenizer, cfg, buckets, rows=None):
        return PairCollator(tokenizer.pad_token_id, buckets, rows)

    def default_prompt(self, tokenizer, eval_ds) -> str:
        """The first eval pair's prompt: the sample is the model's own answer to it."""
        row = eval_ds[0]
        return tokenizer.decode(row["chosen_ids"][:row["prompt_length"]])


class DpoRun(CausalRun):
    """The preference loss of one run, with its reference (None: simpo, or precomputed log-probabilities); a pair's
    two sequences go through the model in one forward pass."""

    def __init__(self, task, cfg, accelerator=None, reference: Optional[Reference] = None):
        super().__init__(task, cfg, accelerator)
        self.reference = reference

    def workload(self, model):
        return dataclasses.replace(super().workload(model), sequences=2,
                                   frozen=self.reference.models() if self.reference else [])

    def targets(self, batch: Dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2  # pairs

    def _outputs(self, model, batch) -> Dict[str, torch.Tensor]:
        logps, counts = completion_logps(model, batch, self.loss_chunk, self.select_targets)
        return pair_losses(self.cfg.dpo, logps, counts, self._reference_logps(model, batch))

    def _reference_logps(self, model, batch) -> Optional[torch.Tensor]:
        if "reference_logps" in batch:
            return batch["reference_logps"]
        if self.reference is None:
            return None
        return self.reference.logprobs(
            model, lambda reference: completion_logps(reference, batch, self.loss_chunk, self.select_targets)[0])

    def loss_sum(self, model, batch) -> torch.Tensor:
        return self._outputs(model, batch)["loss"].sum()

    def eval_outputs(self, model, batch) -> Dict[str, torch.Tensor]:
        return self._outputs(model, batch)

    def metrics(self, gathered: Dict[str, np.ndarray]) -> Dict[str, float]:
        """Means over pairs, as TRL logs them (rewards/accuracies counts chosen > rejected, a tie as wrong)."""
        return {**pair_figures(gathered, "reward_"),
                "logps_chosen": float(gathered["logps_chosen"].mean(dtype=np.float64)),
                "logps_rejected": float(gathered["logps_rejected"].mean(dtype=np.float64))}


def weights_digest(model: torch.nn.Module) -> str:
    """A SHA-256 of every weight (names, dtypes, values): what cached reference log-probabilities depend on."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()

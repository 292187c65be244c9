"""Sampling completions keyed by example, not by process: what one row draws depends only on its key.

Online RL draws several completions per prompt. A sampler seeded per process (TRL's ``set_seed(seed,
device_specific=True)``) draws other completions when the process count or the accumulation changes, so runs
cannot be compared or reproduced across launches. Here each completion row gets its own ``torch.Generator``,
seeded from a key the caller derives from what identifies the draw (``row_seed``: the run's seed, the epoch,
the prompt's index in the dataset, the completion's number), and generation is ``model.generate`` itself (KV
cache, stopping at the stop tokens, left-padded batches) in greedy mode with one more logits processor,
:class:`KeyedSampling`: it turns the scores into the sampling distribution (temperature, then top-k, then
top-p: transformers' own warpers, as ``generate(do_sample=True)`` applies them) and adds Gumbel noise drawn
from each row's generator. The argmax of log-probabilities plus independent Gumbel(0, 1) noise is an exact
sample of the distribution (the Gumbel-max trick), so greedy decoding of the noised scores samples, and row r's
t-th token uses the t-th draw of row r's generator whatever else is in the batch.

What may still differ between layouts is the logits themselves in their last bits (a batch of another size or
padding sums in another order); a draw changes only where that moves the argmax of the noised scores, a tie
to within rounding: rare (tests/test_task_contract.py's runs on 1 and 2 processes and with accumulation draw the
same completions at every step).

The model's own generation defaults (``generation_config.json``: a repetition penalty, suppressed tokens, its
sampling settings) are set aside while sampling: they would change the distribution sampled from, which must be
the one the loss's log-probabilities describe (the model's logits over the temperature, as TRL computes them).

Online RL samples with its own generator (framework/tasks/online_rl/generator.py: a static cache, one prefill of
the distinct prompts, keyed sampling through ``KeyedSampling.noised``), which draws what ``generate`` here draws;
``generate`` runs the models the generator does not (sliding-window attention) and is what it is checked against.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import numpy as np
import torch
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: the warpers' settings, the longest completion, and the token ids that end one."""

    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1.0: off
    max_new_tokens: int
    stop_ids: Sequence[int]
    pad_id: int


def row_seed(*key: int) -> int:
    """A 63-bit generator seed from non-negative integers (numpy's SeedSequence hashing: nearby keys give
    unrelated streams)."""
    state = np.random.SeedSequence([int(k) for k in key]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


class KeyedSampling(LogitsProcessor):
    """The last logits processor of a greedy ``generate``: warps the scores (temperature, top-k, top-p) and adds
    Gumbel noise from each row's own generator, so that the argmax ``generate`` takes is a sample.

    ``device``: where the generators draw. A row's stream depends on it (a CUDA generator's differs from the CPU's),
    so a backend without generators of its own (XLA) draws on the host, ``torch.device("cpu")``, the CPU's stream,
    and the noise is moved to the scores' device: the same draws as on the CPU."""

    def __init__(self, sampling: Sampling, seeds: Sequence[int], device: torch.device):
        self.warpers = [TemperatureLogitsWarper(sampling.temperature)]
        if sampling.top_k:
            self.warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling.top_p))
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.noised(scores)

    def warped(self, scores: torch.FloatTensor) -> torch.FloatTensor:
        """The sampling distribution's log-probabilities: -inf where the warpers removed a token."""
        for warper in self.warpers:
            scores = warper(None, scores)  # the warpers read the scores only
        return torch.log_softmax(scores.float(), dim=-1)

    def gumbel(self, vocabulary: int, rows: Optional[Sequence[int]] = None) -> torch.FloatTensor:
        """Gumbel(0, 1) noise, a row of ``vocabulary`` values from each generator of ``rows`` (default: all, in
        order), on the generators' device. A generator advances only when its row is drawn."""
        generators = self.generators if rows is None else [self.generators[r] for r in rows]
        uniform = torch.stack([torch.rand(vocabulary, generator=g, device=g.device) for g in generators])
        tiny = torch.finfo(uniform.dtype).tiny
        return -torch.log(-torch.log(uniform.clamp(min=tiny)))

    def noised(self, scores: torch.FloatTensor, rows: Optional[Sequence[int]] = None) -> torch.FloatTensor:
        """The warped log-probabilities plus Gumbel noise, row by row from the generators of ``rows`` (which
        row of the batch each of ``scores`` is; default: all, in order): framework/tasks/online_rl/generator.py
        draws for the rows that have not stopped."""
        return self.warped(scores) + self.gumbel(scores.shape[-1], rows).to(scores.device)


@contextmanager
def neutral_generation_defaults(model: torch.nn.Module) -> Iterator[None]:
    """``model``'s generation defaults set aside (module docstring); under peft, its base model's, which
    ``generate`` reads."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = base.generation_config
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


def generate(model: torch.nn.Module, prompts: List[List[int]], seeds: Sequence[int], sampling: Sampling,
             greedy: bool = False, synced: bool = False) -> List[List[int]]:
    """One completion per prompt (token ids, through its first stop token if it stopped), row i drawn with the
    generator seeded ``seeds[i]``; ``greedy``: the most likely tokens instead (evaluation). ``synced``: every
    process runs the model's forward until the last process's rows have stopped (transformers' ``synced_gpus``),
    for a sharded model whose forward gathers its weights collectively while the processes' prompts differ. The
    model is put in eval mode (no dropout) and left so; call it inside ``backend.generating``, which restores
    training mode."""
    device = next(model.parameters()).device
    input_ids, attention_mask = left_padded(prompts, sampling.pad_id)
    config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=False, num_beams=1,
                              pad_token_id=sampling.pad_id, eos_token_id=list(sampling.stop_ids))
    processors = LogitsProcessorList([] if greedy else [KeyedSampling(sampling, seeds, device)])
    model.eval()
    with torch.no_grad(), neutral_generation_defaults(model):
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             generation_config=config, logits_processor=processors, synced_gpus=synced)
    return cut_at_stops(out[:, input_ids.shape[1]:].tolist(), sampling.stop_ids)


def left_padded(prompts: List[List[int]], pad_id: int, width: Optional[int] = None):
    """(input_ids, attention_mask) of prompts left-padded to the longest (or to ``width``): every row's next token
    is at the end."""
    longest = width or max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, ids in enumerate(prompts):
        input_ids[i, longest - len(ids):] = torch.tensor(ids)
        attention_mask[i, longest - len(ids):] = 1
    return input_ids, attention_mask


def cut_at_stops(rows: List[List[int]], stop_ids: Sequence[int]) -> List[List[int]]:
    """Each generated row through its first stop token (all of it where none came)."""
    stops = set(stop_ids)
    return [row[:next((i + 1 for i, token in enumerate(row) if token in stops), len(row))] for row in rows]

"""Online RL's own generator: a static KV cache, one prefill, fixed-shape decode steps, keyed sampling.

``framework.sampling.generate`` runs ``model.generate``; this draws the same completions (the same per-row keyed
Gumbel sampling, :class:`framework.sampling.KeyedSampling`) without transformers' generation machinery:

- One prefill per call, of the distinct prompts only: online RL samples each prompt ``num_generations`` times,
  and the copies' keys and values are the same, so each distinct prompt runs once (left-padded to the longest, the
  positions counting real tokens only, as ``model.generate`` does) and its keys and values are copied to its rows.
- A static cache (transformers' ``StaticCache``) of (rows, bucket + max_new_tokens) slots, kept between calls of
  the same shape: row i's prompt fills the slots just before the bucket's end, every row's t-th new token goes to
  slot bucket + t, so each decode step feeds one token per row at one slot and has the same shapes as the last.
  The bucket is the longest prompt rounded up to a power of two, at least 64 (``bucket``): on the CPU a decode
  step's time is reading the weights (benchmarks/generation.py: 540 MB for SmolLM2-135M against 3 MB of keys and
  values at 16 rows x 80 slots), so the masked slots cost little, and powers of two keep the shapes, hence the
  compiled graphs, few.
- Rows that have stopped are masked, not compacted: they still run through the model (the batch's shapes stay
  the same, which compiled decoding needs), but are not sampled; generation ends when every row has stopped.
  Compacting them away (dropping their rows from the batch and the cache) was no faster here: at 16 rows the
  step's time is reading the weights, whatever the rows (benchmark figures in the commit that removed it).
- The decode step optionally compiled (``torch.compile``, static shapes): a graph per (rows, slots) shape.
- Per row, optionally, the log-probability of each drawn token under the logits over the temperature, the
  distribution the loss's log-probabilities describe (tests/test_generator.py: equal to a plain forward's
  within 1e-5).

Stops: a stop token (``Sampling.stop_ids``, kept), ``max_new_tokens``, or (``stop_sequences``) a completion that
ends with one of the given token sequences (a tool call's closing tag).

``synced``: the processes' forwards gather sharded weights collectively, so every process runs as many decode
steps as the last one to stop: the processes all-reduce a "still running" flag each step.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from transformers import DynamicCache, StaticCache

from framework.sampling import KeyedSampling, Sampling, left_padded

SMALLEST_BUCKET = 64  # prompt slots of the cache: at least this many, else the next power of two


def bucket(longest_prompt: int) -> int:
    """The cache's prompt slots for a batch whose longest prompt has ``longest_prompt`` tokens."""
    return max(SMALLEST_BUCKET, 1 << (longest_prompt - 1).bit_length())


@dataclass
class Generated:
    """What a call returns: each row's completion (through its stop token or sequence, if it stopped) and, where
    asked for, each drawn token's log-probability under the logits over the temperature."""

    completions: List[List[int]]
    logprobs: Optional[List[List[float]]] = None


@dataclass
class Timings:
    """The last call's seconds: the prefill (with its copy into the cache), the decode steps, and their count."""

    prefill: float = 0.0
    decode: float = 0.0
    steps: int = 0


def next_logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor, cache: StaticCache) -> torch.Tensor:
    """One decode step: the logits (rows x vocabulary, fp32) after each row's one new token, which the model's
    attention layers write into ``cache`` at its next slot."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
                use_cache=True)
    return out.logits[:, -1].float()


class Generator:
    """Generates as ``framework.sampling.generate`` does (module docstring). Holds the static caches (one per
    (rows, slots) shape) and the compiled decode step between calls: keep one per model. ``compile``: the
    ``torch.compile`` backend to compile the decode step with ("inductor"; its first call per shape compiles it),
    None: eager."""

    def __init__(self, compile: Optional[str] = None, compact: str = "masked"):
        self.compact = compact
        self.step = torch.compile(next_logits, backend=compile, dynamic=False) if compile else next_logits
        self.caches: Dict[Tuple, StaticCache] = {}
        self.timings = Timings()

    def __call__(self, model: torch.nn.Module, prompts: List[List[int]], seeds: Sequence[int], sampling: Sampling,
                 greedy: bool = False, synced: bool = False, stop_sequences: Sequence[Sequence[int]] = (),
                 logprobs: bool = False) -> Generated:
        """One completion per prompt, row i drawn with the generator seeded ``seeds[i]`` (``greedy``: the most
        likely tokens); ``stop_sequences``: token sequences that also end a completion; ``logprobs``: record each
        drawn token's log-probability. ``model`` is put in eval mode and left so (as ``sampling.generate``)."""
        model.eval()
        with torch.inference_mode():
            return self._generate(model, prompts, seeds, sampling, greedy, synced,
                                  [list(s) for s in stop_sequences], logprobs)

    def _generate(self, model, prompts, seeds, sampling, greedy, synced, stop_sequences, logprobs) -> Generated:
        device = next(model.parameters()).device
        rows, new = len(prompts), sampling.max_new_tokens
        slots = bucket(max(len(p) for p in prompts))
        start = time.perf_counter()
        logits, cache = self._prefill(model, prompts, sampling.pad_id, slots, slots + new, device)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        # Valid slots: each prompt's, before the bucket's end, and every new token's (the causal mask hides a slot
        # until its token is written).
        attention_mask = (torch.arange(slots + new, device=device) >= slots - lengths[:, None]).long()
        position_ids = lengths[:, None].clone()  # a row's first new token comes after its prompt's real tokens
        sampler = None if greedy else KeyedSampling(sampling, seeds, device)
        completions: List[List[int]] = [[] for _ in range(rows)]
        recorded: Optional[List[List[float]]] = [[] for _ in range(rows)] if logprobs else None
        running = list(range(rows))
        batch = list(running)  # the row each of the cache's rows holds
        stops = set(sampling.stop_ids)
        self.timings = Timings(prefill=time.perf_counter() - start)
        start = time.perf_counter()
        while True:
            if running:  # under ``synced`` a process whose rows have all stopped still steps with the others
                where = {r: i for i, r in reversed(list(enumerate(batch)))}
                chosen = logits if batch == running else logits[[where[r] for r in running]]
                tokens = chosen.argmax(dim=-1) if sampler is None else sampler.noised(chosen, running).argmax(dim=-1)
                if recorded is not None:
                    logp = torch.log_softmax(chosen / sampling.temperature, dim=-1).gather(1, tokens[:, None])
                    for r, value in zip(running, logp[:, 0].tolist()):
                        recorded[r].append(value)
                for r, token in zip(running, tokens.tolist()):
                    completions[r].append(token)
                running = [r for r in running if not self._stopped(completions[r], new, stops, stop_sequences)]
            if not self._continues(bool(running), synced, device):
                break
            target = self._rows(len(running), len(batch))
            if target < len(batch):  # drop stopped rows from the batch and the cache
                keep = running or batch[:1]
                keep = keep + keep[:1] * (target - len(keep))
                index = torch.tensor([batch.index(r) for r in keep], device=device)
                cache = self._moved(model, cache, index, slots + new)
                attention_mask, position_ids, batch = attention_mask[index], position_ids[index], keep
            input_ids = torch.tensor([[completions[r][-1]] for r in batch], dtype=torch.long)
            logits = self.step(model, input_ids.to(device), position_ids, attention_mask, cache)
            position_ids += 1
            self.timings.steps += 1
        self.timings.decode = time.perf_counter() - start
        return Generated(completions, recorded)

    def _prefill(self, model, prompts, pad_id: int, slots: int, length: int, device) -> Tuple[torch.Tensor, StaticCache]:
        """The distinct prompts' forward (left-padded to the longest, with ``model.generate``'s positions): each
        row's next-token logits, and the static cache of (rows, ``length``) slots holding row i's prompt in the
        slots just before ``slots``."""
        distinct: Dict[Tuple[int, ...], int] = {}
        source = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]  # each row's distinct prompt
        input_ids, attention_mask = left_padded([list(p) for p in distinct], pad_id)
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        prefill = DynamicCache(config=model.config)
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                    position_ids=position_ids.to(device), cache=prefill, use_cache=True, logits_to_keep=1)
        index = torch.tensor(source, device=device)
        cache = self._cache(model, len(prompts), length)
        longest = input_ids.shape[1]
        for static, dynamic in zip(cache.layers, prefill.layers):
            keys, values = dynamic.keys.index_select(0, index), dynamic.values.index_select(0, index)
            if not static.is_initialized:
                static.lazy_initialization(keys, values)
            static.keys[:, :, slots - longest:slots].copy_(keys)
            static.values[:, :, slots - longest:slots].copy_(values)
            static.cumulative_length.fill_(slots)  # the next token's slot: every row's first new token
        return out.logits[:, -1].float().index_select(0, index), cache

    def _rows(self, running: int, rows: int) -> int:
        if self.compact == "masked":
            return rows
        if self.compact == "exact":
            return max(running, 1)
        return 1 << (max(running, 1) - 1).bit_length()

    def _moved(self, model, cache: StaticCache, index: torch.Tensor, length: int) -> StaticCache:
        """The cache of ``len(index)`` rows holding rows ``index`` of ``cache``."""
        smaller = self._cache(model, len(index), length)
        for target, source in zip(smaller.layers, cache.layers):
            keys, values = source.keys.index_select(0, index), source.values.index_select(0, index)
            if not target.is_initialized:
                target.lazy_initialization(keys, values)
            target.keys.copy_(keys)
            target.values.copy_(values)
            target.cumulative_length.copy_(source.cumulative_length)
        return smaller

    def _cache(self, model, rows: int, length: int) -> StaticCache:
        """The static cache of this shape, made at its first use and kept (a compiled step's graph is of its
        tensors); the slots a call does not write are masked, so what an earlier call left there is never read."""
        key = (rows, length)
        if key not in self.caches:
            self.caches[key] = StaticCache(config=model.config, max_cache_len=length)
        return self.caches[key]

    @staticmethod
    def _stopped(completion: List[int], new: int, stops, stop_sequences: List[List[int]]) -> bool:
        """Whether a row ends here: a stop token, the longest completion, or the end of a stop sequence."""
        return (completion[-1] in stops or len(completion) >= new
                or any(completion[-len(s):] == s for s in stop_sequences if len(completion) >= len(s)))

    @staticmethod
    def _continues(running: bool, synced: bool, device) -> bool:
        """Whether to run another decode step: while a row runs here, or, ``synced``, on any process."""
        if not (synced and dist.is_available() and dist.is_initialized()):
            return running
        flag = torch.tensor([float(running)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


_GENERATORS: "weakref.WeakKeyDictionary[torch.nn.Module, Generator]" = weakref.WeakKeyDictionary()


def generate(model: torch.nn.Module, prompts: List[List[int]], seeds: Sequence[int], sampling: Sampling,
             greedy: bool = False, synced: bool = False) -> List[List[int]]:
    """``framework.sampling.generate``'s contract (its docstring) with this module's generator, one per model
    (its caches kept between calls)."""
    if model not in _GENERATORS:
        _GENERATORS[model] = Generator()
    return _GENERATORS[model](model, prompts, seeds, sampling, greedy=greedy, synced=synced).completions

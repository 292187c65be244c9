"""Online RL's own generator: a static KV cache, one prefill, one-token decode steps, keyed sampling.

``sampling.generate`` runs ``model.generate``; this draws the same completions (the same per-row keyed Gumbel
sampling, :class:`framework.tasks.online_rl.sampling.KeyedSampling`: row r's t-th token from the t-th draw of its
own generator) without transformers' generation machinery, calling the model's forward itself:

- One prefill per call, of the distinct prompts only: online RL samples each prompt ``num_generations`` times,
  and the copies' keys and values are the same, so each distinct prompt runs once (left-padded to the longest,
  positions counting real tokens only, as ``model.generate`` has them: cumsum(mask) - 1) and its keys and values
  are copied to its rows.
- A static cache (transformers' ``StaticCache``) of (rows, bucket + max_new_tokens) slots, allocated once per call:
  row i's prompt fills the slots just before the bucket's end and every row's t-th new token goes to slot
  bucket + t, so a decode step feeds one token per row at one slot, and the attention mask (which slots hold a
  real token) and the step's shapes stay the same from step to step (until rows stop, below). The bucket is the
  longest prompt rounded up to a power of two, at least 64 (``bucket``): powers of two keep the shapes, so the
  compiled graphs, few, and the slots left empty cost little: a decode step reads every weight once, 558 MB for
  SmolLM2-135M with LoRA, against 59 MB for the whole cache at 16 rows x 80 slots.
- Rows that have stopped cost nothing more: each decode step runs the rows still running only, the stopped rows
  dropped from the batch and the cache (compacted) as they stop. Against keeping them in the batch, masked, on
  SmolLM2-135M with LoRA, 16 rows of which 7 stopped after 4 to 28 of 48 tokens, compaction's decode took 14%
  less CPU time (9.45 s against 10.93 s, medians of 8 alternated rounds on a shared 2-core machine): a step's
  time grows with its rows. Compiled decoding masks them instead: each row count would be another graph.
- The decode step optionally compiled (``torch.compile``, static shapes: one graph per cache shape, none after).
  Off by default, as it does not pay here: on SmolLM2-135M with LoRA (2 shared CPU cores) inductor took 138 s to
  compile the step (about 20 s from its cache) for 1.23x faster decode steps (42 ms saved a step: it pays after
  some 3,300 steps, 220 of the recipe's GRPO steps), and its fused kernels moved the log-probabilities by 1.7e-5;
  on the AMX Xeon, alone, 59.7 s for 1.15x (17 ms a step: about 3,450 steps, docs/benchmarks.md).
- Fixed shapes (``static``: XLA, where every new shape is another compiled graph): the prompts take a fixed
  number of slots (online RL's: ``data.max_length``), the distinct prompts are padded to a power of two, stopped
  rows are masked rather than dropped, and every decode step is the same graph, ended by ``sync``; the host reads
  the stop flags every ``CHECK_EVERY`` steps and the tokens once, at the end, cutting at stop sequences there. The
  keyed noise is drawn on the host (XLA has no generators of its own) and moved to the device: the CPU's draws.
  On an XLA device (tests/test_xla.py) the first sampled call compiles 2 graphs, the prefill and the decode
  step, greedy decoding 1 more (its decode step), and no later call any.
- Per row, optionally, the log-probability of each drawn token under the logits over the temperature, the
  distribution the loss's log-probabilities describe (tests/test_generator.py: a plain forward's of the whole
  sequence within 1e-5 on tiny models; on SmolLM2's 30 fp32 layers within 2.5e-5, as far as that forward is from
  itself run a row at a time).

Stops: a stop token (``Sampling.stop_ids``, kept), ``max_new_tokens``, or a completion that ends with one of
``stop_sequences`` (token sequences: a tool call's closing tag), kept.

``synced``: the processes' forwards gather sharded weights collectively, so every process runs as many decode
steps as the last one to stop: they all-reduce a "still running" flag each step (a process whose rows have all
stopped steps on with one of them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from transformers import DynamicCache, StaticCache

from framework.tasks.online_rl.sampling import KeyedSampling, Sampling, left_padded

SMALLEST_BUCKET = 64  # prompt slots of the cache: at least this many, else the next power of two
CHECK_EVERY = 4  # fixed shapes: decode steps between two reads of the stop flags by the host


def bucket(longest_prompt: int) -> int:
    """The cache's prompt slots for a batch whose longest prompt has ``longest_prompt`` tokens."""
    return max(SMALLEST_BUCKET, 1 << (longest_prompt - 1).bit_length())


@dataclass
class Generated:
    """A call's completions (through the stop token or sequence where one came) and, where asked for, each drawn
    token's log-probability under the logits over the temperature."""

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
    attention layers write into ``cache`` at its next slot (the same for every row)."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
                use_cache=True)
    return out.logits[:, -1].float()


class Generator:
    """Generates as ``sampling.generate`` does (module docstring). ``compile``: the ``torch.compile``
    backend of the decode step ("inductor"; its first call per cache shape compiles it; the instance keeps the
    compiled step across calls), None: eager.

    ``static``: fixed shapes (XLA, where each new shape is a new compiled graph; module docstring): the prompts
    take ``prompt_slots`` slots (default: their bucket), the distinct prompts are padded to a power of two, stopped
    rows are masked, and each decode step is the same computation on the device (``sync`` ends it: XLA's
    ``torch_xla.sync``, so that every step is one graph, compiled once); the host reads the stop flags every
    ``check_every`` steps, and the tokens once, at the end (``host``: a tensor to a host array or list, where
    ``.cpu()`` would not do; under xla_fsdp the tokens are sharded like the model's outputs, and a sharded tensor's
    ``.cpu()`` compiles a graph every time)."""

    def __init__(self, compile: Optional[str] = None, static: bool = False, prompt_slots: Optional[int] = None,
                 check_every: int = CHECK_EVERY, sync: Optional[Callable[[], None]] = None,
                 host: Optional[Callable[[torch.Tensor], object]] = None):
        self.compiled = compile is not None
        self.step = torch.compile(next_logits, backend=compile, dynamic=False) if compile else next_logits
        self.static, self.prompt_slots, self.check_every = static, prompt_slots, check_every
        self.sync = sync or (lambda: None)
        self.host = host or (lambda tensor: tensor.cpu())
        self.timings = Timings()

    def __call__(self, model: torch.nn.Module, prompts: List[List[int]], seeds: Sequence[int], sampling: Sampling,
                 greedy: bool = False, synced: bool = False, stop_sequences: Sequence[Sequence[int]] = (),
                 logprobs: bool = False) -> Generated:
        """One completion per prompt, row i drawn with the generator seeded ``seeds[i]`` (``greedy``: the most
        likely tokens); ``stop_sequences``: token sequences that also end a completion; ``logprobs``: record each
        drawn token's log-probability. ``model`` is put in eval mode and left so (as ``sampling.generate``)."""
        model.eval()
        # no_grad, not inference_mode: a sharded model's first forward may be this one, and tensors it makes
        # under inference_mode (FSDP2's unsharded parameters) could never be used by autograd after.
        with torch.no_grad():
            if self.static:
                return self._generate_static(model, prompts, seeds, sampling, greedy,
                                             [list(s) for s in stop_sequences], logprobs)
            return self._generate(model, prompts, seeds, sampling, greedy, synced,
                                  [list(s) for s in stop_sequences], logprobs)

    def _generate(self, model, prompts, seeds, sampling: Sampling, greedy: bool, synced: bool,
                  stop_sequences: List[List[int]], logprobs: bool) -> Generated:
        """The prefill, then a draw per running row and a decode step of the running rows (compiled: of every
        row) until every row has stopped (``synced``: on every process)."""
        device = next(model.parameters()).device
        rows, new = len(prompts), sampling.max_new_tokens
        slots = bucket(max(len(p) for p in prompts))
        start = time.perf_counter()
        logits, cache = self._prefill(model, prompts, sampling.pad_id, slots, slots + new, device)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        # The slots holding real tokens: each prompt's, before the bucket's end, and every new token's (the causal
        # mask hides a slot until its token is written).
        attention_mask = (torch.arange(slots + new, device=device) >= slots - lengths[:, None]).long()
        position_ids = lengths[:, None].clone()  # a row's first new token comes after its prompt's real tokens
        sampler = None if greedy else KeyedSampling(sampling, seeds, device)
        completions: List[List[int]] = [[] for _ in range(rows)]
        recorded: Optional[List[List[float]]] = [[] for _ in range(rows)] if logprobs else None
        running = list(range(rows))
        batch = list(running)  # the row each row of the cache (and of the step's logits) holds
        stops, steps = set(sampling.stop_ids), 0
        self.timings = Timings(prefill=time.perf_counter() - start)
        start = time.perf_counter()
        while True:
            if running:  # under ``synced`` a process whose rows have all stopped steps on with the others
                chosen = logits if batch == running else logits[[batch.index(r) for r in running]]
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
            if not self.compiled and len(batch) > max(len(running), 1):  # drop the stopped rows
                keep = running or batch[:1]
                index = torch.tensor([batch.index(r) for r in keep], device=device)
                cache.reorder_cache(index)  # transformers' batch selection (beam search's)
                attention_mask, position_ids, batch = attention_mask[index], position_ids[index], keep
            input_ids = torch.tensor([[completions[r][-1]] for r in batch], device=device)
            logits = self.step(model, input_ids, position_ids, attention_mask, cache)
            position_ids += 1
            steps += 1
        self.timings.decode, self.timings.steps = time.perf_counter() - start, steps
        return Generated(completions, recorded)

    def _generate_static(self, model, prompts, seeds, sampling: Sampling, greedy: bool,
                         stop_sequences: List[List[int]], logprobs: bool) -> Generated:
        """Fixed shapes (the class docstring): every row steps until all have stopped (checked every
        ``check_every`` steps) or ``max_new_tokens``; a stopped row's later tokens are padding, and the stop
        sequences are cut on the host at the end (a row's tokens before one do not depend on what follows)."""
        device = next(model.parameters()).device
        rows, new, pad = len(prompts), sampling.max_new_tokens, sampling.pad_id
        longest = max(len(p) for p in prompts)
        slots = self.prompt_slots or bucket(longest)
        if longest > slots:
            raise ValueError(f"the generator: a prompt of {longest} tokens, longer than its {slots} slots")
        start = time.perf_counter()
        logits, cache = self._prefill(model, prompts, pad, slots, slots + new, device, static=True)
        lengths = torch.tensor([len(p) for p in prompts]).to(device)
        attention_mask = (torch.arange(slots + new).to(device) >= slots - lengths[:, None]).long()
        position_ids = lengths[:, None]
        # On the host where the device has no generators of its own: the draws are the CPU's (sampling.py).
        sampler = None if greedy else KeyedSampling(sampling, seeds, device if device.type in ("cpu", "cuda")
                                                    else torch.device("cpu"))
        stop_ids = torch.tensor(list(sampling.stop_ids)).to(device)
        tokens_out = torch.full((rows, new), pad).to(device)
        logps_out = torch.zeros(rows, new).to(device) if logprobs else None
        done = torch.zeros(rows, dtype=torch.bool).to(device)
        columns, step = torch.arange(new).to(device), torch.zeros(1, dtype=torch.long).to(device)
        self.sync()
        self.timings = Timings(prefill=time.perf_counter() - start)
        start, steps = time.perf_counter(), 0
        while steps < new:
            tokens = (logits if sampler is None else sampler.noised(logits)).argmax(dim=-1)
            here = columns[None, :] == step  # this step's column of the outputs
            if logps_out is not None:
                logp = torch.log_softmax(logits / sampling.temperature, dim=-1).gather(1, tokens[:, None])
                logps_out = torch.where(here & ~done[:, None], logp, logps_out)
            tokens = torch.where(done, pad, tokens)
            tokens_out = torch.where(here, tokens[:, None], tokens_out)
            done = done | (tokens[:, None] == stop_ids[None, :]).any(dim=1)
            finished, step = done.all(), step + 1
            # Every step runs the model, the last one too (its logits unused): one graph for every step.
            logits = self.step(model, tokens[:, None], position_ids, attention_mask, cache)
            position_ids = position_ids + 1
            self.sync()
            steps += 1
            if steps % self.check_every == 0 and steps < new and bool(finished.item()):
                break
        rows_out = self.host(tokens_out).tolist()
        recorded = self.host(logps_out).tolist() if logps_out is not None else None
        self.timings.decode, self.timings.steps = time.perf_counter() - start, steps
        completions = [self._cut(row[:steps], set(sampling.stop_ids), stop_sequences) for row in rows_out]
        return Generated(completions, [r[:len(c)] for r, c in zip(recorded, completions)] if recorded else None)

    @staticmethod
    def _cut(tokens: List[int], stops, stop_sequences: List[List[int]]) -> List[int]:
        """A row's tokens through its first stop token or the end of its first stop sequence (all where none)."""
        for end in range(1, len(tokens) + 1):
            if tokens[end - 1] in stops or any(end >= len(s) and tokens[end - len(s):end] == s for s in stop_sequences):
                return tokens[:end]
        return tokens

    @staticmethod
    def _prefill(model, prompts, pad_id: int, slots: int, length: int, device,
                 static: bool = False) -> Tuple[torch.Tensor, StaticCache]:
        """The distinct prompts' forward (left-padded to the longest, with ``model.generate``'s positions): each
        row's next-token logits, and a static cache of (rows, ``length``) slots holding row i's prompt in the
        slots just before ``slots``, the next slot to write ``slots``. ``static``: the prompts left-padded to
        ``slots``, their number to a power of two (copies of the first), so that the shapes are the bucket's."""
        distinct: Dict[Tuple[int, ...], int] = {}
        source = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]  # each row's distinct prompt
        unique = [list(p) for p in distinct]
        if static:
            unique += unique[:1] * ((1 << (len(unique) - 1).bit_length()) - len(unique))
        input_ids, attention_mask = left_padded(unique, pad_id, slots if static else None)
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        prefill = DynamicCache(config=model.config)
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                    position_ids=position_ids.to(device), cache=prefill, use_cache=True, logits_to_keep=1)
        index = torch.tensor(source).to(device)
        prefill.reorder_cache(index)  # each row's copy of its prompt's keys and values
        cache = StaticCache(config=model.config, max_cache_len=length)
        if any(layer.is_sliding for layer in cache.layers):  # a window's slots wrap around: not this layout
            raise ValueError("the generator: models with sliding-window attention layers are not supported yet")
        first = slots - input_ids.shape[1]
        for static, dynamic in zip(cache.layers, prefill.layers):
            static.lazy_initialization(dynamic.keys, dynamic.values)  # its dtype, device and heads
            static.keys[:, :, first:slots].copy_(dynamic.keys)
            static.values[:, :, first:slots].copy_(dynamic.values)
            static.cumulative_length.fill_(slots)
        return out.logits[:, -1].float().index_select(0, index), cache

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


def supports(model: torch.nn.Module) -> bool:
    """Whether the generator can run ``model``: not where an attention layer has a sliding window (its cache's slots
    wrap around, not this layout); ``sampling.generate`` (transformers' ``generate``) runs those."""
    return not any(layer.is_sliding for layer in StaticCache(config=model.config, max_cache_len=1).layers)

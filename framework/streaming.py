"""Streaming (``data.streaming``): corpora read as ``datasets`` IterableDatasets, never held in memory whole.

Each process reads its own share of the rows (``split_dataset_by_node``: whole files when their number
divides by the process count, else every n-th row), and tokenizes (and packs) them on the fly with the
task's own ``prepare``. An epoch is one pass over the files; the next one reads them in another order
(seeded by ``seed`` and the epoch), so a run is sized by ``train.max_steps``. Each process counts its
own epochs: the loader never stops, so processes never wait for one another at an epoch's end.

Examples are drawn at random from a buffer of ``data.shuffle_buffer``. The loader's state (epoch, the
stream's position from ``IterableDataset.state_dict``, the buffer and its generator) is saved in every
checkpoint, one file per process, so a resumed run trains on exactly the batches an uninterrupted run
would, however often it is resumed.

Without an eval file, a row is held out for evaluation when a hash of its text (and ``seed``) falls in
``data.eval_fraction``: the split needs no pass over the data, and is the same in every epoch and process.
Evaluation reads the first ``eval.batches`` batches of the eval stream once, at the start.
"""

from __future__ import annotations

import zlib
from typing import Callable, Dict, List, Optional, Sequence

import datasets
import numpy as np
from accelerate.utils import send_to_device
from datasets.distributed import split_dataset_by_node

from framework import data
from framework.config import RunConfig
from framework.errors import UserError

DEFAULT_EVAL_BATCHES = 16


def notes(cfg: RunConfig, eval_examples: int) -> List[str]:
    """What the plan says about a stream."""
    every = f"every {cfg.eval.every_steps} steps and at the end" if cfg.eval.every_steps else "at the end"
    return [f"streaming: an epoch is one pass over the files by each process, its length unknown until read; "
            f"train.max_steps={cfg.train.max_steps} sizes the run",
            f"streaming: evaluation {every}, on the first {eval_examples} examples of the eval stream"]


def held_out(columns: List[str], seed: int, fraction: float) -> Callable[[Dict], bool]:
    """Whether a row belongs to the eval set: a stable hash of its texts, in ``fraction``."""
    def is_eval(row: Dict) -> bool:
        text = "\x1f".join(str(row[c]) for c in columns)
        return zlib.crc32(f"{seed}\x1e{text}".encode()) < fraction * 2**32
    return is_eval


def check_sources(cfg: RunConfig, columns: Dict[str, str]) -> None:
    """Fail before training on a source that is empty or lacks a column (reads each one's first row)."""
    named = [data.read_source(prefix, source, cfg.data, streaming=True) for prefix, source in data.train_sources(cfg.data)]
    evaluation, eval_name = data.read_eval(cfg.data, streaming=True)
    if evaluation is not None:
        named.append((evaluation, eval_name))
    for rows, name in named:
        first = next(iter(_read(rows.take(1), name)), None)
        if first is None:
            raise UserError(f"{name} is empty")
        data.check_columns(list(first), columns, name, {c: data.value_kind(v) for c, v in first.items()})


def rows(cfg: RunConfig, columns: Dict[str, str], keep_row, epoch: int, evaluation: bool, keep_all: bool = False,
         optional: Sequence[str] = ()):
    """The usable rows of the training sources for ``epoch`` (files reordered, sources mixed), or, with
    ``evaluation``, of the eval stream: the eval file, or the rows held out of the training sources. They keep
    only the task's ``columns`` and those of ``optional`` a source has (``Task.optional_columns``) unless
    ``keep_all`` (``Task.keeps_other_columns``)."""
    d, names = cfg.data, list(columns.values())

    def select(stream):
        if keep_all:
            return stream
        present = (stream.column_names or list(next(iter(stream.take(1)), {}))) if optional else []
        return stream.select_columns(data.kept_columns(present, columns, optional))
    is_eval = None if d.eval_file or (d.dataset and d.eval_split) else held_out(names, cfg.seed, d.eval_fraction)
    if evaluation and is_eval is None:
        stream = select(data.read_eval(d, streaming=True)[0])
        return stream.filter(keep_row) if keep_row else stream
    shuffle = np.random.default_rng([cfg.seed, epoch]).permutation
    parts, weights = [], []
    for prefix, source in data.train_sources(d):
        reorder = lambda paths: [paths[i] for i in shuffle(len(paths))]  # noqa: E731
        stream = select(data.read_source(prefix, source, d, streaming=True, order=reorder)[0])
        if keep_row:
            stream = stream.filter(keep_row)
        if is_eval is not None:
            stream = stream.filter(is_eval if evaluation else (lambda row: not is_eval(row)))
        parts.append(stream)
        weights.append(source.weight)
    return data.mix(parts, weights, cfg.seed + epoch)


def train_stream(cfg: RunConfig, task, tokenizer, model, rank: int, world: int) -> Callable[[int], datasets.IterableDataset]:
    """epoch -> this process's features for that epoch."""
    columns, keep_row = task.columns(cfg), task.keep_row(cfg)

    def make(epoch: int) -> datasets.IterableDataset:
        stream = rows(cfg, columns, keep_row, epoch, evaluation=False, keep_all=task.keeps_other_columns,
                      optional=list(task.optional_columns(cfg).values()))
        if cfg.data.max_train_samples:
            stream = stream.take(cfg.data.max_train_samples)
        return task.prepare(split_dataset_by_node(stream, rank, world), tokenizer, model, cfg)
    return make


def eval_set(cfg: RunConfig, task, tokenizer, model, rows_per_batch: int) -> datasets.Dataset:
    """The first ``eval.batches`` batches of the eval stream, as features in memory (the same on every process)."""
    stream = rows(cfg, task.columns(cfg), task.keep_row(cfg), 0, evaluation=True, keep_all=task.keeps_other_columns,
                  optional=list(task.optional_columns(cfg).values()))
    if cfg.data.max_eval_samples:
        stream = stream.take(cfg.data.max_eval_samples)
    wanted = (cfg.eval.batches or DEFAULT_EVAL_BATCHES) * rows_per_batch
    features = list(_read(task.prepare(stream, tokenizer, model, cfg).take(wanted), "the eval stream"))
    if not features:
        raise UserError("the eval stream is empty: no usable eval rows (or too few tokens for one block); add "
                        "data.eval_file, raise data.eval_fraction or lower data.block_size")
    return datasets.Dataset.from_list(features)


def _read(stream, name: str):
    """Iterate a stream, turning a reader's failure (found only now, when the file is read) into a UserError."""
    try:
        yield from stream
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{name}: cannot read it: {data.root_cause(e)}") from None


def _compact(value):
    """A list of integers (token ids) as an array, a quarter of a Python list's memory; anything else as it is
    (a conversation, strings, floats: an array would change them, and a checkpoint stores them in JSON)."""
    if not isinstance(value, list):
        return value
    try:
        array = np.asarray(value)
    except ValueError:  # ragged
        return value
    return array if array.dtype.kind in "iub" else value


class StreamLoader:
    """Endless batches (on ``device``) from ``make(epoch)``'s streams, one epoch after the other: an epoch's
    last incomplete batch is dropped. ``state_dict``/``load_state_dict``: the exact position."""

    def __init__(self, make: Callable[[int], datasets.IterableDataset], collate, batch_size: int,
                 buffer_size: int, seed: int, device):
        self.make, self.collate, self.batch_size, self.buffer_size = make, collate, batch_size, buffer_size
        self.seed, self.device = seed, device
        self.epoch, self._stream, self._buffer, self._rng = 0, None, [], None
        self._resume_at: Optional[dict] = None

    def state_dict(self) -> dict:
        """Valid between batches: every example read is then either trained on or in the buffer."""
        return {"epoch": self.epoch, "stream": self._stream.state_dict() if self._stream is not None else None,
                "buffer": list(self._buffer), "rng": self._rng.bit_generator.state if self._rng else None}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._buffer = state["epoch"], list(state["buffer"])
        self._stream, self._rng = None, None
        if state["stream"] is not None:
            self._resume_at = state

    def __iter__(self):
        while True:
            self._stream, resumed = self.make(self.epoch), self._resume_at is not None
            if resumed:
                self._stream.load_state_dict(self._resume_at["stream"])
                self._rng = np.random.default_rng()
                self._rng.bit_generator.state = self._resume_at["rng"]
                self._resume_at = None
            else:
                self._buffer, self._rng = [], np.random.default_rng([self.seed, self.epoch])
            if hasattr(self.collate, "set_epoch"):  # a collator that draws (MLM masks) does so per epoch
                self.collate.set_epoch(self.epoch)
            batches = 0
            for batch in self._batches():
                batches += 1
                yield batch
            if batches == 0 and not resumed:  # (a resumed epoch may have had nothing left)
                raise UserError(f"the training stream holds fewer than one batch ({self.batch_size} examples per "
                                "process); add data, lower train.batch_size (or data.block_size)")
            self.epoch += 1

    def _batches(self):
        pending = []
        for example in self._examples():
            pending.append(example)
            if len(pending) == self.batch_size:
                batch = self.collate([{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in e.items()}
                                      for e in pending])
                pending = []
                yield send_to_device(batch, self.device)

    def _examples(self):
        """The stream's examples in buffer-shuffled order; the buffer holds token ids as arrays (``_compact``)."""
        for example in _read(self._stream, "the training stream"):
            self._buffer.append({k: _compact(v) for k, v in example.items()})
            if len(self._buffer) >= self.buffer_size:
                yield self._draw()
        while self._buffer:
            yield self._draw()

    def _draw(self) -> dict:
        """Take a random example out of the buffer."""
        i = int(self._rng.integers(len(self._buffer)))
        self._buffer[i], self._buffer[-1] = self._buffer[-1], self._buffer[i]
        return self._buffer.pop()

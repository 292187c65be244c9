"""One way in for a run's data. ``from_recipe(cfg)`` checks the data files (cheap: before any slow work) and returns
the run's one data object; setup asks it, in order, for the raw rows the task loads its model by (``read``), the
rows prepared by the task (``prepare_rows``), the loaders (``build_loaders``), the loaders accelerate prepares
(``loaders``) and takes them back prepared (``use_prepared``); the loop asks it for each epoch's batches, and
checkpoints for the training loader's position. Two implementations: rows in memory, split and sampled
(:class:`MapData`, framework/data.py) and streams read as they train (:class:`StreamData`, framework/streaming.py).
The model and accelerate's ``prepare`` are framework/train.py's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import datasets
import torch
from torch.utils.data import DataLoader

from framework import backend, checkpoint, data, streaming
from framework.config import RunConfig
from framework.errors import UserError


def eval_rows(cfg: RunConfig, mesh: backend.Mesh) -> int:
    """Rows per eval batch; under SPMD one process feeds every device, so its batch holds all of theirs."""
    return (cfg.train.eval_batch_size or 2 * cfg.train.batch_size) * mesh.devices


def from_recipe(cfg: RunConfig) -> "RunData":
    """The run's data, its files checked."""
    data.check_files(cfg.data)
    return StreamData(cfg) if cfg.data.streaming else MapData(cfg)


class RunData:
    """The rows (or the stream), the eval set, the loaders and the training loader's position of one run."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.train_ds: Optional[datasets.Dataset] = None  # the training features; None for a stream
        self.eval_ds: Optional[datasets.Dataset] = None  # the eval features, at most ``eval.batches`` batches
        self.buckets: Optional[List[int]] = None  # the lengths batches are padded to; None: dynamic padding
        self.train_collate = self.train_dl = self.eval_dl = None
        self.steps_per_epoch: Optional[int] = None  # None for a stream

    def read(self, task) -> Tuple[Optional[datasets.Dataset], Optional[datasets.Dataset]]:
        """The raw (train, eval) rows, read, checked and split, that ``Task.load`` sizes the model by (the labels);
        (None, None) for a stream."""
        raise NotImplementedError

    def prepare_rows(self, task, tokenizer, model: torch.nn.Module, mesh: Optional[backend.Mesh] = None) -> None:
        """The rows as the task prepares them (tokenized, labelled, packed), for the model as loaded."""
        raise NotImplementedError

    def build_loaders(self, accelerator, task, tokenizer, model: torch.nn.Module, mesh: backend.Mesh,
                      replicas: int) -> None:
        """The collators and loaders, for the model as trained (adapters applied, not yet placed); ``replicas``:
        the model's copies that train on data of their own."""
        cfg = self.cfg
        self.eval_ds = data.longest_first(self.eval_ds)
        self._check_size(replicas)
        self.buckets = data.pad_lengths(cfg.data, backend.needs_static_shapes(accelerator),
                                        task.sequence_length(cfg, model))
        self.train_collate = task.collator(tokenizer, cfg, self.buckets)
        # Under SPMD one process feeds every device: its loader batch holds every device's examples.
        self.train_dl = self._train_loader(accelerator, task, tokenizer, model, cfg.train.batch_size * mesh.devices)
        # Evaluation pads to one shape (the longest bucket, full batches) when shapes must be static.
        rows = eval_rows(cfg, mesh)
        eval_collate = task.collator(tokenizer, cfg, self.buckets[-1:] if self.buckets else None,
                                     rows=rows if self.buckets else None)
        # Its own generator too: iterating a loader draws a seed, which would otherwise come from the global RNG
        # and shift dropout after every evaluation (evaluating more or less often must not change training).
        self.eval_dl = DataLoader(self.eval_ds, batch_size=rows, collate_fn=eval_collate,
                                  num_workers=cfg.data.num_workers, generator=torch.Generator().manual_seed(cfg.seed))

    def loaders(self) -> List[DataLoader]:
        """The loaders for accelerate's ``prepare`` (with the model and optimizer)."""
        raise NotImplementedError

    def use_prepared(self, loaders: List, mesh: backend.Mesh) -> None:
        """The loaders as ``prepare`` returned them, in ``loaders``' order."""
        raise NotImplementedError

    def epoch_batches(self, accelerator, mesh: backend.Mesh, epoch: int, epoch_step: int):
        """(batches, micro-batches of the epoch already trained on, micro-batches in an epoch) for the loop."""
        raise NotImplementedError

    def epoch(self, counted: int) -> int:
        """The epoch the loop is in, after a step; ``counted``: the loop's own count of whole epochs."""
        return counted

    def loader_state(self) -> Optional[Dict]:
        """This process's position in its training data, for a checkpoint (None where the step count holds it)."""
        return None

    def resume(self, accelerator, path: Path) -> None:
        """Back to the position a checkpoint saved."""

    def plan(self) -> Dict[str, object]:
        return {"train_examples": len(self.train_ds) if self.train_ds is not None else "a stream",
                "eval_examples": len(self.eval_ds),
                "padding": f"static, lengths {self.buckets}" if self.buckets else "dynamic"}

    def notes(self, task) -> List[str]:
        """Lines for the plan about the data."""
        return task.notes(self.cfg, self.train_ds, self.eval_ds)

    def _check_size(self, replicas: int) -> None:
        """Refuse training data smaller than one optimizer step (rows in memory; a stream's size is not known)."""

    def _train_loader(self, accelerator, task, tokenizer, model, batch_size: int):
        raise NotImplementedError


class MapData(RunData):
    """Rows in memory: read, checked and split once, prepared (and cached) by the task, sampled per epoch."""

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.splits: Optional[data.Splits] = None  # the raw rows, from read to prepare_rows

    def read(self, task):
        cfg = self.cfg
        self.splits = data.load_splits(cfg.data, cfg.seed, task.columns(cfg), task.keep_row(cfg),
                                       task.keeps_other_columns, list(task.optional_columns(cfg).values()))
        return self.splits.train, self.splits.eval

    def prepare_rows(self, task, tokenizer, model, mesh=None):
        cfg, splits = self.cfg, self.splits
        eval_ds = task.prepare(splits.eval, tokenizer, model, cfg)
        if cfg.eval.batches:
            rows = eval_rows(cfg, mesh or backend.Mesh())  # without SPMD one device
            eval_ds = eval_ds.select(range(min(len(eval_ds), cfg.eval.batches * rows)))
        self.train_ds, self.eval_ds = task.prepare(splits.train, tokenizer, model, cfg), eval_ds
        self.splits = None  # the raw rows are not needed any more

    def _check_size(self, replicas):
        t = self.cfg.train
        per_step = t.batch_size * t.gradient_accumulation_steps * replicas
        if len(self.train_ds) < per_step:
            raise UserError(f"the training data has {len(self.train_ds)} examples, fewer than one optimizer step "
                            f"takes ({t.batch_size} per device x {t.gradient_accumulation_steps} accumulation x "
                            f"{replicas} devices = {per_step}); lower train.batch_size")

    def _train_loader(self, accelerator, task, tokenizer, model, batch_size):
        # drop_last: every optimizer step sees the same number of examples, on every backend and process count.
        # Its own generator: starting an epoch (or a resumed one) never draws from the global RNG, whose
        # state a checkpoint restores for dropout.
        cfg = self.cfg
        sampler = data.train_sampler(self.train_ds, cfg.data, batch_size, cfg.seed)
        return DataLoader(self.train_ds, batch_size=batch_size, drop_last=True, collate_fn=self.train_collate,
                          sampler=sampler, shuffle=sampler is None, num_workers=cfg.data.num_workers,
                          generator=torch.Generator().manual_seed(cfg.seed))

    def loaders(self):
        return [self.train_dl, self.eval_dl]

    def use_prepared(self, loaders, mesh):
        train_dl, eval_dl = loaders
        self.steps_per_epoch = len(train_dl) // self.cfg.train.gradient_accumulation_steps
        self.train_dl, self.eval_dl = mesh.shard_loader(train_dl), mesh.shard_loader(eval_dl)

    def epoch_batches(self, accelerator, mesh, epoch, epoch_step):
        accum = self.cfg.train.gradient_accumulation_steps
        done = epoch_step * accum  # micro-batches of this epoch already trained on (after a resume)
        batches = mesh.shard_loader(accelerator.skip_first_batches(self.train_dl, done)) if done else self.train_dl
        # The data order depends only on (seed, epoch); set it on the loader actually iterated (a fresh
        # skipping loader would otherwise start from epoch 0, accelerate issues #2016/#3242).
        batches.set_epoch(epoch)
        if hasattr(self.train_collate, "set_epoch"):  # a collator that draws (MLM masks) does so per epoch too
            self.train_collate.set_epoch(epoch)
        return batches, done, self.steps_per_epoch * accum


class StreamData(RunData):
    """Streams: each process reads its own share, and its loader keeps its exact position (framework/streaming.py);
    the eval set is the first batches of the eval stream, in memory."""

    def read(self, task):
        streaming.check_sources(self.cfg, task.columns(self.cfg))
        return None, None

    def prepare_rows(self, task, tokenizer, model, mesh=None):
        self.eval_ds = streaming.eval_set(self.cfg, task, tokenizer, model, eval_rows(self.cfg, mesh or backend.Mesh()))

    def _train_loader(self, accelerator, task, tokenizer, model, batch_size):
        cfg = self.cfg
        stream = streaming.train_stream(cfg, task, tokenizer, model, *backend.data_parallel(accelerator))
        return streaming.StreamLoader(stream, self.train_collate, batch_size, cfg.data.shuffle_buffer, cfg.seed,
                                      accelerator.device)

    def loaders(self):
        return [self.eval_dl]  # the stream's loader reads its own share (framework/streaming.py), unprepared

    def use_prepared(self, loaders, mesh):
        (eval_dl,) = loaders
        self.train_dl, self.eval_dl = mesh.shard_loader(self.train_dl), mesh.shard_loader(eval_dl)

    def epoch_batches(self, accelerator, mesh, epoch, epoch_step):
        # Endless, keeping its own epochs and (resumed) position.
        return self.train_dl, 0, math.inf

    def epoch(self, counted):
        return self.train_dl.epoch

    def loader_state(self):
        return self.train_dl.state_dict()

    def resume(self, accelerator, path):
        self.train_dl.load_state_dict(checkpoint.loader_state(accelerator, path))

    def notes(self, task):
        return streaming.notes(self.cfg, len(self.eval_ds)) + super().notes(task)

"""Datasets from local files or the Hub, label ids, cached tokenization, and collators.

Everything here is plain ``datasets`` work: every step is fingerprinted, so a second run with the
same data, tokenizer and settings reads the tokenized Arrow files from the cache instead of
tokenizing again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import datasets
import torch
from torch.utils.data import Sampler
from transformers import DataCollatorWithPadding
from transformers.trainer_pt_utils import get_length_grouped_indices
from datasets.fingerprint import Hasher

from framework.config import DataConfig
from framework.errors import UserError
from framework.hub import require_hub

# File suffix -> (datasets builder, extra builder arguments). Compression suffixes are stripped first.
_FORMATS = {
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".parquet": ("parquet", {}),
    ".txt": ("text", {}),  # one document per line, per blank-line-separated paragraph, or the whole file
}
_COMPRESSION = {".gz", ".bz2", ".xz", ".zst", ".zip"}


@dataclass
class Splits:
    train: datasets.Dataset
    eval: datasets.Dataset


def check_files(cfg: DataConfig) -> None:
    """Fail fast, before any model or data loading, on data files that cannot be read."""
    for key in ("train_file", "eval_file"):
        path = getattr(cfg, key)
        if path is None:
            continue
        if not Path(path).is_file():
            raise UserError(f"data.{key}: file {path} does not exist (relative paths start at {Path.cwd()})")
        _format(path, key)


def _format(path: str, key: str) -> tuple:
    suffixes = [s.lower() for s in Path(path).suffixes]
    while suffixes and suffixes[-1] in _COMPRESSION:
        suffixes.pop()
    if not suffixes or suffixes[-1] not in _FORMATS:
        known = ", ".join(_FORMATS)
        raise UserError(f"data.{key}: cannot tell the format of {path}; use one of {known} (optionally .gz/.bz2/.xz/.zst/.zip)")
    return _FORMATS[suffixes[-1]]


def _read_file(path: str, key: str, cfg: DataConfig) -> datasets.Dataset:
    builder, kwargs = _format(path, key)
    if builder == "text":
        kwargs = {"sample_by": cfg.sample_by}
    try:
        return datasets.load_dataset(builder, data_files={"data": str(path)}, split="data", **kwargs)
    except Exception as e:  # a malformed file fails deep inside pyarrow/pandas with many error types
        raise UserError(f"data.{key}: cannot read {path} as {builder}: {_root_cause(e)}") from None


def _root_cause(error: BaseException) -> str:
    """The innermost error's first line: datasets wraps the reader's own message ("An error occurred while
    generating the dataset") around the one that says what is wrong."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return (str(error).splitlines() or [type(error).__name__])[0]


def _read_hub(cfg: DataConfig, split: str) -> datasets.Dataset:
    require_hub("data.dataset", cfg.dataset)
    try:
        return datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=split)
    except ValueError as e:  # unknown split or configuration
        raise UserError(f"data.dataset '{cfg.dataset}': {e}") from None
    except Exception as e:
        raise UserError(f"data.dataset: cannot load '{cfg.dataset}' from the Hub: {str(e).splitlines()[0]}") from None


def load_splits(cfg: DataConfig, seed: int, columns: Dict[str, str], keep_row: Optional[Callable]) -> Splits:
    """Read train and eval data, check the task's ``columns`` (recipe key -> column), drop the rows
    ``keep_row`` rejects, hold out ``eval_fraction`` when there is no eval set, and apply the sample caps."""
    if cfg.dataset:
        train, train_name = _read_hub(cfg, cfg.train_split), f"data.dataset '{cfg.dataset}'"
        evaluation = _read_hub(cfg, cfg.eval_split) if cfg.eval_split else None
    else:
        train, train_name = _read_file(cfg.train_file, "train_file", cfg), f"data.train_file {cfg.train_file}"
        evaluation = _read_file(cfg.eval_file, "eval_file", cfg) if cfg.eval_file else None
    eval_name = f"data.eval_file {cfg.eval_file}" if cfg.eval_file else f"split '{cfg.eval_split}'"

    train = _clean(train, columns, keep_row, train_name)
    if evaluation is None:
        if len(train) < 2:
            raise UserError(f"{train_name} has {len(train)} usable row(s); too few to hold out an eval set")
        parts = train.train_test_split(test_size=cfg.eval_fraction, seed=seed)
        train, evaluation = parts["train"], parts["test"]
    else:
        evaluation = _clean(evaluation, columns, keep_row, eval_name)
    if cfg.max_train_samples:
        train = train.select(range(min(cfg.max_train_samples, len(train))))
    if cfg.max_eval_samples:
        evaluation = evaluation.select(range(min(cfg.max_eval_samples, len(evaluation))))
    return Splits(train, evaluation)


def _clean(ds: datasets.Dataset, columns: Dict[str, str], keep_row: Optional[Callable], name: str) -> datasets.Dataset:
    """Check the columns, then drop the rows the task cannot use."""
    for key, column in columns.items():
        if column not in ds.column_names:
            raise UserError(f"{key}: column '{column}' is not in {name}; its columns are {', '.join(ds.column_names)}")
    if keep_row is None:
        return ds
    before = len(ds)
    ds = ds.filter(keep_row, desc="Dropping unusable rows")
    if len(ds) == 0:
        raise UserError(f"{name} has no usable rows (it has {before}): every row has an empty "
                        f"{' or '.join(columns.values())}, or is filtered out by the recipe")
    return ds


def check_length(key: str, length: int, tokenizer, model) -> None:
    """A sequence length (``data.max_length``, ``data.block_size``) must fit the model: longer inputs fail deep
    inside its forward (position ids beyond the embedding table). The limit is the smaller of the model's
    positions and the tokenizer's ``model_max_length`` (RoBERTa: 514 positions, 512 usable); either may be unset."""
    limits = {"max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
              "model_max_length": tokenizer.model_max_length}
    limits = {name: n for name, n in limits.items() if isinstance(n, int) and 0 < n < 10**9}
    if limits and length > min(limits.values()):
        name, limit = min(limits.items(), key=lambda item: item[1])
        raise UserError(f"{key}={length} is longer than the model takes ({name} {limit}); set {key}={limit} or less")


def tokenizer_identity(tokenizer) -> str:
    """The tokenizer's definition, without the truncation/padding state that calling it changes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return Hasher.hash(tokenizer)
    definition = json.loads(backend.to_str())
    definition.pop("truncation", None)
    definition.pop("padding", None)
    return json.dumps(definition, sort_keys=True)


def pad_lengths(cfg: DataConfig, static_shapes: bool, longest: int) -> Optional[List[int]]:
    """The sequence lengths batches are padded to, or None for dynamic padding. ``longest``: the task's
    longest sequence (``data.max_length``, or ``data.block_size`` for language models)."""
    padding = cfg.padding if cfg.padding != "auto" else ("buckets" if static_shapes else "dynamic")
    if padding == "dynamic":
        return None
    if padding == "max_length":
        return [longest]
    buckets = cfg.pad_buckets or [max(8, longest // 4), max(8, longest // 2), longest]
    return sorted(set(buckets) | {longest})


class StaticCollator:
    """Pads each batch to the smallest bucket length that fits, so only a few shapes ever exist.

    With ``rows`` set (evaluation), a short last batch is filled up to ``rows`` with copies of its first
    example, and a ``valid`` column marks the real ones so the metrics can drop the filler.
    """

    def __init__(self, tokenizer, buckets: List[int], rows: Optional[int] = None):
        self.tokenizer, self.buckets, self.rows = tokenizer, buckets, rows

    def __call__(self, features: List[Dict]) -> Dict[str, torch.Tensor]:
        real = len(features)
        if self.rows is not None:
            features = features + [features[0]] * (self.rows - real)
        longest = max(len(f["input_ids"]) for f in features)
        length = next(b for b in self.buckets if b >= longest)
        batch = self.tokenizer.pad(features, padding="max_length", max_length=length, return_tensors="pt")
        if self.rows is not None:
            batch["valid"] = torch.arange(self.rows) < real
        return batch


def collator(tokenizer, buckets: Optional[List[int]], rows: Optional[int] = None):
    """Dynamic padding (each batch to its own longest sequence) without buckets, else static shapes."""
    if buckets is None:
        return DataCollatorWithPadding(tokenizer)
    return StaticCollator(tokenizer, buckets, rows)


class LengthGroupedSampler(Sampler):
    """Random order, but each run of ``batch_size`` indices holds examples of similar length.

    The order depends only on (seed, epoch), so it is the same on every process (accelerate then gives
    each process its own batches) and the same again on resume.
    """

    def __init__(self, lengths: List[int], batch_size: int, seed: int):
        self.lengths, self.batch_size, self.seed, self.epoch = lengths, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))


def longest_first(ds: datasets.Dataset) -> datasets.Dataset:
    """The evaluation order: longest examples first. Each eval batch then pads little (the metrics do not
    depend on the order), and the largest batch comes first, so one that does not fit fails at once."""
    lengths = [len(ids) for ids in ds["input_ids"]]
    return ds.select(sorted(range(len(lengths)), key=lambda i: -lengths[i]))


def train_sampler(ds: datasets.Dataset, cfg: DataConfig, batch_size: int, seed: int) -> Optional[Sampler]:
    """The training sampler, or None for a plain shuffle."""
    if not cfg.group_by_length:
        return None
    return LengthGroupedSampler([len(ids) for ids in ds["input_ids"]], batch_size, seed)

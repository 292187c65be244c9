"""Datasets from local files or the Hub, label ids, cached tokenization, and collators.

Everything here is plain ``datasets`` work: every step is fingerprinted, so a second run with the
same data, tokenizer and settings reads the tokenized Arrow files from the cache instead of
tokenizing again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

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
}
_COMPRESSION = {".gz", ".bz2", ".xz", ".zst", ".zip"}
LABELS = "labels"  # the column transformers models read the targets from


@dataclass
class Splits:
    train: datasets.Dataset
    eval: datasets.Dataset
    label_names: List[str]  # label id -> name


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


def _read_file(path: str, key: str) -> datasets.Dataset:
    builder, kwargs = _format(path, key)
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


def load_splits(cfg: DataConfig, seed: int) -> Splits:
    """Read train and eval data, drop unusable rows, map labels to ids, and apply the sample caps."""
    if cfg.dataset:
        train, train_name = _read_hub(cfg, cfg.train_split), f"data.dataset '{cfg.dataset}'"
        evaluation = _read_hub(cfg, cfg.eval_split) if cfg.eval_split else None
    else:
        train, train_name = _read_file(cfg.train_file, "train_file"), f"data.train_file {cfg.train_file}"
        evaluation = _read_file(cfg.eval_file, "eval_file") if cfg.eval_file else None
    eval_name = f"data.eval_file {cfg.eval_file}" if cfg.eval_file else f"split '{cfg.eval_split}'"

    train = _clean(train, cfg, train_name)
    if evaluation is None:
        if len(train) < 2:
            raise UserError(f"{train_name} has {len(train)} usable row(s); too few to hold out an eval set")
        parts = train.train_test_split(test_size=cfg.eval_fraction, seed=seed)
        train, evaluation = parts["train"], parts["test"]
    else:
        evaluation = _clean(evaluation, cfg, eval_name)

    label_names = _label_names(train, evaluation, cfg, train_name)
    if cfg.max_train_samples:
        train = train.select(range(min(cfg.max_train_samples, len(train))))
    if cfg.max_eval_samples:
        evaluation = evaluation.select(range(min(cfg.max_eval_samples, len(evaluation))))
    to_id = {name: i for i, name in enumerate(label_names)}
    encode = lambda batch: {LABELS: [to_id[str(v)] for v in batch[cfg.label_column]]}  # noqa: E731
    train = train.map(encode, batched=True, desc="Label ids")
    evaluation = evaluation.map(encode, batched=True, desc="Label ids")
    return Splits(train, evaluation, label_names)


def _clean(ds: datasets.Dataset, cfg: DataConfig, name: str) -> datasets.Dataset:
    """Check the columns, then drop rows with an empty text or label and rows outside ``data.labels``."""
    wanted = {"data.text_column": cfg.text_column, "data.label_column": cfg.label_column}
    if cfg.text_pair_column:
        wanted["data.text_pair_column"] = cfg.text_pair_column
    for key, column in wanted.items():
        if column not in ds.column_names:
            raise UserError(f"{key}: column '{column}' is not in {name}; its columns are {', '.join(ds.column_names)}")
    texts = [c for c in (cfg.text_column, cfg.text_pair_column) if c]
    keep = set(cfg.labels) if cfg.labels else None
    label = cfg.label_column

    def usable(row: Dict) -> bool:
        if row[label] is None or any(row[c] is None or not str(row[c]).strip() for c in texts):
            return False
        return keep is None or str(row[label]) in keep

    before = len(ds)
    ds = ds.filter(usable, desc="Dropping empty rows")
    if len(ds) == 0:
        why = f" with a label in data.labels {cfg.labels}" if keep else ""
        raise UserError(f"{name} has no rows with non-empty text and label{why} (it has {before} rows)")
    return ds


def _label_names(train: datasets.Dataset, evaluation: datasets.Dataset, cfg: DataConfig, name: str) -> List[str]:
    if cfg.labels:
        return list(cfg.labels)
    values = set(train.unique(cfg.label_column))
    if len(values) < 2:
        raise UserError(f"data.label_column '{cfg.label_column}' in {name} has a single class {values}; "
                        "classification needs at least two")
    unseen = set(evaluation.unique(cfg.label_column)) - values
    if unseen:
        raise UserError(f"the eval data has labels {sorted(map(str, unseen))} that the training data lacks")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise UserError(f"data.label_column '{cfg.label_column}': integer labels must be >= 0, found {min(values)}")
        return [str(i) for i in range(max(values) + 1)]
    return sorted(str(v) for v in values)


def check_max_length(cfg: DataConfig, tokenizer, model) -> None:
    """``data.max_length`` must fit the model: longer inputs fail deep inside its forward (position ids
    beyond the embedding table). The limit is the smaller of the model's position embeddings and the
    tokenizer's ``model_max_length`` (RoBERTa: 514 positions, 512 usable); either may be unset."""
    limits = {"max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
              "model_max_length": tokenizer.model_max_length}
    limits = {name: n for name, n in limits.items() if isinstance(n, int) and 0 < n < 10**9}
    if limits and cfg.max_length > min(limits.values()):
        name, limit = min(limits.items(), key=lambda item: item[1])
        raise UserError(f"data.max_length={cfg.max_length} is longer than the model takes ({name} {limit}); "
                        f"set data.max_length={limit} or less")


def tokenize(ds: datasets.Dataset, tokenizer, cfg: DataConfig) -> datasets.Dataset:
    """Tokenize with truncation and no padding (the collator pads). Cached by an explicit fingerprint."""
    columns = [cfg.text_column] + ([cfg.text_pair_column] if cfg.text_pair_column else [])

    def encode(batch):
        return tokenizer(*[[str(t) for t in batch[c]] for c in columns], truncation=True, max_length=cfg.max_length)

    fingerprint = Hasher.hash((ds._fingerprint, _tokenizer_identity(tokenizer), cfg.max_length, columns))
    keep = {LABELS}
    return ds.map(encode, batched=True, remove_columns=[c for c in ds.column_names if c not in keep],
                  new_fingerprint=fingerprint, desc="Tokenizing")


def _tokenizer_identity(tokenizer) -> str:
    """The tokenizer's definition, without the truncation/padding state that calling it changes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return Hasher.hash(tokenizer)
    definition = json.loads(backend.to_str())
    definition.pop("truncation", None)
    definition.pop("padding", None)
    return json.dumps(definition, sort_keys=True)


def pad_lengths(cfg: DataConfig, static_shapes: bool) -> Optional[List[int]]:
    """The sequence lengths batches are padded to, or None for dynamic padding."""
    padding = cfg.padding if cfg.padding != "auto" else ("buckets" if static_shapes else "dynamic")
    if padding == "dynamic":
        return None
    if padding == "max_length":
        return [cfg.max_length]
    buckets = cfg.pad_buckets or [max(8, cfg.max_length // 4), max(8, cfg.max_length // 2), cfg.max_length]
    return sorted(set(buckets) | {cfg.max_length})


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


def train_sampler(ds: datasets.Dataset, cfg: DataConfig, batch_size: int, seed: int) -> Optional[Sampler]:
    """The training sampler, or None for a plain shuffle."""
    if not cfg.group_by_length:
        return None
    return LengthGroupedSampler([len(ids) for ids in ds["input_ids"]], batch_size, seed)

"""Datasets from local files or the Hub, label ids, cached tokenization, and collators.

Everything here is plain ``datasets`` work: every step is fingerprinted, so a second run with the
same data, tokenizer and settings reads the tokenized Arrow files from the cache instead of
tokenizing again.
"""

from __future__ import annotations

import csv
import glob
import itertools
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import datasets
import fsspec
import pyarrow.compute
import torch
from torch.utils.data import Sampler
from transformers import DataCollatorWithPadding
from datasets.fingerprint import Hasher

from framework.config import DataConfig, SourceConfig
from framework.errors import UserError
from framework.hub import require_hub

# File suffix -> (datasets builder, extra builder arguments). Compression suffixes are stripped first.
# Tables: only an empty field is a null (pandas would also read NA, null, None, nan, n/a, ... as one, dropping a
# review whose text is "None" or turning a label "NA" into a missing one).
_TABLE = {"keep_default_na": False, "na_values": ""}
_FORMATS = {
    ".csv": ("csv", _TABLE),
    ".tsv": ("csv", {**_TABLE, "delimiter": "\t"}),
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


def train_sources(cfg: DataConfig) -> List[Tuple[str, SourceConfig]]:
    """(recipe key, source) for every training corpus: ``data.sources``, or the one of ``data.train_file`` /
    ``data.dataset``."""
    if cfg.sources:
        return [(f"data.sources[{i}]", s) for i, s in enumerate(cfg.sources)]
    return [("data", SourceConfig(train_file=cfg.train_file, dataset=cfg.dataset, dataset_config=cfg.dataset_config,
                                  split=cfg.train_split))]


def check_files(cfg: DataConfig) -> None:
    """Fail fast, before any model or data loading, on data files that cannot be read."""
    for prefix, source in train_sources(cfg):
        if source.train_file:
            files(source.train_file, f"{prefix}.train_file")
    if cfg.eval_file:
        files(cfg.eval_file, "data.eval_file")


def files(value, key: str) -> List[str]:
    """The files of a ``train_file``/``eval_file`` value (a path, a glob or a list of them), checked: each
    exists, and all share one format."""
    found = []
    for pattern in [value] if isinstance(value, str) else value:
        pattern = str(pattern)
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
            if not matches:
                raise UserError(f"{key}: no file matches {pattern} (relative paths start at {Path.cwd()})")
            found += matches
        elif Path(pattern).is_dir():
            raise UserError(f"{key}: {pattern} is a folder, not a file; name its files (a glob such as "
                            f"{Path(pattern) / '*.jsonl'} takes them all)")
        elif not Path(pattern).is_file():
            raise UserError(f"{key}: file {pattern} does not exist (relative paths start at {Path.cwd()})")
        else:
            found.append(pattern)
    if not found:
        raise UserError(f"{key}: the list of files is empty")
    kinds = {_format(path, key) for path in found}
    if len(kinds) > 1:
        raise UserError(f"{key}: the files are in several formats ({', '.join(sorted(k[0] for k in kinds))}); "
                        "one source reads one format: make several data.sources")
    return found


def _format(path: str, key: str) -> tuple:
    suffixes = [s.lower() for s in Path(path).suffixes]
    while suffixes and suffixes[-1] in _COMPRESSION:
        suffixes.pop()
    if not suffixes or suffixes[-1] not in _FORMATS:
        known = ", ".join(_FORMATS)
        raise UserError(f"{key}: cannot tell the format of {path}; use one of {known} (optionally .gz/.bz2/.xz/.zst/.zip)")
    builder, kwargs = _FORMATS[suffixes[-1]]
    return builder, tuple(sorted(kwargs.items()))


def read_files(paths: List[str], key: str, cfg: DataConfig, streaming: bool = False):
    """Rows of local files: a Dataset, or an IterableDataset (one shard per file) when ``streaming``. Tables
    (csv, tsv) are checked first, whole (see ``check_table``)."""
    builder, kwargs = _format(paths[0], key)
    kwargs = {"sample_by": cfg.sample_by} if builder == "text" else dict(kwargs)
    for path in paths:
        if builder == "csv":
            check_table(path, kwargs.get("delimiter", ","), key)
        elif builder == "json":
            check_json(path, key)
    try:
        return datasets.load_dataset(builder, data_files={"data": paths}, split="data", streaming=streaming, **kwargs)
    except Exception as e:  # a malformed file fails deep inside pyarrow/pandas with many error types
        if all(_holds_no_rows(path, builder, key) for path in paths):
            raise UserError(f"{key}: {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''} holds no rows (an "
                            "empty file, a header alone or an empty JSON list); give at least one example") from None
        raise UserError(f"{key}: cannot read {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''} as "
                        f"{builder}: {root_cause(e)}") from None


def _holds_no_rows(path: str, builder: str, key: str) -> bool:
    """Whether a file the datasets builder could not read is empty of examples: nothing but blank lines, a table's
    header alone, or an empty JSON list. Reads up to its first two non-blank lines (a large malformed file is not
    read whole)."""
    with _text_file(path, key) as f:
        lines = list(itertools.islice((line for line in f if line.strip()), 2))
    if builder == "csv":
        return len(lines) <= 1
    if builder == "json":
        return "".join(line.strip() for line in lines).replace(" ", "") in ("", "[]")
    return not lines


@contextmanager
def _text_file(path: str, key: str, **options):
    """A local data file opened as UTF-8 text (decompressed by its suffix); a file that is not UTF-8, or a damaged
    or unreadable one, is refused naming ``key`` and the file, while it is read too."""
    try:
        with fsspec.open(path, "rt", compression="infer", encoding="utf-8", **options) as f:
            yield f
    except UserError:
        raise
    except UnicodeDecodeError as e:
        raise UserError(f"{key}: {path} is not UTF-8 text ({e.reason} at byte {e.start} of the text); save it "
                        "as UTF-8") from None
    except Exception as e:  # a damaged or truncated compressed file, an unreadable one
        raise UserError(f"{key}: cannot read {path}: {root_cause(e)}") from None


def check_table(path: str, delimiter: str, key: str) -> None:
    """Refuse a csv/tsv file that pandas (the reader ``datasets`` uses) would misread rather than reject: a row
    with more or fewer fields than the header (pandas takes surplus leading fields as an index, or pads with
    nulls, shifting or dropping values), a header naming a column twice (pandas renames the second), text that
    is not UTF-8. Blank lines are skipped, as pandas does; quoted fields may hold delimiters and newlines."""
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # a field may be a whole document; the csv module's default stops at 128 KiB
    try:
        with _text_file(path, key, newline="") as f:
            reader = csv.reader(f, delimiter=delimiter)
            header = next(reader, None)
            if not header:
                raise UserError(f"{key}: {path} has no header line (the first line names the columns)")
            repeated = sorted({name for name in header if header.count(name) > 1})
            if repeated:
                raise UserError(f"{key}: {path}: its header names column {', '.join(map(repr, repeated))} more "
                                "than once; give every column its own name")
            for row in reader:
                if row and len(row) != len(header):
                    raise UserError(f"{key}: {path} line {reader.line_num} has {len(row)} fields, but its header has "
                                    f"{len(header)} ({', '.join(header)}); quote fields that hold "
                                    f"{'a tab' if delimiter == chr(9) else 'a comma'} (\"...\") and give every row "
                                    "one value per column")
    finally:
        csv.field_size_limit(limit)


def check_json(path: str, key: str) -> None:
    """A json/jsonl file must be one JSON document, or JSON lines each holding an object (blank lines aside):
    checked here because pyarrow's reader, which ``datasets`` uses, crashes the process (a segmentation
    fault, seen with pyarrow 23) on some malformed lines instead of raising."""
    with _text_file(path, key) as f:
        rows = 0
        for number, line in enumerate(f, 1):  # line by line: a stream's file may be large
            if not line.strip():
                continue
            rows += 1
            if rows == 1 and line.lstrip().startswith("["):  # the file is one JSON array of rows
                return _check_array(path, key)
            try:
                row = json.loads(line)
            except ValueError as e:
                if rows == 1 and line.lstrip().startswith("{") and _one_document(path):
                    return  # one JSON object over several lines (columns of values): datasets reads it
                raise UserError(f"{key}: {path} line {number} is not valid JSON ({e}); write one JSON object "
                                "per line, or one array of objects") from None
            if not isinstance(row, dict):
                raise UserError(f"{key}: {path} line {number} holds a {type(row).__name__}, not an object; "
                                'write one JSON object per line, e.g. {"text": "..."}')


def _one_document(path: str) -> bool:
    with fsspec.open(path, "rt", compression="infer", encoding="utf-8") as f:
        try:
            json.load(f)
            return True
        except ValueError:
            return False


def _check_array(path: str, key: str) -> None:
    """A json file holding one array (on one line or several): each of its items must be an object (a row)."""
    with _text_file(path, key) as f:
        try:
            rows = json.load(f)
        except ValueError as e:
            raise UserError(f"{key}: {path} is not valid JSON ({e}); write one array of objects, or one JSON "
                            "object per line") from None
    if not isinstance(rows, list):  # text after the array's end, or something else
        raise UserError(f"{key}: {path} is not one JSON array of objects")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UserError(f"{key}: {path}: item {i} of its array is a {type(row).__name__}, not an object; "
                            'write the rows as objects, e.g. [{"text": "..."}]')


def root_cause(error: BaseException) -> str:
    """The innermost error's first line: datasets wraps the reader's own message ("An error occurred while
    generating the dataset") around the one that says what is wrong."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return (str(error).splitlines() or [type(error).__name__])[0]


def read_hub(key: str, name: str, config: Optional[str], split: str, streaming: bool = False):
    require_hub(key, name)
    try:
        return datasets.load_dataset(name, config, split=split, streaming=streaming)
    except ValueError as e:  # unknown split or configuration
        raise UserError(f"{key} '{name}': {e}") from None
    except Exception as e:
        raise UserError(f"{key}: cannot load '{name}' from the Hub: {str(e).splitlines()[0]}") from None


def read_source(prefix: str, source: SourceConfig, cfg: DataConfig, streaming: bool = False,
                order: Optional[Callable[[List[str]], List[str]]] = None):
    """One source's rows, with its name for messages. ``order`` reorders its files (a stream's epoch)."""
    if source.dataset:
        return (read_hub(f"{prefix}.dataset", source.dataset, source.dataset_config, source.split, streaming),
                f"{prefix}.dataset '{source.dataset}'")
    paths = files(source.train_file, f"{prefix}.train_file")
    return (read_files(order(paths) if order else paths, f"{prefix}.train_file", cfg, streaming),
            f"{prefix}.train_file {source.train_file}")


def read_eval(cfg: DataConfig, streaming: bool = False):
    """The eval set's rows and name, or (None, None) when it is held out of the training rows."""
    if cfg.eval_file:
        return (read_files(files(cfg.eval_file, "data.eval_file"), "data.eval_file", cfg, streaming),
                f"data.eval_file {cfg.eval_file}")
    if cfg.dataset and cfg.eval_split:
        return (read_hub("data.dataset", cfg.dataset, cfg.dataset_config, cfg.eval_split, streaming),
                f"split '{cfg.eval_split}'")
    return None, None


def mix(parts: list, weights: List[float], seed: int):
    """Rows drawn from ``parts`` with probabilities proportional to ``weights`` (seeded), until every part has
    been read once (the smaller ones start over meanwhile); one part is itself."""
    if len(parts) == 1:
        return parts[0]
    total = sum(weights)
    try:
        # One column type for all (a text file's large_string and a csv's string are both text).
        first = next((p.features for p in parts if p.features is not None), None)
        parts = [p.cast(first) if first is not None and p.features not in (None, first) else p for p in parts]
        return datasets.interleave_datasets(parts, probabilities=[w / total for w in weights], seed=seed,
                                            stopping_strategy="all_exhausted")
    except (ValueError, TypeError) as e:
        raise UserError(f"data.sources: cannot mix the sources (their columns must have the same types): "
                        f"{str(e).splitlines()[0]}") from None


def load_splits(cfg: DataConfig, seed: int, columns: Dict[str, str], keep_row: Optional[Callable],
                keep_other_columns: bool = False, optional: Sequence[str] = ()) -> Splits:
    """Read train and eval data, check the task's ``columns`` (recipe key -> column), drop the rows
    ``keep_row`` rejects, hold out ``eval_fraction`` of each source when there is no eval set (before mixing,
    so that a row a mix repeats is never both trained and evaluated on), mix the sources, and apply the
    sample caps. The rows keep only the task's columns, and those of ``optional`` a source has
    (``Task.optional_columns``), unless ``keep_other_columns`` (``Task.keeps_other_columns``)."""
    evaluation, eval_name = read_eval(cfg)
    parts, held, weights = [], [], []
    for prefix, source in train_sources(cfg):
        rows, name = read_source(prefix, source, cfg)
        rows = _clean(rows, columns, keep_row, name, cfg)
        if not keep_other_columns:
            rows = rows.select_columns(kept_columns(rows.column_names, columns, optional))
        if evaluation is None:
            if len(rows) < 2:
                raise UserError(f"{name} has {len(rows)} usable row(s); too few to hold out an eval set")
            split = rows.train_test_split(test_size=cfg.eval_fraction, seed=seed)
            rows = split["train"]
            held.append(split["test"])
        parts.append(rows)
        weights.append(source.weight)
    train = mix(parts, weights, seed)
    evaluation = mix(held, weights, seed) if held else _clean(evaluation, columns, keep_row, eval_name, cfg)
    if cfg.max_train_samples:
        train = train.select(range(min(cfg.max_train_samples, len(train))))
    if cfg.max_eval_samples:
        evaluation = evaluation.select(range(min(cfg.max_eval_samples, len(evaluation))))
    return Splits(train, evaluation)


def kept_columns(present: Sequence[str], columns: Dict[str, str], optional: Sequence[str]) -> List[str]:
    """The task's columns, then those of ``optional`` that are ``present``."""
    names = list(columns.values())
    return names + [c for c in dict.fromkeys(optional) if c in present and c not in names]


def _clean(ds: datasets.Dataset, columns: Dict[str, str], keep_row: Optional[Callable], name: str,
           cfg: DataConfig) -> datasets.Dataset:
    """Check the columns, then drop the rows the task cannot use."""
    check_columns(ds.column_names, columns, name, {c: _kind(ds.features[c]) for c in ds.column_names})
    label = columns.get("data.label_column")
    if cfg.labels and label is not None:
        found = sorted({str(v) for v in ds[label] if v is not None})
        if not set(cfg.labels) & set(found):
            shown = ", ".join(found[:20]) + (f" ... ({len(found)} in all)" if len(found) > 20 else "")
            raise UserError(f"data.labels: none of {cfg.labels} is a label of {name}, so every row is filtered out; "
                            f"its column '{label}' holds {shown or 'no labels'}: list those you want, or remove "
                            "data.labels")
    if keep_row is None:
        return ds
    before = len(ds)
    ds = ds.filter(keep_row, desc="Dropping unusable rows")
    if len(ds) == 0:
        raise UserError(f"{name} has no usable rows (it has {before}): every row has an empty "
                        f"{' or '.join(columns.values())}")
    return ds


# The keys whose columns must hold text (strings; a null is a row dropped as empty), and those that hold one
# value per row (strings or numbers: labels).
TEXT_KEYS = ("data.text_column", "data.text_pair_column")
SCALAR_KEYS = ("data.label_column",)
NOT_SCALAR = ("lists", "mappings", "values of several JSON types")


def check_columns(present: List[str], columns: Dict[str, str], name: str, kinds: Dict[str, str]) -> None:
    """Every column the task needs is there, those of ``TEXT_KEYS`` hold text and those of ``SCALAR_KEYS``
    single values. ``kinds``: column -> what it holds ("text", or e.g. "int64 values" or "lists"; None where
    unknown)."""
    for key, column in columns.items():
        if column not in present:
            raise UserError(f"{key}: column '{column}' is not in {name}; its columns are {', '.join(present)}")
        kind = kinds.get(column)
        if key in TEXT_KEYS and kind not in ("text", None):
            raise UserError(f"{key}: column '{column}' of {name} holds {kind}, not text; point {key} at a "
                            f"column of strings (its columns are {', '.join(present)})")
        if key in SCALAR_KEYS and kind in NOT_SCALAR:
            raise UserError(f"{key}: column '{column}' of {name} holds {kind}; a label is one string or integer "
                            f"per row: point {key} at such a column (its columns are {', '.join(present)})")


def _kind(feature) -> str:
    """What a datasets feature holds, in words."""
    if isinstance(feature, datasets.Value):
        return "text" if feature.dtype in ("string", "large_string") else f"{feature.dtype} values"
    if isinstance(feature, (datasets.Sequence, datasets.List, list)) or type(feature).__name__ == "LargeList":
        return "lists"
    if isinstance(feature, dict):
        return "mappings"
    if isinstance(feature, datasets.Json):  # json rows whose values differ in type from row to row
        return "values of several JSON types"
    return type(feature).__name__


def value_kind(value) -> Optional[str]:
    """``_kind`` for one value of a stream's row (None: a null, which says nothing)."""
    if value is None or isinstance(value, str):
        return None if value is None else "text"
    return {list: "lists", dict: "mappings"}.get(type(value), f"{type(value).__name__} values")


def map_rows(ds, function: Callable, identity: tuple, desc: str, with_indices: bool = False):
    """``ds.map(function, batched=True)`` replacing its columns, for a Dataset (cached under a fingerprint of
    ``identity`` and the rows) or an IterableDataset (applied on the fly)."""
    if isinstance(ds, datasets.IterableDataset):
        columns = ds.column_names or list(next(iter(ds.take(1)), {}))  # csv and json name theirs only once read
        return ds.map(function, batched=True, with_indices=with_indices, remove_columns=columns)
    return ds.map(function, batched=True, with_indices=with_indices, remove_columns=ds.column_names,
                  new_fingerprint=Hasher.hash((ds._fingerprint, *identity)), desc=desc)


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


def fill_rows(features: List[Dict], rows: Optional[int]) -> Tuple[List[Dict], int]:
    """Evaluation on static shapes (``rows`` set): a short last batch filled up to ``rows`` with copies of its first
    example. Returns the features and how many are real (the collator marks them in a ``valid`` column)."""
    real = len(features)
    return (features + [features[0]] * (rows - real) if rows is not None else features), real


def padded_length(longest: int, buckets: Optional[List[int]]) -> int:
    """The length a batch is padded to: its longest sequence, or the smallest bucket that holds it."""
    return longest if buckets is None else next(b for b in buckets if b >= longest)


class StaticCollator:
    """Pads each batch to the smallest bucket length that fits, so only a few shapes ever exist.

    With ``rows`` set (evaluation), a short last batch is filled up to ``rows`` with copies of its first
    example, and a ``valid`` column marks the real ones so the metrics can drop the filler.
    """

    def __init__(self, tokenizer, buckets: List[int], rows: Optional[int] = None):
        self.tokenizer, self.buckets, self.rows = tokenizer, buckets, rows

    def __call__(self, features: List[Dict]) -> Dict[str, torch.Tensor]:
        features, real = fill_rows(features, self.rows)
        length = padded_length(max(len(f["input_ids"]) for f in features), self.buckets)
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
        # Imported here: transformers.trainer_pt_utils imports accelerate when deepspeed is installed, and reading a
        # recipe (which imports this module) must not, before the backend is chosen (tests/test_imports.py).
        from transformers.trainer_pt_utils import get_length_grouped_indices

        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))


def example_lengths(ds: datasets.Dataset) -> List[int]:
    """Each example's length in tokens: its ``length`` column where the task gives one (a preference pair: its
    longer sequence), else the length of its ``input_ids``."""
    if "length" in ds.column_names:
        return list(ds["length"])
    # Counted by Arrow, without turning every row's ids into a Python list (0.5 s for the default recipe's rows).
    return pyarrow.compute.list_value_length(ds.with_format("arrow")["input_ids"]).to_pylist()


def longest_first(ds: datasets.Dataset) -> datasets.Dataset:
    """The evaluation order: longest examples first. Each eval batch then pads little (the metrics do not
    depend on the order), and the largest batch comes first, so one that does not fit fails at once."""
    lengths = example_lengths(ds)
    return ds.select(sorted(range(len(lengths)), key=lambda i: -lengths[i]))


def train_sampler(ds: datasets.Dataset, cfg: DataConfig, batch_size: int, seed: int) -> Optional[Sampler]:
    """The training sampler, or None for a plain shuffle."""
    if not cfg.group_by_length:
        return None
    return LengthGroupedSampler(example_lengths(ds), batch_size, seed)

"""Every data format the README lists trains end to end: csv, tsv, json, jsonl, parquet, compressed
(.gz, .bz2, .xz, .zst, .zip), and sentence pairs (data.text_pair_column). Each run trains one epoch over
every row of the train file and evaluates every row of the eval file: the counts in the plan and the summary,
and the number of tokens trained on (exact, from the epoch-end checkpoint), show that no row was lost, added
or misread."""

import bz2
import csv
import gzip
import io
import json
import lzma
import math
import zipfile
from pathlib import Path
from typing import List

import pytest

from helpers import NEUTRAL, synthetic_rows, tiny_args, train_losses
from in_process import fresh_process, run_main

TRAIN_ROWS, EVAL_ROWS, BATCH = 72, 16, 8  # tests/tiny.yaml's batch: 9 steps per epoch, no row dropped


def zstd_frame(data: bytes) -> bytes:
    """A Zstandard frame (RFC 8878) of raw blocks: a valid .zst file, written without the zstandard package."""
    frame = bytearray(b"\x28\xb5\x2f\xfd")  # magic number
    frame.append(0xE0)  # frame header: single segment, 8-byte content size, no checksum, no dictionary
    frame += len(data).to_bytes(8, "little")
    size = 128 * 1024  # the largest block
    blocks = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
    for i, block in enumerate(blocks):
        last = int(i == len(blocks) - 1)
        frame += (len(block) << 3 | 0 << 1 | last).to_bytes(3, "little")  # block type 0: raw
        frame += block
    return bytes(frame)


def encode(rows: List[dict], form: str) -> bytes:
    if form in (".csv", ".tsv"):
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(rows[0]), delimiter="\t" if form == ".tsv" else ",")
        writer.writeheader()
        writer.writerows(rows)
        return text.getvalue().encode()
    if form == ".json":
        return json.dumps(rows).encode()  # one array of records
    if form == ".jsonl":
        return "".join(json.dumps(row) + "\n" for row in rows).encode()
    if form == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buffer)
        return buffer.getvalue()
    raise ValueError(form)


COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress, ".zst": zstd_frame}


def write_rows(path: Path, rows: List[dict]) -> Path:
    """``rows`` in the format its name says, e.g. train.csv, train.jsonl.bz2, train.csv.zip."""
    last = path.suffixes[-1]
    if last in COMPRESS:
        path.write_bytes(COMPRESS[last](encode(rows, path.suffixes[-2])))
    elif last == ".zip":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(path.stem, encode(rows, path.suffixes[-2]))  # train.csv inside train.csv.zip
    else:
        path.write_bytes(encode(rows, last))
    return path


def tokens_in(tiny_model: Path, rows: List[dict], columns: List[str]) -> int:
    """Tokens of every row as the run encodes them (truncated to tests/tiny.yaml's max_length 32)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    encoded = tokenizer(*[[row[c] for row in rows] for c in columns], truncation=True, max_length=32)
    return sum(len(ids) for ids in encoded["input_ids"])


def train_one_epoch(capsys, tiny_model, hf_home, out, train, evaluation, *extra) -> dict:
    """One epoch with a checkpoint at its end; checks the counts and the losses, returns the checkpoint state."""
    status = run_main(tiny_args(tiny_model, train, out, f"data.eval_file={evaluation}", "train.epochs=1",
                                "checkpoint.every_epoch=true", *extra), hf_home)
    printed = capsys.readouterr()
    assert status == 0, printed.err[-3000:]
    assert f"train_examples: {TRAIN_ROWS}" in printed.out and f"eval_examples: {EVAL_ROWS}" in printed.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train"]["steps"] == TRAIN_ROWS // BATCH and summary["train"]["samples"] == TRAIN_ROWS
    assert summary["eval"]["examples"] == EVAL_ROWS and math.isfinite(summary["eval"]["loss"])
    losses = train_losses(out)
    assert len(losses) == TRAIN_ROWS // BATCH and all(math.isfinite(x) for x in losses), losses
    return json.loads((out / "checkpoints" / f"step_{TRAIN_ROWS // BATCH}" / "trainer_state.json").read_text())["state"]


FORMATS = [".csv", ".tsv", ".json", ".jsonl", ".parquet",
           ".csv.gz", ".jsonl.bz2", ".tsv.xz", ".csv.zst", ".csv.zip"]


@pytest.mark.parametrize("suffix", FORMATS)
def test_format_trains_end_to_end(capsys, tiny_model, hf_home, tmp_path, suffix):
    rows = synthetic_rows(TRAIN_ROWS, seed=11)
    train = write_rows(tmp_path / f"train{suffix}", rows)
    evaluation = write_rows(tmp_path / f"eval{suffix}", synthetic_rows(EVAL_ROWS, seed=12))
    state = train_one_epoch(capsys, tiny_model, hf_home, tmp_path / "out", train, evaluation)
    assert state["tokens"] == tokens_in(tiny_model, rows, ["text"])  # every row, read as written


def test_zstd_frame_is_valid_zstandard(tmp_path):
    """The hand-written .zst files above are real Zstandard: the reference decoder reads them back."""
    zstandard = pytest.importorskip("zstandard")
    data = "".join(f"line {i}\n" for i in range(30_000)).encode()  # two blocks
    assert zstandard.ZstdDecompressor().decompress(zstd_frame(data)) == data


def test_text_pair_column_trains_on_both_texts(capsys, tiny_model, hf_home, tmp_path):
    """The label's word is only in the pair column; the run trains on both texts as one pair encoding."""
    rows = [{"context": " ".join(NEUTRAL[i % 7: i % 7 + 3]), "review": row["text"], "label": row["label"]}
            for i, row in enumerate(synthetic_rows(TRAIN_ROWS, seed=13))]
    eval_rows = [{"context": "the film", "review": row["text"], "label": row["label"]}
                 for row in synthetic_rows(EVAL_ROWS, seed=14)]
    train = write_rows(tmp_path / "train.csv", rows)
    evaluation = write_rows(tmp_path / "eval.csv", eval_rows)
    state = train_one_epoch(capsys, tiny_model, hf_home, tmp_path / "out", train, evaluation,
                            "data.text_column=context", "data.text_pair_column=review")
    assert state["tokens"] == tokens_in(tiny_model, rows, ["context", "review"])
    assert state["tokens"] > tokens_in(tiny_model, rows, ["review"]) + TRAIN_ROWS  # the context and a [SEP] more

    # What the run's own data code feeds the model: "[CLS] context [SEP] review [SEP]", segments 0 then 1.
    from transformers import AutoTokenizer

    from framework import run_data
    from framework.recipe import load_config
    from framework.tasks import get_task

    cfg = load_config(tmp_path / "out" / "config.yaml", [])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with fresh_process(hf_home):
        data, task = run_data.from_recipe(cfg), get_task(cfg.task)
        model, tokenizer = task.load(cfg, *data.read(task))
        data.prepare_rows(task, tokenizer, model)
        first = data.eval_ds[0]
    assert tokenizer.decode(first["input_ids"]) == f"[CLS] the film [SEP] {eval_rows[0]['review']} [SEP]"
    assert first["token_type_ids"] == [0] * 4 + [1] * (len(first["input_ids"]) - 4)

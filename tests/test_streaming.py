"""Streaming and mixing: a stream trains through the real CLI, resumes bitwise after a kill (twice, and with
two processes), evaluates on a fixed held-out set; the loader covers every example once per epoch; weighted
sources are drawn in the weights' proportions; bad input is refused by key."""

import json
import subprocess
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest

from helpers import (KILL_SCRIPT, ROOT, TINY_LM, assert_bitwise_equal_models, crash_then_resume, documents,
                     environment, launch_cmd, losses_by_step, read_metrics)
from in_process import run_main, train_ok

# 3 shards of ~30 blocks of 32 tokens: an epoch is ~20 steps of 4 blocks, so these runs cross epochs.
STREAM = ["data.streaming=true", "data.shuffle_buffer=16", "train.max_steps=40", "checkpoint.every_steps=8",
          "eval.batches=2", "train.log_every=1"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shards")
    for i in range(3):
        (folder / f"part{i}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in documents(40, seed=20 + i)))
    return folder


def stream_args(tokenizer: Path, shards: Path, out: Path, *extra: str):
    return ["--config", str(TINY_LM), f"model.tokenizer={tokenizer}", f"data.train_file={shards}/part*.jsonl",
            f"output_dir={out}", *STREAM, *extra]


def test_streamed_run_resumes_bitwise_twice(cli, hf_home, word_tokenizer, shards, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train_ok(stream_args(word_tokenizer, shards, whole), hf_home)
    epochs = [r["epoch"] for r in read_metrics(whole) if "loss" in r]
    assert epochs[0] == 0 and epochs[-1] >= 1, "the run should cross an epoch (a pass over the files)"
    # Killed at step 13 (resumes from step 8), then again at step 8 + 12 = 20 (resumes from step 16: the
    # second resume continues the stream from its own checkpoint, not from the first one or the start).
    args = stream_args(word_tokenizer, shards, resumed)
    killed = subprocess.run(launch_cmd(KILL_SCRIPT, None) + args, cwd=ROOT, env=environment(hf_home, KILL_AT_MICRO="13"))
    assert killed.returncode != 0
    proc = crash_then_resume(hf_home, args, 12)
    assert "resuming from" in proc.stdout and "step_16" in proc.stdout
    assert_bitwise_equal_models(whole, resumed)
    assert losses_by_step(resumed) == losses_by_step(whole)  # every step's loss, to the last bit
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["eval"]["perplexity"] < 10  # a vocabulary of 34: it learned the grammar
    assert summary["eval"] == json.loads((resumed / "summary.json").read_text())["eval"]


@pytest.mark.multiprocess
def test_two_processes_read_their_own_shares_and_resume_bitwise(cli, hf_home, word_tokenizer, shards, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    cli(stream_args(word_tokenizer, shards, whole, "train.max_steps=24"), launch="cpu_ddp.yaml")
    assert json.loads((whole / "summary.json").read_text())["num_processes"] == 2
    crash_then_resume(hf_home, stream_args(word_tokenizer, shards, resumed, "train.max_steps=24"), 11, "cpu_ddp.yaml")
    assert (resumed / "checkpoints" / "step_24" / "stream_1.json").is_file()  # each process's own position
    assert (resumed / "checkpoints" / "step_24" / "stream_1.safetensors").is_file()
    assert_bitwise_equal_models(whole, resumed)
    assert losses_by_step(resumed) == losses_by_step(whole)


def test_eval_is_a_fixed_held_out_set(hf_home, word_tokenizer, shards, tmp_path, capsys):
    from framework import streaming
    from framework.recipe import load_config
    from framework.tasks import get_task

    args = stream_args(word_tokenizer, shards, tmp_path / "out", "eval.batches=1", "train.max_steps=2",
                       "data.eval_fraction=0.3")
    assert run_main(args, hf_home) == 0
    assert "evaluation at the end, on the first 8 examples of the eval stream" in capsys.readouterr().out
    cfg = load_config(str(TINY_LM), args[2:])
    task = get_task("causal_lm")
    columns = task.columns(cfg)
    train = [r["text"] for r in streaming.rows(cfg, columns, task.keep_row(cfg), 0, evaluation=False)]
    held = [r["text"] for r in streaming.rows(cfg, columns, task.keep_row(cfg), 0, evaluation=True)]
    everything = [d["text"] for i in range(3) for d in documents(40, seed=20 + i)]
    assert sorted(train + held) == sorted(everything) and not set(train) & set(held)
    assert 0.2 < len(held) / len(everything) < 0.4  # data.eval_fraction 0.3


def saved_and_loaded(state: dict, folder: Path) -> dict:
    """A loader state written as a checkpoint holds it (JSON and safetensors, no pickle) and read back."""
    from framework import checkpoint

    checkpoint.save_loader_state(state, folder, 0)
    assert sorted(p.name for p in folder.iterdir()) == ["stream_0.json", "stream_0.safetensors"]
    return checkpoint.load_loader_state(folder, 0)


def test_the_loader_covers_every_example_once_per_epoch_and_restores_exactly(tmp_path):
    from framework.streaming import StreamLoader

    def make(epoch):  # 3 shards, reordered per epoch as the real streams are
        shards = [list(range(s * 100, s * 100 + 100)) for s in range(3)]
        order = [(epoch + s) % 3 for s in range(3)]
        return datasets.IterableDataset.from_generator(
            lambda: ({"x": x} for s in order for x in shards[s]))

    def loader():
        return StreamLoader(make, lambda rows: [r["x"] for r in rows], 10, 32, seed=1, device="cpu")

    batches = iter(loader())
    first_epoch = [x for _ in range(30) for x in next(batches)]
    assert sorted(first_epoch) == list(range(300)) and first_epoch[:100] != list(range(100))  # shuffled
    reference = [next(batches) for _ in range(50)]  # the rest of epoch 1 and into epoch 2

    a = loader()
    it = iter(a)
    for _ in range(37):
        next(it)
    state = saved_and_loaded(a.state_dict(), tmp_path)
    b = loader()
    b.load_state_dict(state)
    assert [next(iter_b) for iter_b in [iter(b)] for _ in range(43)] == reference[7:]

    # Saved right after an epoch's last batch: the resumed epoch has nothing left, and the next one follows.
    c = loader()
    it = iter(c)
    for _ in range(30):
        next(it)
    d = loader()
    d.load_state_dict(c.state_dict())
    assert [next(iter_d) for iter_d in [iter(d)] for _ in range(5)] == reference[:5]


def test_a_saved_loader_state_keeps_its_arrays_exactly(tmp_path):
    """The shuffle buffer's token arrays keep dtype, shape and values; scalars and generator states their values."""
    rng = np.random.default_rng(3)
    rng.integers(10)
    state = {"epoch": 2, "stream": {"shard_idx": np.int64(1), "examples": [3, 4], "done": False},
             "rng": rng.bit_generator.state,
             "buffer": [{"input_ids": np.arange(5, dtype=np.int64), "attention_mask": np.ones(5, dtype=np.int8),
                         "labels": 1}, {"input_ids": np.zeros(0, dtype=np.int64), "labels": 0}]}
    loaded = saved_and_loaded(state, tmp_path)
    assert loaded["epoch"] == 2 and loaded["stream"] == {"shard_idx": 1, "examples": [3, 4], "done": False}
    assert loaded["rng"] == state["rng"]
    for got, want in zip(loaded["buffer"], state["buffer"]):
        assert got.keys() == want.keys()
        for key in want:
            if isinstance(want[key], np.ndarray):
                assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key])
            else:
                assert got[key] == want[key]


@pytest.mark.parametrize("streaming", [False, True])
def test_sources_are_mixed_by_weight(tmp_path, streaming):
    from framework import data, streaming as stream
    from framework.recipe import load_config
    from framework.tasks import get_task

    for name, n in (("alpha", 300), ("beta", 3000)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} {i}"}) + "\n" for i in range(n)))
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(f"task: causal_lm\nmodel:\n  config: {{model_type: gpt2}}\n  tokenizer: t\ntrain:\n  max_steps: 1\n"
                      f"data:\n  streaming: {str(streaming).lower()}\n  sources:\n"
                      f"    - {{train_file: {tmp_path}/alpha.jsonl, weight: 3}}\n"
                      f"    - {{train_file: {tmp_path}/beta.jsonl, weight: 1}}\n")
    cfg = load_config(str(recipe), [])
    task = get_task("causal_lm")
    if streaming:
        rows = list(stream.rows(cfg, task.columns(cfg), task.keep_row(cfg), 0, evaluation=False))
        held = list(stream.rows(cfg, task.columns(cfg), task.keep_row(cfg), 0, evaluation=True))
    else:
        splits = data.load_splits(cfg.data, cfg.seed, task.columns(cfg), task.keep_row(cfg))
        rows, held = list(splits.train), list(splits.eval)
    # Held out before mixing: a row the mix repeats is never both trained and evaluated on.
    assert held and not {r["text"] for r in rows} & {r["text"] for r in held}
    counts = Counter(r["text"].split()[0] for r in rows[:4000])
    share = counts["alpha"] / sum(counts.values())
    assert abs(share - 0.75) < 3 * (0.75 * 0.25 / sum(counts.values())) ** 0.5  # within 3 sigma of 3:1
    # An epoch reads every source once (but the ~10% held out for evaluation): the small, heavily weighted
    # one starts over meanwhile.
    assert len({r["text"] for r in rows if r["text"].startswith("beta")}) > 0.85 * 3000
    assert len(rows) > 0.85 * 3000 * 4


@pytest.mark.parametrize("override,expected", [
    (["train.max_steps=null"], "train.max_steps is required with data.streaming"),
    (["data.train_file=/nonexistent/part*.jsonl"], "data.train_file: no file matches /nonexistent/part*.jsonl"),
    (["data.num_workers=2"], "data.num_workers: a stream is read in the training process"),
    (["data.sources=[{weight: 2}]"], "data.sources[0]: set train_file (files) or dataset"),
])
def test_bad_streaming_recipes_are_refused_by_key(hf_home, word_tokenizer, shards, tmp_path, capsys, override,
                                                  expected):
    args = stream_args(word_tokenizer, shards, tmp_path / "out", *override)
    if override[0].startswith("data.sources"):
        args = [a for a in args if not a.startswith("data.train_file")]
    assert run_main(args, hf_home) == 2
    assert expected in capsys.readouterr().err


def test_streamed_classification_needs_its_labels(hf_home, tiny_model, easy_data, tmp_path, capsys):
    from helpers import tiny_args

    args = tiny_args(tiny_model, easy_data, tmp_path / "out", "data.streaming=true", "train.max_steps=3")
    assert run_main(args, hf_home) == 2
    assert "data.labels is required with data.streaming" in capsys.readouterr().err
    assert run_main([*args, "data.labels=[neg,pos]"], hf_home) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["train"]["steps"] == 3 and 0 <= summary["eval"]["accuracy"] <= 1

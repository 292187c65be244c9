"""The real CLI through `accelerate launch`, on a tiny random BERT and an easy synthetic task."""

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import REFERENCES, ROOT, RUN, read_metrics, tiny_args, train_losses
from framework.config import load_config

REFERENCE = REFERENCES / "tiny_text_classification.json"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model, easy_data, hf_home):
    """One 3-epoch run shared by the assertions below."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("tiny_run") / "out"
    env = {**os.environ, "HF_HOME": str(hf_home), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu.yaml"), str(RUN),
           *tiny_args(tiny_model, easy_data, out, "train.epochs=3")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out, proc


def test_first_losses_match_reference(tiny_run):
    out, _ = tiny_run
    losses = train_losses(out)[:10]
    if os.environ.get("RECORD_REFERENCES"):  # after a deliberate change of numerics: record, review, commit
        REFERENCE.write_text(json.dumps({"losses": losses}, indent=2) + "\n")
    expected = json.loads(REFERENCE.read_text())["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)


def test_learns_the_easy_task(tiny_run):
    out, _ = tiny_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval"]["accuracy"] >= 0.9, summary["eval"]  # chance is 0.5
    assert summary["eval"]["f1"] >= 0.9
    assert summary["train"]["loss"] < 0.3


def test_every_contract_output_exists(tiny_run):
    out, _ = tiny_run
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["train"]) >= {"steps", "samples", "loss", "samples_per_second", "tokens_per_second",
                                     "wall_seconds"}
    assert set(summary["eval"]) >= {"loss", "accuracy", "f1"}
    assert summary["backend"] == "cpu" and summary["num_processes"] == 1 and summary["precision"] == "no"
    assert set(summary["memory"]) >= {"parameters", "trainable_parameters", "weight_bytes", "gradient_bytes",
                                      "optimizer_state_bytes", "peak_bytes"}
    # AdamW keeps two fp32 moments per parameter (plus a step counter per tensor).
    assert summary["memory"]["optimizer_state_bytes"] >= 8 * summary["memory"]["trainable_parameters"]
    assert summary["train"]["steps"] == 3 * (360 // 8) and summary["train"]["samples"] == 3 * 360 // 8 * 8
    records = read_metrics(out)
    assert all("step" in r for r in records)
    assert [r["step"] for r in records if "eval_accuracy" in r] == [45, 90, 135]  # one eval per epoch
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "tokenizer.json").is_file()
    assert load_config(out / "config.yaml", []).train.epochs == 3


def test_saved_model_carries_labels_and_loads_in_pipeline(tiny_run):
    from transformers import pipeline

    out, _ = tiny_run
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "neg", "1": "pos"}
    classify = pipeline("text-classification", model=str(out / "model"), device="cpu")
    assert classify("the movie was great and lovely")[0]["label"] == "pos"
    assert classify("the film was dull and awful")[0]["label"] == "neg"


def test_second_run_reuses_the_tokenized_cache(tiny_run, cli, tiny_model, easy_data, hf_home, tmp_path):
    cache = hf_home / "datasets"
    before = {p: p.stat().st_mtime for p in cache.rglob("*.arrow")}
    cli(tiny_args(tiny_model, easy_data, tmp_path / "again", "train.max_steps=2"))
    after = {p: p.stat().st_mtime for p in cache.rglob("*.arrow")}
    assert after == before  # nothing re-read, re-filtered or re-tokenized


def test_refuses_to_overwrite_then_overwrites_when_told(cli, tiny_model, easy_data, tmp_path):
    out = tmp_path / "run"
    cli(tiny_args(tiny_model, easy_data, out, "train.max_steps=2"))
    before = (out / "summary.json").read_text()
    proc = cli(tiny_args(tiny_model, easy_data, out, "train.max_steps=3"), check=False)
    assert proc.returncode == 2 and "already holds another run's outputs" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (out / "summary.json").read_text() == before  # nothing lost
    cli(tiny_args(tiny_model, easy_data, out, "train.max_steps=3", "overwrite=true"))
    assert json.loads((out / "summary.json").read_text())["train"]["steps"] == 3
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3]  # the old log is gone

"""The real CLI through `accelerate launch`, on a tiny random BERT and an easy synthetic task."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import (ACCELERATE_COMMAND, REFERENCES, ROOT, RUN, launch_cmd, read_metrics, synthetic_rows, tiny_args,
                     train_losses, write_csv)
from framework.recipe import load_config
from in_process import run_main, train_ok

REFERENCE = REFERENCES / "tiny_text_classification.json"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model, easy_data, hf_home):
    """One 3-epoch run shared by the assertions below."""
    import subprocess

    out = tmp_path_factory.mktemp("tiny_run") / "out"
    env = {**os.environ, "HF_HOME": str(hf_home), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [*launch_cmd(RUN, "cpu.yaml", launcher=ACCELERATE_COMMAND),
           *tiny_args(tiny_model, easy_data, out, "train.epochs=3", "report.enabled=true")]
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


def test_progress_bar_shows_the_eta_loss_and_speeds(tiny_run):
    out, proc = tiny_run
    bars = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.startswith("train loss")]
    # tqdm's [elapsed<remaining, rate], then the loop's samples/s and tokens/s.
    pattern = r"train loss \d\.\d{4}: +\d+%\|.*\| (\d+)/135 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+(step/s|s/step), [\d.]+ samples/s, \d+ tokens/s\]"
    shown = [re.fullmatch(pattern, line.strip()) for line in bars]
    assert bars and all(shown), bars[:3]
    assert shown[-1].group(1) == "135"
    assert (out / "report.html").is_file() and (out / "plots" / "curves.png").is_file()  # also under accelerate launch


# What a library says that a user of the framework can do nothing about, and used to see on every run: DeepSpeed's
# "Setting accelerator to CPU" (accelerate imports it to unwrap models), bitsandbytes' "Failed to load CPU
# gemm_4bit_forward" (peft imports it), transformers' FutureWarnings (peft reads a deprecated property).
NOISE = re.compile(r"warn|deprecat|failed to load", re.IGNORECASE)


def noisy_lines(output: str) -> list:
    """The lines of a run's output that warn. accelerate's launcher, before the run starts, lists the settings its
    config file leaves to defaults (accelerate_configs/cpu.yaml: the threads per process, which a config file cannot
    set): its own block, not the run's."""
    launcher = re.compile(r"The following values were not passed to `accelerate launch`.*?run `accelerate config`\.",
                          re.DOTALL)
    return [line for line in launcher.sub("", output).splitlines() if NOISE.search(line)]


def test_a_run_prints_no_warning(tiny_run):
    """The run's whole output, under accelerate launch, training, evaluating and saving: no warning from any library
    (framework/noise.py, backend.select_backend)."""
    _, proc = tiny_run
    assert noisy_lines(proc.stdout + proc.stderr) == []


def test_saved_model_carries_labels_and_loads_in_pipeline(tiny_run):
    from transformers import pipeline

    out, _ = tiny_run
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "neg", "1": "pos"}
    classify = pipeline("text-classification", model=str(out / "model"), device="cpu")
    assert classify("the movie was great and lovely")[0]["label"] == "pos"
    assert classify("the film was dull and awful")[0]["label"] == "neg"


def arrow_files(cache: Path) -> dict:
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in cache.rglob("*.arrow")}


def test_second_run_reuses_the_tokenized_cache(cli, tiny_model, hf_home, tmp_path):
    """A first run on data no earlier run has seen tokenizes it into Arrow files in the datasets cache; a
    second run (another process) reads them back: it tokenizes nothing and writes no file there."""
    from datasets import Dataset

    data = write_csv(tmp_path / "unseen.csv", synthetic_rows(120, seed=21))
    cache = hf_home / "datasets"
    before = arrow_files(cache)
    first = cli(tiny_args(tiny_model, data, tmp_path / "first", "train.max_steps=2"))
    after_first = arrow_files(cache)
    tokenized = [p for p in set(after_first) - set(before) if "input_ids" in Dataset.from_file(str(p)).column_names]
    assert len(tokenized) == 2, sorted(after_first)  # the train and eval splits
    assert "Tokenizing" in first.stderr
    second = cli(tiny_args(tiny_model, data, tmp_path / "second", "train.max_steps=2"))
    assert arrow_files(cache) == after_first  # nothing re-read, re-filtered or re-tokenized, nothing rewritten
    assert "Tokenizing" not in second.stderr


def test_refuses_to_overwrite_then_overwrites_when_told(cli, tiny_model, easy_data, hf_home, tmp_path):
    out = tmp_path / "run"
    train_ok(tiny_args(tiny_model, easy_data, out, "train.max_steps=2"), hf_home)
    before = (out / "summary.json").read_text()
    proc = cli(tiny_args(tiny_model, easy_data, out, "train.max_steps=3"), check=False)
    # The message names the folder and the way out (its wording differs for a finished and an unfinished run).
    assert proc.returncode == 2 and f"the run in {out} already finished" in proc.stderr
    assert "overwrite=true" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (out / "summary.json").read_text() == before  # nothing lost
    train_ok(tiny_args(tiny_model, easy_data, out, "train.max_steps=3", "overwrite=true"), hf_home)
    assert json.loads((out / "summary.json").read_text())["train"]["steps"] == 3
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3]  # the old log is gone


def test_tensorboard_logs_the_values_of_metrics_jsonl(tiny_model, easy_data, hf_home, tmp_path):
    """report_to: [tensorboard] writes event files whose scalars are metrics.jsonl's numbers at the same
    steps (TensorBoard keeps float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    assert run_main(tiny_args(tiny_model, easy_data, out, "train.max_steps=6", "eval.every_steps=3",
                              "report_to=[tensorboard]"), hf_home) == 0
    scalars = {}
    for folder in {p.parent for p in out.rglob("events.out.tfevents.*")}:
        events = EventAccumulator(str(folder))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    records = read_metrics(out)
    for key, steps in (("loss", [1, 2, 3, 4, 5, 6]), ("lr", [1, 2, 3, 4, 5, 6]), ("mfu", [1, 2, 3, 4, 5, 6]),
                       ("tokens_per_second", [1, 2, 3, 4, 5, 6]), ("eval_loss", [3, 6]), ("eval_accuracy", [3, 6])):
        logged = {r["step"]: r[key] for r in records if key in r}
        assert list(logged) == steps, key
        assert scalars[key] == {step: float(np.float32(value)) for step, value in logged.items()}, key


def test_trackers_get_the_hyperparameters_once_as_one_flat_mapping(tiny_model, easy_data, hf_home, tmp_path):
    """accelerate's tensorboard tracker stores what it is given in hparams.yml: the resolved recipe, flat."""
    import yaml

    from framework.config import to_dict
    from framework.report import hyperparameters

    out = tmp_path / "out"
    args = tiny_args(tiny_model, easy_data, out, "train.max_steps=2", "report_to=[tensorboard]")
    assert run_main(args, hf_home) == 0
    (stored,) = list(out.rglob("hparams.yml"))
    hparams = yaml.safe_load(stored.read_text())
    assert hparams == hyperparameters(to_dict(load_config(args[1], args[2:])))
    assert hparams["optim.lr"] == 1e-3 and hparams["train.max_steps"] == 2 and hparams["data.eval_file"] is None
    assert hparams["report_to"] == '["tensorboard"]' and hparams["optim.betas"] == "[0.9, 0.999]"
    assert all(isinstance(v, (bool, int, float, str, type(None))) for v in hparams.values())

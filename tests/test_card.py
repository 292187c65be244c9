"""The model card (framework/card.py): model/README.md read back by huggingface_hub's ``ModelCard.load``, its
metadata (base model, library, pipeline, tags, datasets) and its text (the figures, the evaluation, the recipe, the
framework's version and commit), from a real tiny run's summary.json and config.yaml and from a recipe of SFT on a
Hub model and dataset with a token from the environment."""

from __future__ import annotations

import json
import re
import subprocess

import yaml
from huggingface_hub import ModelCard

import framework
from framework import card
from framework.config import to_dict
from framework.recipe import load_config
from helpers import ROOT, TINY_LM, lm_args, summary
from in_process import run_main

HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# A summary.json's shape (framework/train.py) with the parts a tiny run lacks: the best step, the harness.
SUMMARY = {
    "train": {"steps": 50, "samples": 400, "loss": 0.4123, "samples_per_second": 3.2, "tokens_per_second": 410.5,
              "wall_seconds": 125.0, "resumed_from_step": None, "stopped_early": False, "skipped_steps": None},
    "eval": {"loss": 0.385, "perplexity": 1.4696, "answer_accuracy": 0.87},
    "backend": "cpu", "device": "cpu", "num_processes": 2, "precision": "no", "mfu": 0.0123,
    "plan": {"effective_batch": 8, "train_examples": 432, "eval_examples": 48, "epochs": 0.926},
    "best": {"step": 40, "metric": "answer_accuracy", "value": 0.89},
    "harness": {"step": 50, "tasks": {"rt_sentiment": {"acc": 0.81, "samples": 8}}, "seconds": 3.5},
    "sample": {"prompt": "the movie was superb", "generated": "positive"},
    "wall_seconds": 3725.0,
}


def recipe_block(text: str) -> dict:
    return yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))


def head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def test_a_real_runs_card_reads_back(word_tokenizer, corpus, hf_home, tmp_path):
    """Every run writes model/README.md at its end, from its recipe and summary.json."""
    out = tmp_path / "tiny-run"
    assert run_main(lm_args(word_tokenizer, corpus, out, "train.max_steps=3"), hf_home) == 0
    recipe = yaml.safe_load((out / "config.yaml").read_text())
    loaded = ModelCard.load(out / "model" / "README.md")
    assert loaded.data.base_model is None  # from scratch
    assert (loaded.data.library_name, loaded.data.pipeline_tag, loaded.data.model_name) == \
        ("transformers", "text-generation", "tiny-run")
    assert loaded.data.tags == [card.PROJECT_TAG, "causal_lm"] and loaded.data.datasets is None
    figures = summary(out)
    assert f"| train loss (last logged) | {figures['train']['loss']:.4g} |" in loaded.text
    assert "| optimizer steps | 3 |" in loaded.text and f"| samples trained on | {figures['train']['samples']} |" \
        in loaded.text and "## Files" not in loaded.text  # no export.gguf
    assert f"| eval perplexity | {figures['eval']['perplexity']:.4g} |" in loaded.text
    assert "| wall time (whole run) |" in loaded.text and f"training file: `{corpus}`" in loaded.text
    assert recipe_block(loaded.text) == recipe
    assert f"framework version: {framework.__version__}" in loaded.text and f"git commit: {head()}" in loaded.text


def test_an_sft_card_names_its_hub_model_and_dataset_and_keeps_the_token_templated(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_secret")
    cfg = load_config(TINY_LM, ["task=sft", "model.config=null", f"model.name_or_path={HUB_MODEL}",
                                "model.token=${oc.env:HF_TOKEN}", "data.dataset=org/reviews", "peft.r=4",
                                "peft.merge=true", f"output_dir={tmp_path / 'sft-run'}"])
    recipe = to_dict(cfg)
    (tmp_path / "sft-run" / "model").mkdir(parents=True)
    gguf = tmp_path / "sft-run" / "model-q8_0.gguf"
    gguf.write_bytes(b"\0" * 2048)
    path = card.write_card(tmp_path / "sft-run" / "model", recipe, SUMMARY, files=[gguf])
    loaded = ModelCard.load(path)
    assert loaded.data.base_model == HUB_MODEL and loaded.data.datasets == ["org/reviews"]
    assert loaded.data.tags == [card.PROJECT_TAG, "sft", "lora", "peft"]
    assert (loaded.data.library_name, loaded.data.pipeline_tag) == ("transformers", "text-generation")
    text = loaded.text
    assert "hf_not_a_real_secret" not in path.read_text() and recipe_block(text)["model"]["token"] == \
        "${oc.env:HF_TOKEN}"
    for row in ("| train loss (last logged) | 0.4123 |", "| optimizer steps | 50 |", "| samples trained on | 400 |",
                "| wall time (whole run) | 1 h 2 min |", "| eval answer_accuracy | 0.87 |",
                "| rt_sentiment | acc 0.81"):
        assert row in text, row
    assert "best model by eval `answer_accuracy`: 0.89 at step 40" in text
    assert "`model-q8_0.gguf` (2.0 KB)" in text and "with LoRA adapters (merged into the weights)" in text


def test_the_base_model_of_a_local_folder_is_the_hub_model_it_names(tmp_path, monkeypatch):
    """A folder's own config (transformers 4 wrote _name_or_path) or card (an earlier run's model/: a chain of
    runs), or its Hub-cache path; none for a GGUF file or local weights alone."""
    def base(name) -> str:
        return card.base_model({"model": {"name_or_path": str(name)}})

    (tmp_path / "v4").mkdir()
    (tmp_path / "v4" / "config.json").write_text(json.dumps({"_name_or_path": "org/base"}))
    sft = tmp_path / "sft" / "model"
    sft.mkdir(parents=True)
    card.write_card(sft, {"task": "sft", "model": {"name_or_path": HUB_MODEL}}, {})
    cached = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc123"
    cached.mkdir(parents=True)
    (tmp_path / "plain").mkdir()
    assert [base(tmp_path / "v4"), base(sft), base(cached), base(tmp_path / "plain"), base(tmp_path / "m.gguf")] == \
        ["org/base", HUB_MODEL, "org/cached", None, None]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert ModelCard.load(card.write_card(adapter, {"task": "sft"}, {})).data.library_name == "peft"
    monkeypatch.setattr(card, "ROOT", tmp_path)  # not a git checkout
    assert card.git_commit() == "unknown"

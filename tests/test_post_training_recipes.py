"""The default post-training recipes as written (make test-slow), measured by the answers their model/ generates
through pipeline() on the reviews the recipes hold out: recipes/sft.yaml teaches the pretrained MiniLM, loaded as
a causal decoder, to answer "fresh" or "rotten" above the majority class; recipes/dpo.yaml on the sft run's
model/ (the chain README shows) raises the reward accuracy above the majority share, and the generated answers'
accuracy above the sft model's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import ROOT, cli_runner
from framework.config import load_config
from framework.data import load_splits
from framework.tasks import get_task

SFT, DPO = ROOT / "recipes" / "sft.yaml", ROOT / "recipes" / "dpo.yaml"


def held_out(recipe: Path, *overrides: str):
    """(prompts as conversations, their right answers): the eval rows of ``recipe``, split by the framework."""
    cfg = load_config(recipe, list(overrides))
    task = get_task(cfg.task)
    rows = load_splits(cfg.data, cfg.seed, task.columns(cfg), task.keep_row(cfg)).eval
    if cfg.task == "sft":
        return [r[:-1] for r in rows["messages"]], [r[-1]["content"] for r in rows["messages"]]
    return list(rows["prompt"]), [r[0]["content"] for r in rows["chosen"]]


def answer_accuracy(model: Path, prompts, answers) -> float:
    """The share of prompts whose greedy answer, generated through pipeline("text-generation"), is the right one."""
    from transformers import pipeline

    generate = pipeline("text-generation", model=str(model))
    right = [generate(p, max_new_tokens=4, do_sample=False)[0]["generated_text"][-1]["content"].strip() == a
             for p, a in zip(prompts, answers)]
    return float(np.mean(right))


def majority(answers) -> float:
    return max(answers.count(a) for a in set(answers)) / len(answers)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, hf_home):
    out = tmp_path_factory.mktemp("recipes") / "sft"
    cli_runner(hf_home)(["--config", str(SFT), f"output_dir={out}"], launch="cpu.yaml")
    return out


@pytest.mark.slow
def test_the_sft_recipe_answers_held_out_reviews_above_the_majority_class(sft_run, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe's paths are relative to the repository root
    prompts, answers = held_out(SFT)
    accuracy = answer_accuracy(sft_run / "model", prompts, answers)
    summary = json.loads((sft_run / "summary.json").read_text())
    print(f"sft: generated-answer accuracy {accuracy:.3f} on {len(answers)} held-out reviews, majority "
          f"{majority(answers):.3f}, eval {summary['eval']}, {summary['train']['wall_seconds']:.0f} s")
    assert accuracy >= majority(answers) + 0.08, (accuracy, majority(answers))
    # The eval's answer_accuracy (every answer token the argmax given the conversation) is the same figure.
    assert abs(summary["eval"]["answer_accuracy"] - accuracy) <= 0.01, (summary["eval"], accuracy)


@pytest.mark.slow
def test_dpo_on_the_sft_model_raises_its_answer_accuracy(sft_run, cli, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "dpo"
    cli(["--config", str(DPO), f"model.name_or_path={sft_run / 'model'}", f"output_dir={out}"], launch="cpu.yaml")
    prompts, answers = held_out(DPO)
    assert (prompts, answers) == held_out(SFT)  # the same reviews held out, in the same chat format
    sft_accuracy = answer_accuracy(sft_run / "model", prompts, answers)
    dpo_accuracy = answer_accuracy(out / "model", prompts, answers)
    reward_accuracy = json.loads((out / "summary.json").read_text())["eval"]["reward_accuracy"]
    print(f"dpo on sft: reward accuracy {reward_accuracy:.3f}, generated-answer accuracy {dpo_accuracy:.3f} "
          f"against sft's {sft_accuracy:.3f}, majority {majority(answers):.3f} ({len(answers)} held-out pairs)")
    assert reward_accuracy >= majority(answers) + 0.05, (reward_accuracy, majority(answers))
    assert dpo_accuracy > sft_accuracy, (dpo_accuracy, sft_accuracy)

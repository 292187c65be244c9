"""The task chooses its optimizer step (framework/step.py): the loop runs the one ``Task.step`` returns and logs what
that step says it processed."""

import json

import pytest
import torch

from helpers import TINY_RECIPE, tiny_args
from framework import flops, train
from framework.recipe import load_config
from framework.step import StepResult, SupervisedStep
from framework.tasks.text_classification import TextClassification
from in_process import fresh_process, train_ok

TOKENS_PER_STEP = 1000


class CountingStep(SupervisedStep):
    """The supervised step, reporting a made-up token count: what the loop's figures must then show."""

    calls, per_token = 0, None

    def __call__(self, ctx, batches) -> StepResult:
        CountingStep.calls += 1
        CountingStep.per_token = flops.model_flops(ctx.accelerator.unwrap_model(ctx.model)).per_token
        result = super().__call__(ctx, batches)
        result.tokens, result.token_context = TOKENS_PER_STEP, 0
        result.metrics = {"calls": float(CountingStep.calls)}  # a further scalar, logged as its window's mean
        return result


class CountingTask(TextClassification):
    def step(self, cfg):
        return CountingStep(cfg)


def test_a_task_supplies_its_own_step_and_the_loop_counts_its_tokens_and_logs_its_metrics(
        tiny_model, easy_data, hf_home, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "get_task", lambda name: CountingTask())
    CountingStep.calls = 0
    out = tmp_path / "out"
    train_ok(tiny_args(tiny_model, easy_data, out, "train.max_steps=6", "train.log_every=3"), hf_home)
    summary = json.loads((out / "summary.json").read_text())
    assert CountingStep.calls == summary["train"]["steps"] == 6
    seconds = summary["train"]["wall_seconds"]
    assert summary["train"]["tokens_per_second"] * seconds == pytest.approx(6 * TOKENS_PER_STEP)
    assert summary["flops"]["trained"] == 6 * TOKENS_PER_STEP * CountingStep.per_token  # no context: no attention
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["calls"] for r in logged if "loss" in r] == [2.0, 5.0]  # the means of steps 1-3 and 4-6


def test_the_supervised_step_counts_real_tokens_and_targets(tiny_model, easy_data, hf_home, tmp_path):
    """Tokens from the attention masks, their context from each row's real length, targets from the task."""
    cfg = load_config(TINY_RECIPE, [f"model.name_or_path={tiny_model}", f"data.train_file={easy_data}",
                                    f"output_dir={tmp_path / 'out'}", "train.gradient_accumulation_steps=2"])
    with fresh_process(hf_home):
        run = train.setup(cfg)
        assert isinstance(run.train_step, SupervisedStep) and run.train_step.micro_batches_per_update == 2
        iterator = iter(run.data.train_dl)
        batches = [next(iterator), next(iterator)]
        run.model.train()
        result = run.train_step(run.context, batches)
    lengths = torch.cat([batch["attention_mask"].sum(dim=1) for batch in batches])
    assert int(result.tokens) == int(lengths.sum()) and int(result.token_context) == int((lengths * lengths).sum())
    assert result.targets == sum(run.task.targets(batch) for batch in batches) == 2 * cfg.train.batch_size
    assert result.micro_steps == 2 and result.loss_sum.requires_grad is False

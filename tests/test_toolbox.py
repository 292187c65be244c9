"""The efficient-training keys through the real loop: each trains with finite, decreasing loss, and
does what it claims (local SGD syncs every K steps; checkpointing changes nothing numerically)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, tiny_args, train_losses


def assert_learns(out: Path) -> None:
    losses = train_losses(out)
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses


@pytest.mark.parametrize("overrides", [
    ["train.gradient_checkpointing=true"],
    ["precision=bf16"],
    ["optim.name=sgd", "optim.lr=0.05", "optim.nesterov=true"],
    ["optim.name=adafactor", "optim.lr=1e-3"],
    ["optim.name=adafactor", "optim.lr=null", "optim.relative_step=true", "optim.scheduler=constant"],
    ["optim.name=adamw_8bit"],
    ["optim.name=paged_adamw_8bit"],
    ["optim.name=lion", "optim.lr=3e-4"],
    ["optim.scheduler=cosine", "optim.warmup_steps=5"],
    ["optim.param_groups=[{pattern: classifier, lr: 0.01}]"],
], ids=lambda o: " ".join(o))
def test_key_trains_with_decreasing_loss(cli, tiny_model, easy_data, tmp_path, overrides):
    out = tmp_path / "out"
    cli(tiny_args(tiny_model, easy_data, out, "train.epochs=2", "train.log_every=3", *overrides))
    assert_learns(out)


def test_torch_compile_trains(cli, tiny_model, easy_data, tmp_path):
    out = tmp_path / "out"
    cli(tiny_args(tiny_model, easy_data, out, "train.max_steps=60", "train.log_every=3", "train.compile=true",
                  "data.padding=max_length"))
    assert_learns(out)


@pytest.mark.multiprocess
def test_local_sgd_syncs_every_k_steps_and_replicas_agree_after(hf_home, tiny_model, easy_data, tmp_path):
    out = tmp_path / "local_sgd"
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu_ddp.yaml"), str(ROOT / "tests" / "scripts" / "local_sgd_probe.py"),
           *tiny_args(tiny_model, easy_data, out, "backend=cpu", "train.max_steps=12", "train.batch_size=4",
                      "distributed.local_sgd_steps=4")]
    proc = subprocess.run(cmd, cwd=ROOT, env={**__import__("os").environ, "HF_HOME": str(hf_home)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, "\n".join(line for line in proc.stderr.splitlines() if "rank1" in line)[-4000:] \
        + proc.stderr[-3000:]
    ranks = [json.loads((out / f"local_sgd_rank{r}.json").read_text()) for r in (0, 1)]
    # Syncs after steps 4, 8, 12, and once more when the Local SGD context closes.
    assert [r["step"] for r in ranks[0]] == [r["step"] for r in ranks[1]] == [4, 8, 12, 12]
    for a, b in zip(ranks[0][:3], ranks[1][:3]):
        assert a["before"] != b["before"]  # the replicas drifted apart: no gradient all-reduce in between
        assert a["after"] == pytest.approx(b["after"], rel=1e-12)  # and are equal right after each sync
    # The closing sync finds the replicas already equal: no step ran since the sync at step 12.
    assert ranks[0][3]["before"] == pytest.approx(ranks[1][3]["before"], rel=1e-12)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    batch = tokenizer(["the movie was good", "a dull and boring film with music"], padding=True, return_tensors="pt")
    batch["labels"] = torch.tensor([1, 0])

    def loss_and_grads(checkpointing: bool):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(tiny_model, hidden_dropout_prob=0.1)
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss_plain, grads_plain = loss_and_grads(False)
    loss_ckpt, grads_ckpt = loss_and_grads(True)
    torch.testing.assert_close(loss_ckpt, loss_plain)
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_recipe_key_turns_on_the_models_checkpointing(tiny_model, easy_data, tmp_path):
    from framework.config import load_config
    from framework.train import setup

    cfg = load_config(tiny_args(tiny_model, easy_data, tmp_path)[1], tiny_args(tiny_model, easy_data, tmp_path / "o")[2:]
                      + ["train.gradient_checkpointing=true"])
    run = setup(cfg)
    assert run.accelerator.unwrap_model(run.model).is_activation_checkpointing


@pytest.mark.parametrize("overrides,message", [
    (["backend=xla", "distributed.local_sgd_steps=4"], "distributed.local_sgd_steps: accelerate's LocalSGD does not support XLA"),
    (["backend=xla", "train.compile=true"], "train.compile: XLA already compiles"),
    (["optim.name=sgd", "optim.momentum=0", "optim.nesterov=true"], "optim.nesterov"),
    (["optim.name=adafactor", "optim.relative_step=true"], "optim.relative_step"),
    (["optim.lr=null"], "optim.lr: null is only allowed with optim.name=adafactor"),
    (["optim.scheduler=constant", "optim.warmup_steps=3"], "warmup"),
    (["optim.param_groups=[{pattern: nothing_matches_this}]"], "optim.param_groups[0].pattern"),
    (["precision=fp8"], "precision: fp8 needs an fp8-capable GPU"),
    (["train.early_stopping_patience=2"], "train.early_stopping_patience needs eval.metric"),
    (["eval.metric=bleu"], "eval.metric: 'bleu' is not a metric of the task"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_invalid_combination_is_refused(capsys, monkeypatch, tiny_model, easy_data, tmp_path, overrides, message):
    from framework import device
    from framework.cli import main

    monkeypatch.setattr(device, "has_xla", lambda: True)  # lets the XLA refusals speak without torch_xla
    assert main(tiny_args(tiny_model, easy_data, tmp_path / "out", *overrides)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

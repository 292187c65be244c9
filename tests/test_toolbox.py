"""The efficient-training keys through the real loop: each trains with finite, decreasing loss, and
does what it claims: the logged learning rate follows the schedule's formula, parameter groups train with
their own learning rate and weight decay, each optimizer name builds that optimizer class, train.compile
compiles graphs with torch.compile, local SGD syncs every K steps, checkpointing changes nothing numerically."""

import importlib
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import (ACCELERATE_COMMAND, ROOT, TINY_RECIPE, checkpoint_states, launch_cmd, read_metrics, tiny_args,
                     train_losses)
from in_process import fresh_process, run_main


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
def test_key_trains_with_decreasing_loss(tiny_model, easy_data, hf_home, tmp_path, overrides):
    out = tmp_path / "out"
    assert run_main(tiny_args(tiny_model, easy_data, out, "train.epochs=2", "train.log_every=3", *overrides),
                    hf_home) == 0
    assert_learns(out)


def test_torch_compile_compiles_the_model_and_trains(tiny_model, easy_data, hf_home, tmp_path):
    """torch.compile really ran: dynamo captured graphs in the compiled run and none in the same run without
    the key (so the counter is a signal of train.compile, not of something else compiling)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    common = ["data.padding=max_length", "train.log_every=3"]
    torch._dynamo.reset()
    counters.clear()
    try:
        assert run_main(tiny_args(tiny_model, easy_data, tmp_path / "eager", *common, "train.max_steps=2"),
                        hf_home) == 0
        eager_graphs = counters["stats"]["unique_graphs"]
        out = tmp_path / "out"
        assert run_main(tiny_args(tiny_model, easy_data, out, *common, "train.max_steps=60", "train.compile=true"),
                        hf_home) == 0
        compiled_graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
        counters.clear()
    assert eager_graphs == 0
    assert compiled_graphs > 0
    assert_learns(out)


def expected_lr(schedule: str, step: int, total: int, warmup: int, peak: float) -> float:
    """The learning rate after ``step`` optimizer steps, from the schedules' formulas."""
    if step < warmup:
        return peak * step / warmup
    progress = (step - warmup) / (total - warmup)
    if schedule == "linear":
        return peak * (1 - progress)
    if schedule == "cosine":
        return peak * 0.5 * (1 + math.cos(math.pi * progress))
    assert schedule == "constant_with_warmup"
    return peak


@pytest.mark.parametrize("schedule,warmup_key,warmup", [
    ("linear", "optim.warmup_steps=3", 3),
    ("cosine", "optim.warmup_ratio=0.2", 2),  # ceil(0.2 x 10 steps)
    ("constant_with_warmup", "optim.warmup_steps=4", 4),
])
def test_logged_learning_rate_follows_the_schedule(tiny_model, easy_data, hf_home, tmp_path, schedule, warmup_key,
                                                   warmup):
    out = tmp_path / "out"
    assert run_main(tiny_args(tiny_model, easy_data, out, "optim.lr=2e-3", f"optim.scheduler={schedule}", warmup_key,
                              "train.max_steps=10", "train.log_every=1"), hf_home) == 0
    logged = {r["step"]: r["lr"] for r in read_metrics(out) if "lr" in r}
    assert list(logged) == list(range(1, 11))
    expected = {step: expected_lr(schedule, step, 10, warmup, 2e-3) for step in logged}
    assert logged == pytest.approx(expected, rel=1e-9, abs=1e-15)
    # The shape, spelled out: a rise during warmup, the peak at its end, then the schedule's own way.
    assert logged[warmup] == pytest.approx(2e-3) and all(logged[s] < logged[s + 1] for s in range(1, warmup))
    assert logged[10] == (2e-3 if schedule == "constant_with_warmup" else 0.0)


def test_param_group_trains_with_its_own_lr_and_weight_decay(tiny_model, easy_data, hf_home, tmp_path):
    """Through the CLI: the optimizer the loop stepped (its state in a checkpoint) holds the classifier in
    groups of its own, at its own peak learning rate on the shared schedule and its own weight decay (none
    for the bias); and the classifier, at a learning rate of 1e-9, is all but unchanged while the encoder,
    at 1e-2, moves."""
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "out"
    args = tiny_args(tiny_model, easy_data, out, "optim.lr=1e-2", "optim.weight_decay=0.01",
                     "optim.param_groups=[{pattern: '^classifier[.]', lr: 1.0e-9, weight_decay: 0.5}]",
                     "optim.scheduler=linear", "optim.warmup_steps=2", "train.max_steps=6",
                     "checkpoint.every_steps=3", "checkpoint.keep_last=5")
    assert run_main(args, hf_home) == 0

    # The checkpoint's optimizer state names each parameter's group settings by the parameter's name
    # (framework/backend/states.py); every parameter of the model is in one.
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model)
    saved = checkpoint_states(out / "checkpoints" / "step_3")["optimizer"]
    by_name = {}
    for key, value in saved.items():
        if key.startswith("param_groups."):
            name, setting = key.removeprefix("param_groups.").rsplit(".", 1)
            by_name.setdefault(name, {})[setting] = value
    assert set(by_name) == {name for name, _ in model.named_parameters()}
    factor = (6 - 3) / (6 - 2)  # linear schedule after 3 of 6 steps, 2 of them warmup
    expected = {"classifier.weight": (1e-9, 0.5), "classifier.bias": (1e-9, 0.0),
                "bert.pooler.dense.weight": (1e-2, 0.01), "bert.pooler.dense.bias": (1e-2, 0.0),
                "bert.encoder.layer.0.attention.self.query.weight": (1e-2, 0.01),
                "bert.embeddings.LayerNorm.weight": (1e-2, 0.0)}
    for name, (peak, decay) in expected.items():
        group = by_name[name]
        assert group["initial_lr"] == peak and group["weight_decay"] == decay, name
        assert group["lr"] == pytest.approx(peak * factor, rel=1e-12), name

    start, end = load_file(tiny_model / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert (end["classifier.weight"] - start["classifier.weight"]).abs().max() < 1e-6
    moved = (end["bert.encoder.layer.0.attention.self.query.weight"]
             - start["bert.encoder.layer.0.attention.self.query.weight"]).abs().max()
    assert moved > 1e-3


OPTIMIZER_CLASSES = {"adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD",
                     "adafactor": "transformers.optimization.Adafactor", "adamw_8bit": "bitsandbytes.optim.AdamW8bit",
                     "paged_adamw_8bit": "bitsandbytes.optim.PagedAdamW8bit", "lion": "bitsandbytes.optim.Lion"}


@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
@pytest.mark.parametrize("name", OPTIMIZER_CLASSES)
def test_optimizer_is_the_class_asked_for(tiny_model, easy_data, hf_home, tmp_path, name):
    from framework.recipe import load_config
    from framework.train import setup

    module, _, class_name = OPTIMIZER_CLASSES[name].rpartition(".")
    expected = getattr(importlib.import_module(module), class_name)
    cfg = load_config(TINY_RECIPE, tiny_args(tiny_model, easy_data, tmp_path / "out")[2:]
                      + [f"optim.name={name}", "optim.lr=3e-4"])
    with fresh_process(hf_home):
        run = setup(cfg)
    optimizer = run.update.optimizer.optimizer  # accelerate's wrapper around the optimizer the loop steps
    assert type(optimizer) is expected
    assert {g["lr"] for g in optimizer.param_groups} == {3e-4}  # no warmup: the schedule starts at the peak
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(run.model.parameters()))


@pytest.mark.multiprocess
def test_local_sgd_syncs_every_k_steps_and_replicas_agree_after(hf_home, tiny_model, easy_data, tmp_path):
    out = tmp_path / "local_sgd"
    cmd = [*launch_cmd(ROOT / "tests" / "scripts" / "local_sgd_probe.py", "cpu_ddp.yaml", launcher=ACCELERATE_COMMAND),
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
    from framework.recipe import load_config
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
    pytest.param(["precision=fp8"], "precision: fp8 needs an fp8-capable GPU", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has a GPU: fp8 meets other checks there")),
    (["train.early_stopping_patience=2"], "train.early_stopping_patience needs eval.metric"),
    (["eval.metric=bleu"], "eval.metric: 'bleu' is not a metric of text_classification"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_invalid_combination_is_refused(capsys, monkeypatch, tiny_model, easy_data, tmp_path, overrides, message):
    from framework.backend import selection
    from framework.cli import main

    monkeypatch.setattr(selection, "has_xla", lambda: True)  # lets the XLA refusals speak without torch_xla
    assert main(tiny_args(tiny_model, easy_data, tmp_path / "out", *overrides)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

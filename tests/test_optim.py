"""Optimizers by name, parameter groups, weight decay, schedules, and Adafactor's relative-step mode."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from framework import optim
from framework.config import OptimConfig, ParamGroupConfig
from framework.errors import UserError
from framework.memory import optimizer_state_bytes
from framework.optim import build_optimizer, build_scheduler, param_groups

# bitsandbytes says once that the paged variant falls back to plain buffers on the CPU.
pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")

# A learning rate each optimizer makes quick progress with on the regression below.
LR = {"adamw": 1e-2, "sgd": 5e-2, "adafactor": 1e-2, "adamw_8bit": 1e-2, "paged_adamw_8bit": 1e-2, "lion": 1e-3}


def mlp(width: int = 64) -> torch.nn.Module:
    """Matrices, biases and a LayerNorm; a width x width matrix of 4096 or more elements gets 8-bit state."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.LayerNorm(width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


def tiny_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=32, num_labels=2))


def fixed_batch():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 16, generator=generator)
    return x, x[:, :1] * 2 - x[:, 1:2]


def train(model, optimizer, scheduler=None, steps: int = 20) -> list:
    x, y = fixed_batch()
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def group_of(optimizer, param) -> dict:
    return next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))


@pytest.mark.parametrize("name", list(LR))
def test_each_optimizer_trains(name):
    model = mlp()
    optimizer = build_optimizer(model, OptimConfig(name=name, lr=LR[name]), "cpu")
    losses = train(model, optimizer)
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_8bit_state_is_under_30_percent_of_adamw():
    sizes = {}
    for name in ("adamw", "adamw_8bit"):
        model = mlp(width=256)
        optimizer = build_optimizer(model, OptimConfig(name=name, lr=1e-3), "cpu")
        train(model, optimizer, steps=1)
        sizes[name] = optimizer_state_bytes(optimizer)
    assert sizes["adamw_8bit"] <= 0.3 * sizes["adamw"], sizes


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_kernel_wherever_torch_has_one(name):
    def kernel(device_type):
        d = build_optimizer(mlp(), OptimConfig(name=name), device_type).defaults
        return d["fused"], d["foreach"]

    assert kernel("cpu") == (True, None)
    assert kernel("cuda") == (True, None)
    assert kernel("xla") == (None, None)  # torch's own default: XLA compiles the step itself


@pytest.mark.parametrize("name, settings", [("adamw", {"weight_decay": 0.01}),
                                            ("sgd", {"momentum": 0.9, "nesterov": True})])
def test_fused_step_equals_foreach(monkeypatch, name, settings):
    """The fused kernel computes the same update as the multi-tensor one, on a small BERT (matrices,
    biases, LayerNorms, groups with and without weight decay), over a few steps."""
    cfg = OptimConfig(name=name, lr=1e-2, **settings)
    inputs = torch.tensor([[2, 7, 9, 3, 11, 5], [2, 4, 8, 3, 0, 0]])

    def trained() -> torch.nn.Module:
        model = tiny_bert().eval()  # no dropout: both runs see the same forward
        optimizer = build_optimizer(model, cfg, "cpu")
        for _ in range(3):
            model(input_ids=inputs, attention_mask=(inputs > 0).long(), labels=torch.tensor([1, 0])).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer.defaults

    fused, fused_defaults = trained()
    monkeypatch.setattr(optim, "_kernel", lambda device_type: {"foreach": True})
    foreach, foreach_defaults = trained()
    assert fused_defaults["fused"] and foreach_defaults["foreach"] and not foreach_defaults["fused"]
    start = dict(tiny_bert().named_parameters())
    for (key, a), b in zip(fused.named_parameters(), foreach.parameters()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{key}: {m}")  # float32 tolerance: atol 1e-5
    assert not torch.equal(dict(fused.named_parameters())["classifier.weight"], start["classifier.weight"])


def test_weight_decay_on_matrices_only():
    model = tiny_bert()
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.05), "cpu")
    for name, p in model.named_parameters():
        assert group_of(optimizer, p)["weight_decay"] == (0.05 if p.ndim >= 2 else 0.0), name
    assert all(g["params"] for g in optimizer.param_groups)


def test_param_groups_get_their_own_lr_and_weight_decay():
    model = tiny_bert()
    cfg = OptimConfig(lr=1e-3, weight_decay=0.01, scheduler="constant", param_groups=[
        ParamGroupConfig(pattern=r"^classifier\.", lr=1e-2),
        ParamGroupConfig(pattern="embeddings", weight_decay=0.0),
        ParamGroupConfig(pattern="classifier|pooler", lr=5e-3, weight_decay=0.1),  # the pooler only: first wins
    ])
    optimizer = build_optimizer(model, cfg, "cpu")
    build_scheduler(optimizer, cfg, total_steps=10)
    named = dict(model.named_parameters())
    assert optimizer.param_groups[0]["lr"] == 1e-3  # the default group first: the loop logs group 0's lr
    assert group_of(optimizer, named["classifier.weight"])["lr"] == 1e-2
    assert group_of(optimizer, named["classifier.weight"])["weight_decay"] == 0.01
    assert group_of(optimizer, named["classifier.bias"])["weight_decay"] == 0.0
    assert group_of(optimizer, named["bert.embeddings.word_embeddings.weight"])["weight_decay"] == 0.0
    assert group_of(optimizer, named["bert.embeddings.word_embeddings.weight"])["lr"] == 1e-3
    assert group_of(optimizer, named["bert.pooler.dense.weight"])["lr"] == 5e-3
    assert group_of(optimizer, named["bert.pooler.dense.weight"])["weight_decay"] == 0.1
    assert group_of(optimizer, named["bert.pooler.dense.bias"])["weight_decay"] == 0.0
    assert group_of(optimizer, named["bert.encoder.layer.0.attention.self.query.weight"])["lr"] == 1e-3
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(named)


def test_pattern_matching_nothing_is_refused_with_examples():
    cfg = OptimConfig(param_groups=[ParamGroupConfig(pattern="classifier"), ParamGroupConfig(pattern="decoder")])
    with pytest.raises(UserError) as err:
        param_groups(tiny_bert(), cfg)
    message = str(err.value)
    assert message.startswith("optim.param_groups[1].pattern: 'decoder' matches no trainable parameter")
    assert "'bert.embeddings.word_embeddings.weight'" in message and "'classifier.bias'" in message


def test_pattern_shadowed_by_an_earlier_group_is_refused():
    cfg = OptimConfig(param_groups=[ParamGroupConfig(pattern="classifier"), ParamGroupConfig(pattern=r"classifier\.w")])
    with pytest.raises(UserError, match=r"optim.param_groups\[1\].pattern: .* earlier group already takes"):
        param_groups(tiny_bert(), cfg)


def test_nesterov_without_momentum_is_refused():
    with pytest.raises(UserError, match="optim.nesterov.*optim.momentum"):
        build_optimizer(mlp(), OptimConfig(name="sgd", momentum=0.0, nesterov=True), "cpu")
    assert build_optimizer(mlp(), OptimConfig(name="sgd", nesterov=True), "cpu").defaults["nesterov"]


def test_bitsandbytes_missing_or_on_xla_is_refused(monkeypatch):
    with pytest.raises(UserError, match="optim.name: adamw_8bit .* XLA"):
        build_optimizer(mlp(), OptimConfig(name="adamw_8bit"), "xla")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", None)
    with pytest.raises(UserError, match="optim.name: lion needs bitsandbytes.*pip install bitsandbytes"):
        build_optimizer(mlp(), OptimConfig(name="lion"), "cpu")


SCHEDULES = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant_with_warmup"]


@pytest.mark.parametrize("warmup", [{"warmup_steps": 3}, {"warmup_ratio": 0.3, "warmup_steps": None}])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedules_warm_up_then_follow_their_shape(schedule, warmup):
    model = mlp()
    cfg = OptimConfig(lr=1e-2, scheduler=schedule, **warmup)
    optimizer = build_optimizer(model, cfg, "cpu")
    scheduler = build_scheduler(optimizer, cfg, total_steps=10)
    lrs = [scheduler.get_last_lr()[0]]
    for _ in range(10):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    # Warmup: 3 steps either way (ceil(0.3 * 10)), rising linearly from zero to the peak.
    assert lrs[:4] == pytest.approx([0.0, 1e-2 / 3, 2e-2 / 3, 1e-2])
    if schedule == "constant_with_warmup":
        assert lrs[4:] == pytest.approx([1e-2] * 7)
    else:
        assert all(a >= b for a, b in zip(lrs[3:], lrs[4:])) and lrs[-1] < 1e-3


def test_constant_schedule_without_warmup_and_refused_with_it():
    cfg = OptimConfig(lr=1e-2, scheduler="constant")
    optimizer = build_optimizer(mlp(), cfg, "cpu")
    scheduler = build_scheduler(optimizer, cfg, total_steps=10)
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [1e-2] * len(optimizer.param_groups)
    with pytest.raises(UserError, match="optim.scheduler: constant has no warmup"):
        build_scheduler(optimizer, OptimConfig(lr=1e-2, scheduler="constant", warmup_ratio=0.1), total_steps=10)


RELATIVE = OptimConfig(name="adafactor", lr=None, relative_step=True, scheduler="constant")


def test_adafactor_relative_step_trains_through_accelerate():
    """As the loop does it: the accelerate-wrapped optimizer, gradients zeroed before the schedule steps."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
    try:
        model = mlp()
        model, optimizer = accelerator.prepare(model, build_optimizer(model, RELATIVE, "cpu"))
        scheduler = accelerator.prepare(build_scheduler(optimizer, RELATIVE, total_steps=20))
        assert optimizer.optimizer.defaults["relative_step"] and optimizer.optimizer.defaults["lr"] is None
        losses = train(model, optimizer, scheduler)
        assert all(math.isfinite(loss) for loss in losses) and losses[-1] < 0.5 * losses[0], losses
        assert scheduler.get_last_lr() == [1e-2] * len(optimizer.param_groups)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_relative_step_step_size_decays_after_ten_thousand_steps():
    optimizer = build_optimizer(mlp(), RELATIVE, "cpu")
    scheduler = build_scheduler(optimizer, RELATIVE, total_steps=40_000)
    assert scheduler.get_last_lr()[0] == 0.0  # before the first step
    optimizer.step()  # no gradients: changes nothing, but the schedule now knows the optimizer stepped
    for _ in range(40_000):
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(1 / math.sqrt(40_000))


def test_relative_step_refuses_a_group_lr():
    cfg = OptimConfig(name="adafactor", lr=None, relative_step=True, scheduler="constant",
                      param_groups=[ParamGroupConfig(pattern="classifier", lr=1e-3)])
    with pytest.raises(UserError, match=r"optim.param_groups\[0\].lr: Adafactor's relative-step mode"):
        build_optimizer(tiny_bert(), cfg, "cpu")


@pytest.mark.parametrize("schedule", ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                                      "constant_with_warmup"])
def test_schedules_equal_transformers_get_scheduler_to_the_last_bit(schedule):
    """The schedules are transformers' formulas (written in framework/optim.py to keep peft's import out of every
    run's start): the same learning rates, bitwise, for every step, warmup, length and parameter group."""
    from transformers import get_scheduler

    def optimizer():
        return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                                {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.3}], lr=0.01)

    for warmup in ([0] if schedule == "constant" else [0, 3]):
        for total in (4, 37, 360):
            a, b = optimizer(), optimizer()
            theirs = get_scheduler(schedule, a, num_warmup_steps=warmup, num_training_steps=total)
            ours = build_scheduler(b, OptimConfig(name="sgd", lr=0.01, scheduler=schedule, warmup_steps=warmup), total)
            for step in range(total + 3):  # and past the end
                assert ours.get_last_lr() == theirs.get_last_lr(), (warmup, total, step)
                for opt, sched in ((a, theirs), (b, ours)):
                    opt.step()
                    sched.step()


@pytest.mark.parametrize("scale, clips", [(1e-3, False), (1e3, True), (float("inf"), True), (float("nan"), True)])
def test_clipping_equals_accelerates_bitwise_and_skips_the_multiply_by_one(monkeypatch, scale, clips):
    """backend.clip_gradients on the CPU: the same gradients, bit for bit, as accelerate's clip_grad_norm_
    (under the limit, over it, non-finite), and no pass over them when the factor is 1."""
    from accelerate import Accelerator

    from framework import backend

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    accelerator = Accelerator(cpu=True)

    def clipped(clip):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * scale
        clip()
        return [p.grad.view(torch.int32).clone() for p in model.parameters()]  # bits: NaN == NaN

    expected = clipped(lambda: accelerator.clip_grad_norm_(model.parameters(), 1.0))
    multiplies = []
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a, _f=torch._foreach_mul_: multiplies.append(1) or _f(*a))
    got = clipped(lambda: backend.clip_gradients(accelerator, model, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert bool(multiplies) == clips
    if clips and math.isfinite(scale):
        assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) == pytest.approx(1.0, rel=1e-5)

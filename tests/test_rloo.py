"""RLOO (task rloo) against TRL 1.16's RLOOTrainer on the same rollouts and rewards: the advantages (the
leave-one-out baseline, the KL penalty in the rewards, the step's normalisation, unscored completions) and the loss
and its gradient (the sequence-level clipped ratio) within 5e-8; through the model, within the two layouts'
rounding (tests/test_task_contract.py: 1 process = 2 =
accumulation, the same completions drawn, and exact resume; tests/test_grpo.py: the sampling and rewards the two
algorithms share)."""

from __future__ import annotations

import pytest
import torch

from test_grpo import COMPLETIONS, MAX_COMPLETION, PROMPTS, llama, ours_layout, trl_inputs

# The rewards of the four completions (two groups of two), per function: the second completion unscored by both (NaN:
# its advantage is 0, and it is left out of its group's baseline, which leaves the first without one: 0 too), the
# third by one.
REWARDS = torch.tensor([[1.0, 0.5], [float("nan"), float("nan")], [float("nan"), 0.3], [2.0, -1.0]])


@pytest.fixture(scope="module")
def trl_rloo(tmp_path_factory):
    """TRL's RLOOTrainer on the tiny Llama (temperature 0.7), and the path of that model."""
    import datasets
    from trl import RLOOConfig, RLOOTrainer

    folder = llama(tmp_path_factory.mktemp("trl_rloo"))
    args = RLOOConfig(output_dir=str(folder / "trl"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=MAX_COMPLETION, temperature=0.7, beta=0.05, epsilon=0.2,
                      epsilon_high=0.28, report_to=[], use_cpu=True, bf16=False, logging_steps=1)
    trainer = RLOOTrainer(model=str(folder), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=datasets.Dataset.from_list([{"prompt": "the cat"}] * 8))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer, folder


def our_rollouts():
    from framework.tasks.online_rl.rollout import rollout_batch

    return rollout_batch(PROMPTS, COMPLETIONS, [True] * len(PROMPTS), 1, "cpu")


@pytest.mark.parametrize("beta,normalize", [(0.0, False), (0.05, False), (0.05, True)])
def test_advantages_equal_trl(trl_rloo, beta, normalize, monkeypatch):
    """TRL's ``_generate_and_score_completions`` given our completions, rewards and log-probabilities (its generation,
    reward and forward calls replaced: the policy's at sampling, then the reference's): its advantages equal ours
    within 5e-8, the KL penalty (beta > 0) from those log-probabilities; the mean KL it logs equals ours."""
    from framework.tasks.rloo import Rloo, RlooConfig

    trainer, _ = trl_rloo
    mask = trl_inputs(torch.zeros(len(PROMPTS)), None, None)["completion_mask"]
    g = torch.Generator().manual_seed(6)
    old, ref = ((-3 + torch.randn(mask.shape, generator=g)) * mask for _ in range(2))
    forwards = iter([old, ref])
    trainer.beta, trainer.normalize_advantages = beta, normalize
    monkeypatch.setattr(trainer, "_generate", lambda prompts: (PROMPTS, COMPLETIONS, ["x"] * len(COMPLETIONS)))
    monkeypatch.setattr(trainer, "_calculate_rewards", lambda inputs, prompts, completions, ids: REWARDS.clone())
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies",
                        lambda *args, **kwargs: (next(forwards), None, None))
    trainer._metrics["train"].clear()
    expected = trainer._generate_and_score_completions([{"prompt": "the cat"}] * len(PROMPTS))["advantages"]

    algorithm = Rloo(RlooConfig(num_generations=2, beta=beta, normalize_advantages=normalize))
    batch = our_rollouts()
    length = batch["input_ids"].shape[1]
    batch.update(old=ours_layout(old, length), ref=ours_layout(ref, length))
    rewards = REWARDS.nansum(dim=1).where(~REWARDS.isnan().all(dim=1), torch.tensor(float("nan")))
    ours, figures = algorithm.advantages(rewards, rewards, [batch], lambda values: values)
    print(f"beta {beta} normalize {normalize}: advantages {ours.tolist()}, max |diff| "
          f"{(ours - expected).abs().max().item():.1e}")
    torch.testing.assert_close(ours, expected, rtol=0, atol=5e-8)
    assert ours[0] == ours[1] == 0 and ours[2] < 0 < ours[3]
    if beta:
        assert figures["kl"] == pytest.approx(trainer._metrics["train"]["kl"][-1], rel=1e-6)
        assert abs(figures["kl"]) > 1e-2


def clipping_old_logps(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probabilities at sampling that make the four sequences' ratios 1.5 (clipped above: a positive advantage),
    0.6 (below: a negative one), 1.1 and 0.9 (not clipped)."""
    return logps - (torch.log(torch.tensor([1.5, 0.6, 1.1, 0.9])) / mask.sum(dim=1))[:, None] * mask


ADVANTAGES = torch.tensor([1.5, -0.7, -1.2, 0.4])


def test_the_loss_and_its_gradient_equal_trl(trl_rloo, monkeypatch):
    """The loss as a function of the completion tokens' log-probabilities: TRL's ``_compute_loss`` given them (its
    forward replaced) and ours given the same values in our layout, with the same advantages and log-probabilities
    at sampling (one sequence clipped above, one below): the losses and their gradients with respect to the
    log-probabilities within 5e-8. A micro-batch's loss divides by its completions, as TRL's mean over its micro-batch
    (the step divides each optimizer step's micro-batches by its share of the generation's completions: the same
    for equal micro-batches)."""
    from framework.tasks.rloo import Rloo, RlooConfig

    trainer, _ = trl_rloo
    inputs = trl_inputs(ADVANTAGES, None, None)
    mask = inputs["completion_mask"]
    logps = (-3 + torch.randn(mask.shape, generator=torch.Generator().manual_seed(4))) * mask
    inputs["old_logps"] = (clipping_old_logps(logps, mask) * mask).sum(dim=1)
    theirs = logps.clone().requires_grad_(True)
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies",
                        lambda *args, **kwargs: (theirs, torch.zeros_like(theirs), None))
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, theirs)

    algorithm = Rloo(RlooConfig(num_generations=2, epsilon=0.2, epsilon_high=0.28))
    batch = our_rollouts()
    length = batch["input_ids"].shape[1]
    mine = logps.clone().requires_grad_(True)
    ours = ours_layout(mine, length)
    batch.update(advantages=ADVANTAGES, old=ours_layout(clipping_old_logps(logps, mask), length))
    loss_sum, sums = algorithm.loss(ours, torch.zeros_like(ours), batch)
    our_loss = loss_sum / algorithm.normaliser((batch["targets"] != -100).float())
    (our_grad,) = torch.autograd.grad(our_loss, mine)
    assert [int(v) for v in sums[:4]] == [1, 1, 2, len(PROMPTS)]  # clipped below, above, either, of 4 sequences
    loss_diff, grad_diff = abs(our_loss.item() - trl_loss.item()), (our_grad - trl_grad * mask).abs().max().item()
    print(f"loss {our_loss.item():.6f} vs TRL {trl_loss.item():.6f} (|diff| {loss_diff:.1e}), "
          f"gradient max |diff| {grad_diff:.1e}")
    assert loss_diff <= 5e-8 and grad_diff <= 5e-8


def test_through_the_model_the_loss_and_gradients_follow_trl(trl_rloo):
    """The same through the tiny Llama: TRL's forward on left-padded prompts, ours on right-padded rows through the
    chunked head (5 tokens at a time). Each token's log-probability differs by up to one fp32 rounding (2.4e-7 of
    values about 3, measured: the two layouts' attention sums round apart), which a sequence's ratio adds up over
    its tokens: measured loss within 1.7e-7 and gradients within 7.2e-7; held to 1e-6."""
    from framework.tasks.completions import target_logprobs
    from framework.tasks.rloo import Rloo, RlooConfig
    from helpers import grads

    from transformers import AutoModelForCausalLM

    trainer, folder = trl_rloo
    inputs = trl_inputs(ADVANTAGES, None, None)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), MAX_COMPLETION)[0]
    old = clipping_old_logps(logps, inputs["completion_mask"])
    inputs["old_logps"] = (old * inputs["completion_mask"]).sum(dim=1)
    trainer.model.zero_grad()
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = grads(trainer.model)

    policy = AutoModelForCausalLM.from_pretrained(folder).train()
    algorithm = Rloo(RlooConfig(num_generations=2, epsilon=0.2, epsilon_high=0.28, temperature=0.7))
    batch = our_rollouts()
    batch.update(advantages=ADVANTAGES, old=ours_layout(old, batch["input_ids"].shape[1]))
    ours = target_logprobs(policy, batch, batch["targets"], 5, True, temperature=0.7)
    loss_sum, _ = algorithm.loss(ours, torch.zeros_like(ours), batch)
    our_loss = loss_sum / algorithm.normaliser((batch["targets"] != -100).float())
    our_loss.backward()
    ours_grads = grads(policy)
    loss_diff = abs(our_loss.item() - trl_loss.item())
    grad_diff = max((ours_grads[name] - value).abs().max().item() for name, value in trl_grads.items())
    print(f"through the model: loss |diff| {loss_diff:.1e}, gradients max |diff| {grad_diff:.1e}")
    assert ours_grads.keys() == trl_grads.keys()
    assert loss_diff <= 1e-6 and grad_diff <= 1e-6

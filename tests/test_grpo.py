"""Online RL (task grpo): the loss and gradients equal TRL 1.16's GRPOTrainer for every loss type both have; the
log-probabilities recorded before the updates equal the training forward's; sampling is keyed by row (a row
draws the same tokens alone or in any batch) and samples the distribution it claims; the built-in rewards; a
tiny model learns; every way a reward function can be wrong ends with exit 2 and one sentence naming it
(tests/test_task_contract.py: 1 process = 2 = accumulation, with the same completions drawn, and exact resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import (GRPO_REWARDS, ROOT, TINY_GRPO, assert_same_weights, finish, free_port, grpo_args, machines,
                     read_metrics, summary)
from in_process import fresh_process, run_captured, run_main

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "yes", "no"]
# Rollouts for the comparison with TRL: prompts of uneven lengths, completions ending at EOS or cut at the
# longest completion (6 tokens), so that padding is on both sides in TRL's layout and targets differ per row.
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [6, 14], [7, 8, 9, 10]]
COMPLETIONS = [[9, 10, 0], [11, 12, 13, 14, 15, 4], [4, 0], [12, 13, 14, 15, 5, 6]]  # 0: <eos>
MAX_COMPLETION = 6


def llama(tmp_path: Path) -> Path:
    """A tiny Llama (RoPE: TRL's left-padded prompts and our right-padded rows give the same logits) with a
    word tokenizer, saved: TRL loads its reference from the path."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from framework.testing import save_word_tokenizer

    folder = save_word_tokenizer(tmp_path / "llama", WORDS)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, eos_token_id=0, pad_token_id=1, bos_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def trl_inputs(advantage: torch.Tensor, old: torch.Tensor, ref: torch.Tensor) -> dict:
    """The rollouts in TRL's layout: prompts left-padded, completions right-padded."""
    prompt_len = max(len(p) for p in PROMPTS)
    prompt_ids = torch.full((len(PROMPTS), prompt_len), 1)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.full((len(PROMPTS), MAX_COMPLETION), 1)
    completion_mask = torch.zeros_like(completion_ids)
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        prompt_ids[i, prompt_len - len(p):], prompt_mask[i, prompt_len - len(p):] = torch.tensor(p), 1
        completion_ids[i, :len(c)], completion_mask[i, :len(c)] = torch.tensor(c), 1
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantage, "old_per_token_logps": old,
            "ref_per_token_logps": ref, "num_items_in_batch": completion_mask.sum()}


def ours_layout(values: torch.Tensor, length: int) -> torch.Tensor:
    """Per-completion-token values in TRL's layout (rows x completion) moved to ours (rows x sequence: completion
    token t of row i is the target of position len(prompt i) - 1 + t)."""
    out = torch.zeros(len(PROMPTS), length)
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        out[i, len(p) - 1:len(p) - 1 + len(c)] = values[i, :len(c)]
    return out


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """TRL's GRPOTrainer on the tiny Llama (temperature 0.7), and the path of that model."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    folder = llama(tmp_path_factory.mktemp("trl"))
    args = GRPOConfig(output_dir=str(folder / "trl"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=MAX_COMPLETION, temperature=0.7, beta=0.04, epsilon=0.2,
                      epsilon_high=0.28, report_to=[], use_cpu=True, bf16=False, logging_steps=1)
    trainer = GRPOTrainer(model=str(folder), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=datasets.Dataset.from_list([{"prompt": "the cat"}] * 8))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer, folder


# The other half of a generation that feeds two optimizer steps: its completion tokens.
OTHER_SHARE_TOKENS = 13


@pytest.mark.parametrize("loss,beta,steps,level", [
    ("dapo", 0.0, 1, "token"), ("grpo", 0.0, 1, "token"), ("dr_grpo", 0.0, 1, "token"), ("bnpo", 0.0, 1, "token"),
    ("dapo", 0.04, 1, "token"), ("grpo", 0.04, 1, "token"), ("dapo", 0.0, 2, "token"), ("grpo", 0.0, 2, "token"),
    ("grpo", 0.04, 1, "sequence"), ("dapo", 0.0, 2, "sequence")])  # GSPO: one ratio per completion
def test_loss_and_gradients_equal_trl(trl_trainer, loss, beta, steps, level):
    """For the same rollouts, advantages, old log-probabilities (perturbed, so that some ratios are clipped on
    both sides) and reference log-probabilities, our loss and its gradients equal TRL's ``_compute_loss`` within
    1e-5 (fp32; our log-probabilities through the chunked head, 5 tokens at a time). ``steps`` 2: the rollouts are
    one optimizer step's share of a generation feeding two (``grpo.generation_steps``; TRL's
    ``steps_per_generation``), whose other share has 13 completion tokens: each step divides by its share of the
    generation's normaliser, as the step does. ``level`` sequence: GSPO's ratio, one per completion (TRL's
    ``importance_sampling_level``)."""
    from transformers import AutoModelForCausalLM

    from framework.tasks.completions import target_logprobs
    from framework.tasks.grpo import Grpo, GrpoConfig
    from framework.tasks.online_rl.rollout import rollout_batch
    from helpers import grads

    trainer, folder = trl_trainer
    trainer.loss_type, trainer.beta, trainer.args.steps_per_generation = loss, beta, steps
    trainer.importance_sampling_level = level
    g = torch.Generator().manual_seed(3)
    advantage = torch.randn(len(PROMPTS), generator=g)
    inputs = trl_inputs(advantage, None, None)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), MAX_COMPLETION)[0]
    # GSPO's ratio is the row's mean log-ratio: rows apart by 0.3, so that some rows are clipped and others not.
    old = logps + 0.3 * torch.randn(logps.shape if level == "token" else (len(PROMPTS), 1), generator=g)
    ref = logps + 0.5 * torch.randn(logps.shape, generator=g)
    inputs = trl_inputs(advantage, old, ref if beta else None)
    if steps > 1:  # the generation's completion tokens: this share's and the other's
        inputs["num_items_in_batch"] = inputs["num_items_in_batch"] + OTHER_SHARE_TOKENS
    trainer.model.zero_grad()
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = grads(trainer.model)

    policy = AutoModelForCausalLM.from_pretrained(folder).train()
    algorithm = Grpo(GrpoConfig(loss=loss, beta=beta, epsilon=0.2, epsilon_high=0.28, temperature=0.7,
                                max_completion_length=MAX_COMPLETION, generation_steps=steps,
                                importance_sampling_level=level))
    batch = rollout_batch(PROMPTS, COMPLETIONS, [True] * len(PROMPTS), 1, "cpu")
    length = batch["input_ids"].shape[1]
    batch.update(advantages=advantage, old=ours_layout(old, length), **({"ref": ours_layout(ref, length)} if beta else {}))
    ours = target_logprobs(policy, batch, batch["targets"], 5, True, temperature=0.7)  # the chunked head, 5 at a time
    loss_sum, sums = algorithm.loss(ours, torch.zeros_like(ours), batch)
    mask = (batch["targets"] != -100).float()
    generation = algorithm.normaliser(mask)  # a share's, times the shares (grpo: equal shares of completions)
    generation = generation + OTHER_SHARE_TOKENS if loss == "dapo" and steps > 1 else generation * steps
    our_loss = loss_sum / (generation / steps)  # each optimizer step divides by its share of the generation's
    our_loss.backward()
    assert 0 < int(sums[2]) < int(mask.sum()) == int(sums[4])  # a batch that clips some tokens and not others

    loss_diff = abs(our_loss.item() - trl_loss.item())
    ours_grads = {name.replace("base_model.model.", ""): value for name, value in grads(policy).items()}
    grad_diff = max((ours_grads[name] - value).abs().max().item() for name, value in trl_grads.items())
    scale = max(value.abs().max().item() for value in trl_grads.values())
    print(f"{loss} {level} beta={beta} generation steps {steps}: loss {our_loss.item():.6f} vs TRL {trl_loss.item():.6f} (|diff| {loss_diff:.1e}), "
          f"gradients max |diff| {grad_diff:.1e} (largest gradient {scale:.2e})")
    assert ours_grads.keys() == trl_grads.keys()
    assert loss_diff <= 1e-5 and grad_diff <= 1e-5


@pytest.mark.parametrize("chunk", [5, 0])
def test_entropy_equals_trl(trl_trainer, chunk):
    """The logged ``entropy``'s per-token values: on the same rollouts, each completion token's entropy of the
    logits over the temperature equals TRL's ``_get_per_token_logps_and_entropies`` within 1e-5, through the chunked
    head (5 tokens at a time) and through the model's own logits (chunk 0)."""
    from transformers import AutoModelForCausalLM

    from framework.tasks.completions import target_logprobs
    from framework.tasks.online_rl.rollout import rollout_batch

    trainer, folder = trl_trainer
    inputs = trl_inputs(torch.zeros(len(PROMPTS)), None, None)
    with torch.no_grad():
        _, trl_entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), MAX_COMPLETION, compute_entropy=True)
    batch = rollout_batch(PROMPTS, COMPLETIONS, [True] * len(PROMPTS), 1, "cpu")
    with torch.no_grad():
        _, ours = target_logprobs(AutoModelForCausalLM.from_pretrained(folder).eval(), batch, batch["targets"],
                                  chunk or None, True, temperature=0.7, with_entropy=True)
    expected = ours_layout(trl_entropy * inputs["completion_mask"], batch["input_ids"].shape[1])
    print(f"chunk {chunk}: entropy max |diff| {(ours - expected).abs().max().item():.1e}, mean over tokens "
          f"{(ours.sum() / inputs['completion_mask'].sum()).item():.4f}")
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_recorded_log_probabilities_equal_the_training_forward(hf_home, pair_tokenizer, pair_data, tmp_path,
                                                               monkeypatch):
    """With two iterations the step records every micro-batch's log-probabilities (no gradients) before updating;
    the first update's forward on the same micro-batch gives the same values (fp32, within 1e-5), so the first
    update's ratio is 1 to that precision."""
    from framework import train
    from framework.recipe import load_config

    cfg = load_config(TINY_GRPO, grpo_args(pair_tokenizer, pair_data, tmp_path / "out", "grpo.iterations=2",
                                           "train.gradient_accumulation_steps=2")[2:])
    with fresh_process(hf_home):
        run = train.setup(cfg)
        calls = []
        forward = run.task.logprobs

        def recording(model, batch, with_entropy=False):
            out = forward(model, batch, with_entropy)
            logps = out[0] if with_entropy else out
            calls.append((torch.is_grad_enabled(), logps.detach().clone(), batch["targets"] != -100))
            return out

        monkeypatch.setattr(run.task, "logprobs", recording)
        batches = iter(run.data.train_dl)
        run.model.train()
        run.train_step(run.context, [next(batches), next(batches)])
    assert [grad for grad, _, _ in calls] == [False, False, True, True, True, True]  # recorded, then 2 x 2 updates
    worst = 0.0
    for (_, recorded, mask), (_, trained, _) in zip(calls[:2], calls[2:4]):
        assert mask.sum() > 0
        worst = max(worst, (recorded - trained)[mask].abs().max().item())
    print(f"recorded vs training forward log-probabilities: max |diff| {worst:.1e}")
    assert worst <= 1e-5


def test_each_optimizer_step_of_a_generation_divides_by_its_share(hf_home, pair_tokenizer, pair_data, tmp_path,
                                                                 monkeypatch):
    """grpo.generation_steps=2 over 4 micro-batches (dapo): the first optimizer step's gradient, as the optimizer
    receives it, is the gradient of its 2 micro-batches' summed token losses over half the generation's completion
    tokens (TRL's normaliser), computed here by hand on a copy of the starting model, within 1e-6."""
    import copy

    from framework import train
    from framework.recipe import load_config
    from framework.tasks.online_rl.policy_loss import token_level

    cfg = load_config(TINY_GRPO, grpo_args(pair_tokenizer, pair_data, tmp_path / "out", "grpo.generation_steps=2",
                                           "train.gradient_accumulation_steps=4", "train.batch_size=2",
                                           "train.max_grad_norm=null")[2:])
    with fresh_process(hf_home):
        run = train.setup(cfg)
        model = run.accelerator.unwrap_model(run.model)
        start = copy.deepcopy(model)
        recorded, forward = [], run.task.logprobs

        def recording(model, batch, with_entropy=False):
            if not torch.is_grad_enabled():  # the old log-probabilities' pass: each micro-batch once, in order
                recorded.append(batch)
            return forward(model, batch, with_entropy)

        received, optimizer_step = [], run.update.optimizer.step

        def receiving(*args, **kwargs):  # called at every micro-batch; it steps where accumulation ends
            if not received and run.accelerator.sync_gradients:
                received.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            return optimizer_step(*args, **kwargs)

        monkeypatch.setattr(run.task, "logprobs", recording)
        monkeypatch.setattr(run.update.optimizer, "step", receiving)
        batches = iter(run.data.train_dl)
        run.model.train()
        run.train_step(run.context, [next(batches) for _ in range(4)])
        assert len(recorded) == 4
        tokens = sum(int((r["targets"] != -100).sum()) for r in recorded)
        loss = 0
        for r in recorded[:2]:
            mask = (r["targets"] != -100).float()
            per_token, _, _ = token_level(forward(start, r), r["old"], None, r["advantages"], 0.2, 0.2, 0.0)
            loss = loss + (per_token * mask).sum()
        (loss / (tokens / 2)).backward()
    expected = {n: p.grad for n, p in start.named_parameters() if p.grad is not None}
    assert expected.keys() == received[0].keys()
    worst = max((received[0][n] - expected[n]).abs().max().item() for n in expected)
    largest = max(g.abs().max().item() for g in expected.values())
    print(f"first optimizer step's gradient: max |diff| {worst:.1e} (largest {largest:.2e}, {tokens} tokens)")
    assert worst <= 1e-6 and largest > 1e-3


# ---------------------------------------------------------------- sampling


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_layer=2, n_head=2, n_embd=32, n_positions=64, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)).eval()


def test_a_row_draws_the_same_tokens_alone_or_in_any_batch():
    """Row r's tokens depend on its seed only: alone, or third in a batch of other prompts (longer ones: its
    left padding changes), it draws the same completion; another seed draws another; the model's generation
    defaults (a repetition penalty, suppressed tokens, its own sampling) change nothing."""
    from framework.tasks.online_rl.sampling import Sampling, generate, row_seed

    model = tiny_gpt2()
    settings = Sampling(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12, stop_ids=[0], pad_id=1)
    prompt, seed = [5, 6, 7], row_seed(42, 0, 17, 3)
    alone = generate(model, [prompt], [seed], settings)[0]
    batch = generate(model, [[9, 10, 11, 12, 13], [3, 4], prompt, prompt],
                     [row_seed(42, 0, 1, 0), row_seed(42, 0, 2, 0), seed, row_seed(42, 0, 17, 4)], settings)
    assert batch[2] == alone and len(alone) >= 6
    assert batch[3] != alone
    # The model's own generation defaults are set aside: they would change the distribution sampled from.
    model.generation_config.update(repetition_penalty=10.0, do_sample=True, temperature=5.0, suppress_tokens=alone[:1])
    assert generate(model, [prompt], [seed], settings)[0] == alone


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.8)])
def test_keyed_sampling_draws_the_warped_distribution(top_k, top_p):
    """20,000 rows, each its own generator, one draw each from fixed logits at temperature 0.7: every token's
    frequency is within 4 standard errors of the probability transformers' warpers give it (top-k, top-p
    removed tokens never drawn)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from framework.tasks.online_rl.sampling import KeyedSampling, Sampling, row_seed

    rows = 20_000
    logits = torch.tensor([[2.0, 1.5, 0.5, 0.0, -1.0, -3.0]]).expand(rows, -1)
    settings = Sampling(temperature=0.7, top_k=top_k, top_p=top_p, max_new_tokens=1, stop_ids=[0], pad_id=0)
    noised = KeyedSampling(settings, [row_seed(7, i) for i in range(rows)], torch.device("cpu"))(None, logits)
    counts = torch.bincount(noised.argmax(dim=1), minlength=6).double() / rows
    warped = TemperatureLogitsWarper(0.7)(None, logits[:1].clone())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)
    expected = torch.softmax(warped, dim=-1)[0].double()
    assert torch.all(counts[expected == 0] == 0)
    error = (expected * (1 - expected) / rows).sqrt()
    assert torch.all((counts - expected).abs() <= 4 * error + 1e-12), (counts, expected)


# ---------------------------------------------------------------- rewards


def test_built_in_rewards():
    from framework.errors import UserError
    from framework.tasks.online_rl import rewards

    prompts = ["q"] * 4
    completions = [" fresh ", "The sum is 1,234.", "12.50", [{"role": "assistant", "content": "fresh"}]]
    columns = {"answer": ["fresh", "1234", 12.5, "fresh"]}
    [exact, numeric, regex] = rewards.load(["exact_match", "numeric", "regex"], "answer", r"[a-z ]+", "grpo.reward_functions")
    ids = [[1]] * 4
    assert exact(prompts, completions, ids, columns).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert regex(prompts, completions, ids, columns).tolist() == [1.0, 0.0, 0.0, 1.0]
    numbers = {"answer": ["1,234", "1234", 12.5, "-3"]}
    assert numeric(prompts, completions[:3] + ["it is -3.0"], ids, numbers).tolist() == [0.0, 1.0, 1.0, 1.0]
    with pytest.raises(UserError, match="numeric: completion 0 .* has the answer 'fresh' in column 'answer', which "
                                        "is not a number"):
        numeric(prompts, completions, ids, columns)
    only = rewards.load([f"{GRPO_REWARDS}:only_rotten"], None, None, "grpo.reward_functions")[0]
    scored = only(prompts, ["rotten", "rotten", "x", "rotten"], ids, {"chosen": ["fresh", "rotten", "rotten", " rotten"]})
    assert scored[0] != scored[0] and scored[1:].tolist() == [1.0, 0.0, 1.0]  # None: NaN, left out of means


BAD = {  # reward function -> what the one error line says
    "tests/no_such_file.py:f": "'tests/no_such_file.py:f': tests/no_such_file.py does not exist",
    f"{GRPO_REWARDS}:nothing": "has no function named 'nothing'",
    "no_such_package.rewards:f": "importing no_such_package.rewards failed (ModuleNotFoundError",
    f"{GRPO_REWARDS}:no_kwargs": "does not take TRL's arguments (prompts, completions, completion_ids, **columns",
    f"{GRPO_REWARDS}:too_few": "returned 15 values for 16 completions",
    f"{GRPO_REWARDS}:not_a_number": "returned 'high' for completion 3 (prompt 'review : ",
    f"{GRPO_REWARDS}:raises": "raised ZeroDivisionError: float division by zero on completion ",
}


@pytest.mark.parametrize("function", list(BAD))
def test_a_bad_reward_function_exits_2_naming_it(hf_home, pair_tokenizer, pair_data, tmp_path, function):
    out = tmp_path / "out"
    proc = run_captured(grpo_args(pair_tokenizer, pair_data, out, f"grpo.reward_functions=[{function}]"), hf_home)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"grpo.reward_functions: '{function}'" in errors[0] and BAD[function] in errors[0], errors[0]
    assert not (out / "summary.json").exists()


@pytest.mark.multiprocess
def test_a_reward_function_failing_on_one_machine_stops_the_other(hf_home, pair_tokenizer, pair_data, tmp_path):
    """Two machines' launchers of one process each: the reward fails on the second only. Both end with its message
    (exit 2 from each process), no traceback. Before, the first machine's process died in the step's gather with
    a traceback of gloo's lost connection and no word of why (NCCL would have waited out its timeout): no
    launcher sees another machine's process fail."""
    out = tmp_path / "out"
    function = f"{GRPO_REWARDS}:fails_on_the_second_process"
    args = grpo_args(pair_tokenizer, pair_data, out, f"grpo.reward_functions=[{function}]", "train.batch_size=2")
    results = finish(machines(args, 2, hf_home, free_port()), timeout=240)
    for status, output, _ in results:
        assert status != 0 and "exitcode  : 2" in output, output[-3000:]
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"grpo.reward_functions: '{function}'" in errors[0], output[-3000:]
        assert "no answer key on this process" in errors[0] and str(ROOT / "framework") not in output
    assert not (out / "summary.json").exists()


def chat_prompts(pair_data: Path, tmp_path: Path) -> Path:
    """The pairs' prompts as one-message conversations, with their answers."""
    import json

    rows = [{"prompt": [{"role": "user", "content": row["prompt"]}], "chosen": row["chosen"]}
            for row in map(json.loads, pair_data.read_text().splitlines())]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


# Streamed prompts: the first 40 training rows (one epoch at 4 prompts a step on one process or 2 on each of two),
# each process reading its own share in its own shuffled order.
STREAM = ["data.streaming=true", "data.max_train_samples=40", "data.shuffle_buffer=16", "train.max_steps=10"]


def recorded_draws(out: Path) -> dict:
    """Each prompt's completions (sorted token ids) as ``grpo_rewards.recorded`` wrote them, all processes."""
    import json

    draws: dict = {}
    for path in out.parent.glob(out.name + ".*"):
        for line in path.read_text().splitlines():
            prompt, _, ids = json.loads(line)
            draws.setdefault(prompt, []).append(ids)
    return {prompt: sorted(ids) for prompt, ids in draws.items()}


@pytest.mark.multiprocess
def test_streamed_prompts_draw_by_row_not_by_process(cli, hf_home, pair_tokenizer, pair_data, tmp_path, monkeypatch):
    """data.streaming: the rows' other columns reach the reward functions, and each row's completions are keyed by
    its content, not by its place in a process's share: with weights that do not move (an SGD step of 1e-30 is
    below an fp32 weight's rounding), one process and two, each reading its share of the stream in its own
    shuffled order, draw the same completions of every prompt over the epoch."""
    draws = {}
    for name, launch, batch in (("one", None, 4), ("two", "cpu_ddp.yaml", 2)):
        record = tmp_path / f"{name}.jsonl"
        monkeypatch.setenv("GRPO_RECORD", str(record))
        args = grpo_args(pair_tokenizer, pair_data, tmp_path / name, *STREAM, f"train.batch_size={batch}",
                         "optim.name=sgd", "optim.lr=1e-30", f"grpo.reward_functions=[{GRPO_REWARDS}:recorded]")
        if launch is None:
            assert run_main(args, hf_home) == 0
        else:
            cli(args, launch=launch)
        draws[name] = recorded_draws(record)
    # The held-out prompts' greedy completions are recorded too (as often as each process evaluates them).
    trained = {name: {p: ids for p, ids in d.items() if len(ids) == 4} for name, d in draws.items()}
    assert len(trained["one"]) == 40 and trained["one"] == trained["two"]
    assert len({tuple(map(tuple, ids)) for ids in trained["one"].values()}) > 30  # the prompts draw apart


def test_a_killed_streamed_run_resumes_bitwise(hf_home, pair_tokenizer, pair_data, tmp_path):
    """The stream's position and buffer (conversation prompts and strings in it, kept as JSON in the checkpoint),
    and the sampling keyed by row: killed after step 5's checkpoint, the same command ends with the uninterrupted
    run's weights and logged losses, to the last bit."""
    from helpers import assert_bitwise_equal_models, crash_then_resume, losses_by_step

    data = chat_prompts(pair_data, tmp_path)
    args = [*STREAM, "checkpoint.every_steps=5", "train.log_every=2", "data.chat_template=chatml",
            "data.max_length=32"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run_main(grpo_args(pair_tokenizer, data, whole, *args), hf_home) == 0
    proc = crash_then_resume(hf_home, grpo_args(pair_tokenizer, data, resumed, *args), kill_at_micro=8)
    assert "resuming from" in proc.stdout and "step_5" in proc.stdout
    assert_bitwise_equal_models(whole, resumed)
    assert losses_by_step(resumed) == losses_by_step(whole)
    assert [r["reward"] for r in read_metrics(resumed) if "reward" in r] == \
        [r["reward"] for r in read_metrics(whole) if "reward" in r]


def lora_prompts(tmp_path: Path) -> Path:
    """Prompts of four words from the word corpus (what the ``pretrained_lm`` fixture was trained on)."""
    import json

    from helpers import documents

    rows = [{"prompt": " ".join(d["text"].split()[:4])} for d in documents(40, seed=5)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def lora_args(model: Path, data: Path, out: Path, *extra: str) -> list:
    """GRPO with LoRA (r 4) on the pretrained tiny GPT-2, rewarded by the completion's characters, with a KL
    penalty against the reference (the adapter off)."""
    return ["--config", str(TINY_GRPO), "model.config=null", f"model.name_or_path={model}", f"data.train_file={data}",
            f"output_dir={out}", f"grpo.reward_functions=[{GRPO_REWARDS}:characters]", "grpo.beta=0.5",
            "peft.r=4", "peft.alpha=8", "train.max_steps=3", "optim.lr=5e-2", *extra]


@pytest.mark.multiprocess
def test_lora_with_its_reference_under_fsdp2_trains_what_one_process_does(cli, hf_home, pretrained_lm, tmp_path):
    """FSDP2 on 2 CPU processes (fsdp.yaml), each sampling its own prompt's 2 completions, up to 16 tokens or
    <eos>: the same completions as one process (the step's rewards and lengths equal), the same KL against the
    adapter-off reference, the same greedy eval, and the adapter within the sharded strategies' bounds
    (tests/test_task_contract.py). Each block gathers its weights in its forward, a collective, so the processes
    generate in lockstep until both have stopped (transformers' ``synced_gpus``): without it this run crashed at
    step 4 (gloo: "a distributed collective mismatch"), where one process's completions ended before the other's."""
    from safetensors.torch import load_file

    data = lora_prompts(tmp_path)
    extra = ["grpo.num_generations=2", "grpo.max_completion_length=16", "train.max_steps=4", "eval.every_steps=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_main(lora_args(pretrained_lm, data, one, "train.batch_size=2", *extra), hf_home) == 0
    proc = cli(lora_args(pretrained_lm, data, two, "train.batch_size=1", *extra), launch="fsdp.yaml", timeout=300,
               launch_args=["--num_processes", "2", "--main_process_port", str(free_port())])
    assert "strategy: fsdp" in proc.stdout and summary(two)["num_processes"] == 2
    a, b = ([r for r in read_metrics(out) if "loss" in r] for out in (two, one))
    for key in ("reward", "completions/mean_length", "completions/min_length", "completions/max_length"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert any(r["completions/min_length"] < r["completions/max_length"] for r in a)  # the rows stop apart
    torch.testing.assert_close(torch.tensor([r["kl"] for r in a]), torch.tensor([r["kl"] for r in b]),
                               rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in a]), torch.tensor([r["loss"] for r in b]),
                               rtol=1e-5, atol=1e-6)
    assert summary(two)["eval"] == pytest.approx(summary(one)["eval"], rel=1e-6)  # greedy, on both processes' prompts
    wa, wb = (load_file(out / "model" / "adapter_model.safetensors") for out in (two, one))
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.multiprocess
def test_a_frozen_copy_reference_under_fsdp_is_refused_by_key(cli, pair_tokenizer, pair_data, tmp_path):
    """grpo.beta > 0 without an adapter needs a frozen copy of the starting weights, which FSDP loads on the first
    process only: refused before training with grpo.beta's key, each process exiting 2."""
    out = tmp_path / "out"
    proc = cli(grpo_args(pair_tokenizer, pair_data, out, "grpo.beta=0.1"), launch="fsdp.yaml", check=False,
               timeout=300, launch_args=["--num_processes", "2", "--main_process_port", str(free_port())])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr and errors, proc.stderr[-2000:]
    # Refused with the recipe's checks, before anything loads: on each process.
    assert proc.stderr.count("grpo.beta: the reference model, a frozen copy, is not built under FSDP or DeepSpeed") \
        == len(errors) == 2
    assert str(ROOT / "framework") not in proc.stderr and not (out / "summary.json").exists()


# ---------------------------------------------------------------- runs


@pytest.mark.multiprocess
def test_one_generation_feeds_several_optimizer_steps_whatever_the_split(cli, hf_home, pair_tokenizer, pair_data,
                                                                         tmp_path):
    """grpo.generation_steps=2: each step's 8 prompts x 4 completions are generated at once, then learnt from in
    two optimizer steps of half the micro-batches each (the second's ratio against the log-probabilities at
    sampling). 1 process with micro-batches of 4 prompts, 1 with micro-batches of 2, and 2 processes draw the same
    completions and end with the same weights and losses (the contract's bounds); the schedule advances twice a
    step, and the second step's ratios move off 1 (some clipped); the first step draws what a run updating once
    per generation draws (the same model samples), and its weights then move apart from that run's."""
    common = ["train.max_steps=3", "optim.name=sgd", "optim.lr=0.5", "optim.scheduler=linear",
              "train.max_grad_norm=null", "grpo.generation_steps=2"]
    runs = {name: tmp_path / name for name in ("four", "two_each", "processes", "once")}
    assert run_main(grpo_args(pair_tokenizer, pair_data, runs["four"], *common, "train.batch_size=4",
                              "train.gradient_accumulation_steps=2"), hf_home) == 0
    assert run_main(grpo_args(pair_tokenizer, pair_data, runs["two_each"], *common, "train.batch_size=2",
                              "train.gradient_accumulation_steps=4"), hf_home) == 0
    cli(grpo_args(pair_tokenizer, pair_data, runs["processes"], *common, "train.batch_size=2",
                  "train.gradient_accumulation_steps=2"), launch="cpu_ddp.yaml")
    assert run_main(grpo_args(pair_tokenizer, pair_data, runs["once"], *common[:-1], "train.batch_size=8"),
                    hf_home) == 0
    logged = {name: [r for r in read_metrics(out) if "loss" in r] for name, out in runs.items()}
    print({n: [round(r["clip_ratio/region_mean"], 4) for r in v] for n, v in logged.items()})
    for name in ("two_each", "processes"):
        for key in ("reward", "reward_std", "completions/mean_length", "completions/max_length"):
            # The processes gather the rows in another order: the sums round apart.
            assert [r[key] for r in logged[name]] == pytest.approx([r[key] for r in logged["four"]], rel=1e-6), \
                (name, key)
        torch.testing.assert_close(torch.tensor([r["loss"] for r in logged[name]]),
                                   torch.tensor([r["loss"] for r in logged["four"]]), rtol=1e-5, atol=1e-6)
        assert_same_weights(runs[name], runs["four"], 1e-5, 1e-6)
    assert [r["lr"] for r in logged["four"]] == pytest.approx([0.5 * (1 - 2 * k / 6) for k in (1, 2, 3)], abs=1e-12)
    assert logged["once"][0]["reward"] == logged["four"][0]["reward"]
    # The second step of each generation learns from completions an update old: its ratios move, and some are
    # clipped (measured: 3% to 20% of the tokens); updating once per generation, the ratio is exactly 1.
    assert all(r["clip_ratio/region_mean"] > 0 for r in logged["four"])
    assert all(r["clip_ratio/region_mean"] == 0 for r in logged["once"])
    assert [r["lr"] for r in logged["once"]] == pytest.approx([0.5 * (1 - k / 3) for k in (1, 2, 3)], abs=1e-12)
    with pytest.raises(AssertionError):
        assert_same_weights(runs["once"], runs["four"], 1e-5, 1e-6)


def test_generation_steps_must_divide_the_accumulation(hf_home, pair_tokenizer, pair_data, tmp_path):
    proc = run_captured(grpo_args(pair_tokenizer, pair_data, tmp_path / "out", "grpo.generation_steps=2"), hf_home)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "grpo.generation_steps: 2 optimizer steps cannot share the generation's 1 micro-batches" in proc.stderr


def test_a_generation_larger_than_the_device_is_refused_by_key(hf_home, pair_tokenizer, pair_data, tmp_path,
                                                               monkeypatch):
    """The step's KV cache (16 completions x 27 tokens here) and the weights alone above the device's memory (a
    device of 200 KiB): exit 2 before anything trains, one line naming the key of the completions' length and the
    figures; with the machine's own memory the same recipe plans its run."""
    from framework import backend

    args = grpo_args(pair_tokenizer, pair_data, tmp_path / "out", "--dry-run")
    assert run_captured(args, hf_home).returncode == 0
    monkeypatch.setattr(backend, "total_memory_bytes", lambda accelerator: 200 * 1024)
    proc = run_captured(args, hf_home)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: grpo.max_completion_length: the generation's KV cache needs 0.2 MiB per device (16 "
                           "sequences x 27 tokens of prompt and completion) beside the weights' 0.1 MiB")
    assert "more than the device's 0.2 MiB; lower grpo.max_completion_length, grpo.num_generations or " \
           "train.batch_size" in line


@pytest.mark.parametrize("seed", [1, 2])
def test_a_tiny_model_learns_to_answer(hf_home, pair_tokenizer, pair_data, tmp_path, seed):
    """The prompts end with a sentiment word; the reward is 1 for answering its verdict ('fresh' or 'rotten': one
    token of 43) and 0 otherwise. A random tiny GPT-2 starts near 1/43; in 30 steps of 64 completions its mean
    reward over the last 10 steps is at least 0.25 above the first 5 steps' (measured: 0.037 -> 0.463 with seed 1,
    0.037 -> 0.378 with seed 2: it learns to answer with a verdict, then which one, until its groups agree)."""
    out = tmp_path / "out"
    args = grpo_args(pair_tokenizer, pair_data, out, f"seed={seed}", "grpo.reward_functions=[exact_match]",
                     "grpo.max_completion_length=1", "grpo.num_generations=8", "train.batch_size=8",
                     "train.max_steps=30")
    assert run_main(args, hf_home) == 0
    rewards = [r["reward"] for r in read_metrics(out) if "reward" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    print(f"seed {seed}: mean reward {first:.3f} (steps 1-5) -> {last:.3f} (steps 21-30)")
    assert len(rewards) == 30 and first < 0.15 and last - first >= 0.25


def test_conversations_reference_and_every_option(hf_home, pair_tokenizer, pair_data, tmp_path, capsys):
    """Conversation prompts through chatml, three weighted rewards (one skipping rows with None), the KL penalty
    against a frozen reference (counted by the memory plan), two iterations, the grpo loss with GSPO's sequence-level
    ratio, step-wide reward scaling, truncated completions masked: it trains, logs TRL's figures and sampled
    completions, evaluates greedily and samples."""
    import html

    data = chat_prompts(pair_data, tmp_path)
    out = tmp_path / "out"
    args = grpo_args(pair_tokenizer, data, out, "data.chat_template=chatml", "data.max_length=32",
                     f"grpo.reward_functions=[exact_match,{GRPO_REWARDS}:characters,{GRPO_REWARDS}:only_rotten]",
                     "grpo.reward_weights=[1.0,1.0,0.5]", "grpo.beta=0.1", "grpo.iterations=2", "grpo.loss=grpo",
                     "grpo.importance_sampling_level=sequence",
                     "grpo.scale_rewards=batch", "grpo.mask_truncated_completions=true", "grpo.max_completion_length=8",
                     "grpo.temperature=0.9", "grpo.top_k=20", "train.max_steps=3", "optim.scheduler=linear",
                     "report.enabled=true")
    assert run_main(args, hf_home) == 0
    assert "frozen models (the task's reference, never trained)" in capsys.readouterr().out
    records = [r for r in read_metrics(out) if "loss" in r]
    assert len(records) == 3
    for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/exact_match/mean", "rewards/only_rotten/mean",
                "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean", "kl", "entropy"):
        assert all(key in r for r in records), key
    print({key: [round(r[key], 4) for r in records] for key in ("reward", "kl", "completions/clipped_ratio")})
    # The second iteration of step 1 runs a policy one update away from the reference. (The KL is over trained
    # tokens: once every completion is truncated and masked, as the length reward soon makes them, there are none.)
    assert records[0]["kl"] > 0 and all(r["kl"] >= 0 for r in records)
    # The schedule advances with each update, as TRL's: 6 updates in 3 steps, linear to 0 over all 6.
    assert [r["lr"] for r in records] == pytest.approx([1e-2 * (1 - 2 * k / 6) for k in (1, 2, 3)], abs=1e-12)
    s = summary(out)
    assert s["memory_plan"]["frozen_model_bytes"] == s["memory"]["weight_bytes"] > 0
    # The generation's cache: 4 prompts x 4 completions, 32 + 8 tokens, 2 layers x key and value x 32 wide, fp32.
    assert (s["memory_plan"]["generated_rows"], s["memory_plan"]["generated_length"]) == (16, 40)
    assert s["memory_plan"]["kv_cache_bytes"] == 16 * 40 * 2 * 2 * 32 * 4
    assert s["eval"]["prompts"] == 20 and "rewards/only_rotten" in s["eval"]
    # The report's curves: each logged figure, those sharing a prefix together (the rewards per function one line
    # each, the greedy eval's beside them), with nothing of the task's known to the report.
    from framework import plots

    panels = dict(plots._panels({"run": read_metrics(out)}))
    assert {"reward", "rewards", "completions", "clip_ratio", "kl", "entropy"} <= set(panels)
    assert "prompts" not in panels and "step" not in panels
    assert [label for _, label, _ in panels["reward"]] == ["train", "eval"]
    assert [label for _, label, _ in panels["rewards"] if label.endswith("/mean")] == \
        ["characters/mean", "exact_match/mean", "only_rotten/mean"]
    assert {"eval exact_match", "eval only_rotten"} <= {label for _, label, _ in panels["rewards"]}
    assert (out / "plots" / "curves.png").stat().st_size > 10_000
    assert s["sample"]["prompt"].startswith("<|im_start|>") and "<|im_end|>" in s["sample"]["prompt"]
    assert "reward" in s["sample"]
    # Each training record shows its step's first prompt with 4 of its sampled completions, their rewards (the
    # weighted sum of the functions that scored them) and advantages; the report shows them at each logged step.
    for record in records:
        examples = record["examples"]
        assert len(examples) == 4 and len({e["prompt"] for e in examples}) == 1
        assert examples[0]["prompt"].startswith("<|im_start|>")
        for e in examples:
            weighted = [w * e["rewards"][name] for name, w in (("exact_match", 1.0), ("characters", 1.0),
                                                                ("only_rotten", 0.5)) if e["rewards"][name] is not None]
            assert e["reward"] == pytest.approx(sum(weighted), rel=1e-6) and isinstance(e["completion"], str)
    page = (out / "report.html").read_text()
    assert page.count(html.escape(records[0]["examples"][1]["completion"])) >= 1
    assert "<h2>Examples from training</h2>" in page and page.count(html.escape(records[0]["examples"][0]["prompt"])) >= 1


def test_an_adapted_grpo_run_prints_no_warning(cli, pretrained_lm, tmp_path):
    """GRPO with LoRA and its reference, in a process of its own, as users start it: no warning from any library
    (peft imports bitsandbytes, whose CPU backend said it failed to load a kernel from the Hub; peft read
    transformers' deprecated is_gradient_checkpointing, and fixed fan_in_fan_out for GPT-2's Conv1D layers itself;
    accelerate imported DeepSpeed, which said it fell back to the CPU)."""
    from test_end_to_end import noisy_lines

    proc = cli(lora_args(pretrained_lm, lora_prompts(tmp_path), tmp_path / "out", "train.max_steps=1"))
    assert "done: eval reward" in proc.stdout and noisy_lines(proc.stdout + proc.stderr) == []


@pytest.mark.parametrize("quantize", [False, True], ids=["lora", "qlora"])
def test_lora_reference_is_the_model_with_its_adapter_off(hf_home, pretrained_lm, tmp_path, capsys, quantize):
    """Under peft no copy is made: the reference is the trained model with its adapter switched off. LoRA starts
    as the identity (B = 0), so the first step's policy is its reference (KL exactly 0); after an update it is
    not. Generation goes through peft's model; with QLoRA, through its 4-bit base weights."""
    from helpers import WORDS

    out = tmp_path / "out"
    args = lora_args(pretrained_lm, lora_prompts(tmp_path), out, *(["peft.quantize=4bit"] if quantize else []))
    assert run_main(args, hf_home) == 0
    s = summary(out)
    assert s["memory_plan"]["frozen_model_bytes"] == 0 and s["memory"]["trainable_parameters"] < 10_000
    kl = [r["kl"] for r in read_metrics(out) if "kl" in r]
    print("kl per step:", kl)
    assert kl[0] == 0.0 and kl[-1] > 0
    assert set(s["sample"]["generated"].split()) <= set(WORDS) | {"<eos>"}
    assert (out / "model" / "adapter_config.json").exists()


DYNAMIC = [f"grpo.reward_functions=[{GRPO_REWARDS}:characters_when_fresh]", "grpo.dynamic_sampling=3",
           "train.max_steps=4", "optim.name=sgd", "optim.lr=0.5", "train.max_grad_norm=null"]
DYNAMIC_FIGURES = ("reward", "frac_reward_zero_std", "dynamic_sampling/replacements", "dynamic_sampling/rounds",
                   "dynamic_sampling/flat_first")


def scored_calls(record: Path) -> list:
    """Each call of ``grpo_rewards.characters_when_fresh`` on the first process: its (prompt, reward) rows."""
    return [json.loads(line) for line in Path(f"{record}.0").read_text().splitlines()]


@pytest.mark.multiprocess
def test_dynamic_sampling_replaces_flat_groups_whatever_the_split(hf_home, pair_tokenizer, pair_data, tmp_path,
                                                                  monkeypatch):
    """grpo.dynamic_sampling=3 with a reward that is flat for every 'rotten' prompt: rebuilt from the reward calls
    alone (each step's first call its 4 groups, each later call the groups replacing those still flat, in order),
    every step's logged reward mean, replacements, rounds, share flat at first and share flat at the end are what
    those calls say; every replacement is a training prompt; the first step samples first what a run without
    dynamic sampling samples; 1 process, accumulation (2 x 2), 2 processes and FSDP2 on 2 log the same figures and
    end with the same weights (the contract's bounds); a run killed mid-way resumes to the same weights, bitwise."""
    from helpers import assert_bitwise_equal_models, crash_then_resume, run_splits, runs_in_one_launch

    from framework.recipe import load_config

    record = tmp_path / "record"
    monkeypatch.setenv("GRPO_RECORD", str(record))
    one = tmp_path / "one"
    assert run_main(grpo_args(pair_tokenizer, pair_data, one, *DYNAMIC), hf_home) == 0
    monkeypatch.delenv("GRPO_RECORD")
    logged = [r for r in read_metrics(one) if "loss" in r]
    calls = iter(scored_calls(record))
    cfg = load_config(TINY_GRPO, grpo_args(pair_tokenizer, pair_data, one, *DYNAMIC)[2:])
    training = set(run_splits(cfg).train["prompt"])
    for step in logged:
        first = next(calls)
        groups = [first[i:i + 4] for i in range(0, 16, 4)]
        flat = [len({r for _, r in g}) == 1 for g in groups]
        replacements = 0
        for _ in range(int(step["dynamic_sampling/rounds"])):
            pending = [i for i, f in enumerate(flat) if f]
            rows = next(calls)
            assert len(rows) == 4 * len(pending) and pending
            for n, i in enumerate(pending):
                groups[i] = rows[4 * n:4 * n + 4]
                assert groups[i][0][0] in training
                flat[i] = len({r for _, r in groups[i]}) == 1
            replacements += len(pending)
        assert step["dynamic_sampling/replacements"] == replacements
        assert step["frac_reward_zero_std"] == sum(flat) / 4
        assert step["reward"] == pytest.approx(sum(r for g in groups for _, r in g) / 16, rel=1e-6)
        assert step["dynamic_sampling/rounds"] <= 3
    assert sum(r["dynamic_sampling/replacements"] for r in logged) > 0
    assert sum(r["frac_reward_zero_std"] for r in logged) < sum(r["dynamic_sampling/flat_first"] for r in logged)

    off = tmp_path / "off"
    assert run_main(grpo_args(pair_tokenizer, pair_data, off, *DYNAMIC[:1], *DYNAMIC[2:], "train.max_steps=1"),
                    hf_home) == 0
    assert read_metrics(off)[0]["frac_reward_zero_std"] == logged[0]["dynamic_sampling/flat_first"] > 0

    runs = {name: tmp_path / name for name in ("accumulation", "two", "fsdp2")}
    assert run_main(grpo_args(pair_tokenizer, pair_data, runs["accumulation"], *DYNAMIC, "train.batch_size=2",
                              "train.gradient_accumulation_steps=2"), hf_home) == 0
    # FSDP2 generates in lockstep: a process with no flat group samples one again for the other's rounds.
    launched = runs_in_one_launch(hf_home, {
        "two": grpo_args(pair_tokenizer, pair_data, runs["two"], *DYNAMIC, "train.batch_size=2"),
        "fsdp2": grpo_args(pair_tokenizer, pair_data, runs["fsdp2"], *DYNAMIC, "train.batch_size=2",
                           "distributed.strategy=fsdp")}, "cpu_ddp.yaml", tmp_path / "launch")
    assert all(proc.returncode == 0 for proc in launched.values()), {n: p.stderr[-2000:] for n, p in launched.items()}
    for name, out in runs.items():
        theirs = [r for r in read_metrics(out) if "loss" in r]
        for key in DYNAMIC_FIGURES:
            assert [r[key] for r in theirs] == pytest.approx([r[key] for r in logged], rel=1e-6), (name, key)
        assert_same_weights(out, one, 1e-5, 1e-6)

    resumed = tmp_path / "resumed"
    proc = crash_then_resume(hf_home, grpo_args(pair_tokenizer, pair_data, resumed, *DYNAMIC,
                                                "checkpoint.every_steps=2"), kill_at_micro=3)
    assert "resuming from" in proc.stdout
    assert_bitwise_equal_models(one, resumed)


def test_dynamic_sampling_on_a_stream_is_refused_by_key(hf_home, pair_tokenizer, pair_data, tmp_path):
    proc = run_captured(grpo_args(pair_tokenizer, pair_data, tmp_path / "out", *STREAM, "grpo.dynamic_sampling=2"),
                        hf_home)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "grpo.dynamic_sampling: draws replacement prompts from the training set, which a stream cannot give" \
        in proc.stderr

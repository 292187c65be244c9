"""GRPO with tools and environments (grpo.tools, grpo.environment; framework/tasks/online_rl/multi_turn.py and
tools.py): the rollout loop inserts exactly ``templates.tool_turn_ids`` of each call's result after the sampled
``</tool_call>`` (token in, token out), marks the inserted tokens out of the loss, turns the model's mistakes (a
malformed call, an unknown tool, a tool that raises or times out) into counted error results, respects the call and
length budgets; a real run trains on exactly the sampled and inserted tokens with the inserted ones masked, logs
the tool frequencies and the environment's reward; a row draws the same multi-turn rollout alone or in a batch; the
loss with a tool mask equals TRL 1.16's; the user's mistakes exit 2 naming the key."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, TINY_GRPO, read_metrics, summary
from in_process import fresh_process, run_captured, run_main
from test_grpo import trl_trainer  # noqa: F401 (the module-scoped fixture: TRL's GRPOTrainer on a tiny Llama)

CALCULATOR = ROOT / "recipes" / "tools" / "calculator.py"
WORDS = [str(n) for n in range(20)] + ["what", "is", "x", "the", "answer", "multiply", "name", "arguments", "a", "b"]


def slow(a: int) -> int:
    """Sleep, then answer.

    Args:
        a: A number.
    """
    time.sleep(2)
    return a


def broken(a: int) -> int:
    """Raise.

    Args:
        a: A number.
    """
    raise ValueError("broken on purpose")


def no_docstring(a: int) -> int:
    return a


ENVIRONMENT = '''
class Counter:
    """An environment: its reset appends the answer's hint, its tool counts, its reward reads its state."""

    def __init__(self):
        self.answer = None

    def reset(self, answer, **row):
        self.answer = answer
        return " answer"

    def count(self, a: int) -> int:
        """Count.

        Args:
            a: A number.
        """
        return a + 1

    def get_reward(self) -> float:
        return len(self.answer) / 10
'''


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    """A word-level tokenizer (as GPT-2's BPE, but 34 tokens and chatml-tools' 4: a random model then writes
    ``</tool_call>`` often, so rollouts take several turns)."""
    from framework.testing import save_word_tokenizer

    return save_word_tokenizer(tmp_path_factory.mktemp("grpo_tools"), WORDS)


@pytest.fixture(scope="module")
def tool_prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("grpo_tool_prompts") / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"what is {a} x {b}"}], "answer": str(a * b)}
            for a in range(1, 5) for b in range(2, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tool_args(tokenizer: Path, data: Path, out: Path, *extra: str) -> list:
    return ["--config", str(TINY_GRPO), f"model.tokenizer={tokenizer}", f"data.train_file={data}", f"output_dir={out}",
            "data.chat_template=chatml-tools", "grpo.reward_functions=[numeric]", "grpo.answer_column=answer",
            f"grpo.tools=[{CALCULATOR}:multiply]", "grpo.max_completion_length=64", "model.config.n_positions=96",
            "grpo.max_tool_calls=3", "train.max_steps=1", "train.batch_size=4", *extra]


# ---------------------------------------------------------------- the loop, its sampling scripted


def gpt2_tools():
    from transformers import AutoTokenizer

    from framework import templates

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets" / "gpt2-tokenizer")
    templates.use_template(tokenizer, "chatml-tools")
    return tokenizer


class Script:
    """Stands in for ``sampling.generate``: row r's turn t (the t-th time its context is given) is ``turns[r][t]``,
    its text tokenized, cut at the budget; records each call's contexts and budget."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.seen = tokenizer, turns, []

    def ids(self, text: str) -> list:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(self, model, prompts, seeds, settings, greedy=False, synced=False):
        self.seen.append((prompts, settings.max_new_tokens))
        out = []
        for context in prompts:
            row = int(self.tokenizer.decode(context[:1]))  # each prompt starts with its row number
            turn = sum(row == int(self.tokenizer.decode(p[:1])) for earlier, _ in self.seen[:-1] for p in earlier)
            out.append(self.ids(self.turns[row][turn])[:settings.max_new_tokens])
        return out


def loop(tokenizer, monkeypatch, turns, *functions, max_tool_calls=3, budget=200, timeout=0.5):
    from types import SimpleNamespace

    from framework import templates
    from framework.tasks.online_rl import multi_turn, sampling, tools

    settings = SimpleNamespace(tools=[f"{CALCULATOR}:multiply"] + [f"{__file__}:{f}" for f in functions],
                               environment=None, tool_timeout=timeout)
    toolbox = tools.Toolbox(settings, "grpo")
    base = sampling.Sampling(1.0, 0, 1.0, budget, templates.end_of_turn_ids(tokenizer, "chatml-tools"),
                             tokenizer.pad_token_id or 0)
    script = Script(tokenizer, turns)
    monkeypatch.setattr(multi_turn.sampling, "generate", script)
    tool_loop = multi_turn.ToolLoop(toolbox, tokenizer, base, max_tool_calls, 1000)
    prompts = [script.ids(f"{r} what is 3 x 4?") for r in range(len(turns))]
    return tool_loop.generate(None, prompts, list(range(len(turns))), [None] * len(turns)), script


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_the_loop_inserts_the_tool_turns_and_counts_every_mistake(monkeypatch):
    """Seven rollouts, their samples scripted: each completion is its sampled segments and, after each sampled
    ``</tool_call>``, exactly ``tool_turn_ids`` of the results (the multiply's product; errors for malformed calls,
    an unknown tool, arguments the tool does not take, a tool that raises, one that times out); the sampled mask is
    1 on the segments, 0 on the inserted tokens; a call after max_tool_calls ends the rollout unrun."""
    from framework import templates
    from framework.tasks.online_rl.multi_turn import Rollouts

    tokenizer = gpt2_tools()
    end = "<|im_end|>"
    turns = [
        [call("multiply", a=3, b=4), "12" + end],  # a call, its result, the answer
        ["Let me see." + call("multiply", a=3, b=4) + call("multiply", a=2, b=2), call("nope", a=1), "12" + end],
        ["<tool_call>{not json</tool_call>", "<tool_call>{\"name\": \"multiply\", \"arguments\": [1]}</tool_call>",
         "12" + end],
        [call("broken", a=1), call("slow", a=1), "1" + end],
        [call("multiply", a=1, b=1)] * 5,  # more calls than max_tool_calls
        ["12" + end],  # no call
        ["12</tool_call>", call("multiply", c=1), "12" + end],  # no opening tag; an argument multiply does not take
    ]
    started = time.perf_counter()
    out, script = loop(tokenizer, monkeypatch, turns, "broken", "slow", max_tool_calls=3)
    assert time.perf_counter() - started < 1.9  # the slow tool was given up on at its 0.5 s timeout
    error = "{'error': %r}"
    results = [
        [["12"]],
        [["12", "4"], [error % "Tool nope not found."]],
        [[error % "malformed tool call: not JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
                  "(char 1))"], [error % "malformed tool call: its arguments are not a JSON object"]],
        [[error % "broken on purpose"], [error % "Tool slow timed out after 0.5 s."]],
        [["1"], ["1"], ["1"]],
        [],
        [[error % "malformed tool call: no <tool_call> before its </tool_call>"],
         [error % "multiply() got an unexpected keyword argument 'c'"]],
    ]
    names = [[["multiply"]], [["multiply", "multiply"], ["nope"]], [["tool"], ["tool"]], [["broken"], ["slow"]],
             [["multiply"]] * 3, [], [["tool"], ["multiply"]]]
    for r, (segments, row_results, row_names) in enumerate(zip(turns, results, names)):
        expected, sampled = [], []
        for t, segment in enumerate(segments[:len(row_results) + 1]):
            expected += script.ids(segment)
            sampled += [1] * len(script.ids(segment))
            if t < len(row_results):
                inserted = templates.tool_turn_ids(tokenizer, [{"role": "tool", "name": n, "content": c}
                                                               for n, c in zip(row_names[t], row_results[t])])
                expected += inserted
                sampled += [0] * len(inserted)
        assert out.completions[r] == expected, r
        assert out.sampled[r] == sampled, r
        assert out.prompts[r] == script.ids(f"{r} what is 3 x 4?")
    assert isinstance(out, Rollouts)
    assert out.calls == [1, 3, 2, 2, 3, 0, 2] and out.failures == [0, 1, 2, 2, 0, 0, 2]
    # The rewards see the assistant's turns (their calls parsed) and the tool results, as TRL's messages.
    assert out.messages[0] == [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "multiply", "arguments": {"a": 3, "b": 4}}}]},
        {"role": "tool", "name": "multiply", "content": "12"}, {"role": "assistant", "content": "12"}]
    assert [len(prompts) for prompts, _ in script.seen] == [7, 6, 5, 1]  # rows still going at each turn


def test_the_completion_budget_counts_tool_tokens(monkeypatch):
    """max_completion_length counts sampled and inserted tokens: each turn samples at most what is left, and a tool
    turn leaving no room for one sampled token is not appended (the rollout ends at its call)."""
    from framework import templates

    tokenizer = gpt2_tools()
    first = call("multiply", a=3, b=4)
    probe = Script(tokenizer, [])
    inserted = templates.tool_turn_ids(tokenizer, [{"role": "tool", "name": "multiply", "content": "12"}])
    room = len(probe.ids(first)) + len(inserted)
    out, script = loop(tokenizer, monkeypatch, [[first, "12 is the answer<|im_end|>"]] * 2, budget=room + 2)
    assert out.completions[0] == probe.ids(first) + inserted + probe.ids("12 is")  # 2 tokens were left
    assert [budget for _, budget in script.seen] == [room + 2, 2]
    out, script = loop(tokenizer, monkeypatch, [[first, "12<|im_end|>"]], budget=room)
    assert out.completions[0] == probe.ids(first) and out.sampled[0] == [1] * len(probe.ids(first))
    assert out.calls == [1] and len(script.seen) == 1


# ---------------------------------------------------------------- real runs


def test_a_run_trains_on_the_sampled_and_inserted_tokens_with_the_inserted_masked(hf_home, tool_tokenizer,
                                                                                  tool_prompts, tmp_path,
                                                                                  monkeypatch):
    """One GRPO step (2 iterations) with the calculator and an environment (reset's observation appended to each
    prompt, its method a tool, its get_reward a reward) on a tiny random model: the micro-batches the update trains
    on hold, per rollout, its prompt and exactly the loop's completion, the targets are the sampled tokens alone,
    the log-probabilities recorded before the updates equal the first update's (1e-5), and the rollouts take
    several turns (the model's calls are malformed: counted failures). The metrics log the tool frequencies and the
    environment's reward under its class name."""
    from framework import train
    from framework.losses import IGNORE
    from framework.recipe import load_config
    from framework.tasks.online_rl import multi_turn

    environment = tmp_path / "counter.py"
    environment.write_text(ENVIRONMENT)
    out_dir = tmp_path / "out"
    cfg = load_config(TINY_GRPO, tool_args(tool_tokenizer, tool_prompts, out_dir, "grpo.iterations=2",
                                           f"grpo.environment={environment}:Counter")[2:])
    generated, trained = [], []
    with fresh_process(hf_home):
        run = train.setup(cfg)
        rollouts, logprobs = run.task.rollouts, run.task.logprobs

        def recording_rollouts(*args, **kwargs):
            result = rollouts(*args, **kwargs)
            generated.append(result)
            return result

        def recording_logprobs(model, batch, with_entropy=False):
            out = logprobs(model, batch, with_entropy)
            kept = {k: v.clone() for k, v in batch.items() if k in ("input_ids", "targets", "attention_mask")}
            logps = (out[0] if with_entropy else out).detach().clone()
            trained.append({**kept, "grad": torch.is_grad_enabled(), "logps": logps})
            return out

        monkeypatch.setattr(run.task, "rollouts", recording_rollouts)
        monkeypatch.setattr(run.task, "logprobs", recording_logprobs)
        batches = iter(run.data.train_dl)
        run.model.train()
        result = run.train_step(run.context, [next(batches)])
    (out, rows), = generated
    assert isinstance(out, multi_turn.Rollouts) and len(out.completions) == 4 * 4
    assert [call["grad"] for call in trained] == [False, True, True]  # recorded, then 2 updates (grpo.iterations)
    batch = trained[0]
    mask = batch["targets"] != IGNORE
    worst = (trained[0]["logps"] - trained[1]["logps"])[mask].abs().max().item()
    assert worst <= 1e-5  # the log-probabilities recorded before the updates are the first update's
    inserted_tokens = 0
    for i, (prompt, completion, sampled) in enumerate(zip(out.prompts, out.completions, out.sampled)):
        n = len(prompt) + len(completion)
        assert batch["input_ids"][i, :n].tolist() == prompt + completion
        assert batch["attention_mask"][i].sum() == n
        targets = batch["targets"][i, len(prompt) - 1:n - 1].tolist()
        assert targets == [t if s else IGNORE for t, s in zip(completion, sampled)]
        assert (batch["targets"][i, :len(prompt) - 1] == IGNORE).all() and (batch["targets"][i, n - 1:] == IGNORE).all()
        inserted_tokens += len(sampled) - sum(sampled)
        assert len(completion) <= 64
    assert inserted_tokens > 0 and sum(out.calls) > 0  # rollouts of several turns
    observed = run.task.tokenizer(" answer", add_special_tokens=False)["input_ids"]
    assert all(any(p[k:k + len(observed)] == observed for k in range(len(p))) for p in out.prompts)
    metrics = result.metrics
    assert metrics["tools/call_frequency"] == pytest.approx(sum(out.calls) / 16)
    assert metrics["tools/failure_frequency"] == pytest.approx(sum(out.failures) / sum(out.calls))
    expected_reward = sum(len(row["answer"]) / 10 for row in rows) / 16
    assert metrics["rewards/Counter/mean"] == pytest.approx(expected_reward)
    assert metrics["completions/mean_length"] == pytest.approx(sum(map(sum, out.sampled)) / 16)
    print(f"tools run: {sum(out.calls)} calls, {sum(out.failures)} failed, {inserted_tokens} inserted tokens; recorded "
          f"vs training log-probabilities max |diff| {worst:.1e}; "
          f"{ {k: round(v, 4) for k, v in metrics.items() if k.startswith(('tools', 'rewards'))} }")


def test_rloo_runs_the_same_tool_loop(hf_home, tool_tokenizer, tool_prompts, tmp_path):
    """The tools are the online-RL package's, so RLOO (its sequence-level loss over the same targets) trains with
    them too: its step logs tool calls, and its evaluation the tool figures."""
    from helpers import TINY_RLOO

    out = tmp_path / "rloo"
    args = ["--config", str(TINY_RLOO), f"model.tokenizer={tool_tokenizer}", f"data.train_file={tool_prompts}",
            f"output_dir={out}", "data.chat_template=chatml-tools", "rloo.reward_functions=[numeric]",
            "rloo.answer_column=answer", f"rloo.tools=[{CALCULATOR}:multiply]", "rloo.max_completion_length=64",
            "model.config.n_positions=96", "train.max_steps=1", "train.batch_size=4"]
    assert run_main(args, hf_home) == 0
    record, = [r for r in read_metrics(out) if "loss" in r]
    assert record["tools/call_frequency"] > 0 and record["tools/failure_frequency"] == 1.0  # random calls: malformed
    assert {"tools/call_frequency", "tools/failure_frequency"} <= summary(out)["eval"].keys()


def test_a_row_draws_the_same_multi_turn_rollout_alone_or_in_a_batch(hf_home, tool_tokenizer, tool_prompts, tmp_path):
    """Sampling keyed by example covers every turn: each rollout of a batch of 16 (several turns, with the tool
    turns between them) equals, token for token, the same row sampled alone with its seed: the process count and
    the batch do not change what is drawn."""
    from framework import train
    from framework.recipe import load_config
    from framework.tasks.online_rl.rollout import generation_batch

    cfg = load_config(TINY_GRPO, tool_args(tool_tokenizer, tool_prompts, tmp_path / "out")[2:])
    with fresh_process(hf_home):
        run = train.setup(cfg)
        batch = next(iter(run.data.train_dl))
        prompts, seeds = generation_batch([batch], 4, cfg.seed)
        rows = [row for row in batch["rows"] for _ in range(4)]
        model = run.accelerator.unwrap_model(run.model)
        together, _ = run.task.rollouts(model, prompts, seeds, rows)
        alone = [run.task.rollouts(model, [p], [s], [r])[0] for p, s, r in zip(prompts, seeds, rows)]
    assert sum(together.calls) > 0
    for i, single in enumerate(alone):
        assert single.completions[0] == together.completions[i] and single.sampled[0] == together.sampled[i], i
    print(f"{len(alone)} rollouts, turns: {[c + 1 for c in together.calls]}")


EQUIVALENCE = ["train.max_steps=2", "optim.name=sgd", "optim.lr=0.5", "train.max_grad_norm=null",
               "grpo.max_completion_length=48"]
SAME = ("reward", "tools/call_frequency", "tools/failure_frequency", "completions/mean_length", "rewards/Counter/mean")


@pytest.mark.multiprocess
def test_two_processes_and_accumulation_equal_one_with_tools(cli, hf_home, tool_tokenizer, tool_prompts, tmp_path):
    """With the calculator and an environment, 2 steps of 8 prompts (32 multi-turn rollouts each): 1 process,
    gradient accumulation (4 x 2) and 2 processes (4 each) draw the same rollouts (the same rewards, tool calls and
    failures, lengths at every step) and end with the same weights (fp32, within 1e-5)."""
    from helpers import assert_same_weights

    environment = tmp_path / "counter.py"
    environment.write_text(ENVIRONMENT)
    runs = {}
    for name, extra in (("one", ["train.batch_size=8"]),
                        ("accumulation", ["train.batch_size=4", "train.gradient_accumulation_steps=2"])):
        runs[name] = tmp_path / name
        assert run_main(tool_args(tool_tokenizer, tool_prompts, runs[name], *EQUIVALENCE, *extra,
                                  f"grpo.environment={environment}:Counter"), hf_home) == 0
    runs["two"] = tmp_path / "two"
    proc = cli(tool_args(tool_tokenizer, tool_prompts, runs["two"], *EQUIVALENCE, "train.batch_size=4",
                         f"grpo.environment={environment}:Counter"), launch="cpu_ddp.yaml")
    assert "num_processes: 2" in proc.stdout
    logged = {name: [r for r in read_metrics(out) if "loss" in r] for name, out in runs.items()}
    assert len(logged["one"]) == 2 and sum(r["tools/call_frequency"] for r in logged["one"]) > 0
    for name in ("accumulation", "two"):
        for key in SAME:
            assert [r[key] for r in logged[name]] == [r[key] for r in logged["one"]], (name, key)
        assert_same_weights(runs[name], runs["one"], 1e-5, 1e-6)
    # Evaluation runs the same loop, greedily, on the held-out prompts: the same figures from every run.
    evaluated = {name: summary(out)["eval"] for name, out in runs.items()}
    assert {"tools/call_frequency", "tools/failure_frequency", "rewards/Counter"} <= evaluated["one"].keys()
    assert evaluated["two"] == pytest.approx(evaluated["one"]) == evaluated["accumulation"]
    print("tools, 1 process = accumulation = 2 processes:", [{k: round(r[k], 4) for k in SAME} for r in logged["one"]],
          "eval:", evaluated["one"])


def test_a_killed_tools_run_resumes_bitwise(hf_home, tool_tokenizer, tool_prompts, tmp_path):
    """With the calculator and an environment: killed (SIGKILL) after step 1's checkpoint, the same command ends
    with the uninterrupted run's weights, losses, rewards and tool figures, to the last bit (the rollouts are keyed
    by example, the environments fresh per rollout)."""
    from helpers import assert_bitwise_equal_models, crash_then_resume, losses_by_step

    environment = tmp_path / "counter.py"
    environment.write_text(ENVIRONMENT)
    args = ["train.max_steps=3", "checkpoint.every_steps=1", "grpo.max_completion_length=48",
            f"grpo.environment={environment}:Counter"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run_main(tool_args(tool_tokenizer, tool_prompts, whole, *args), hf_home) == 0
    proc = crash_then_resume(hf_home, tool_args(tool_tokenizer, tool_prompts, resumed, *args), kill_at_micro=2)
    assert "resuming from" in proc.stdout and "step_1" in proc.stdout
    assert_bitwise_equal_models(whole, resumed)
    assert losses_by_step(resumed) == losses_by_step(whole)
    for key in ("reward", "tools/call_frequency", "tools/failure_frequency", "rewards/Counter/mean"):
        assert [r[key] for r in read_metrics(resumed) if "loss" in r] == \
            [r[key] for r in read_metrics(whole) if "loss" in r], key


def test_the_loss_with_a_tool_mask_equals_trl(trl_trainer):  # noqa: F811 (the fixture imported above)
    """TRL 1.16's ``_compute_loss`` given ``tool_mask`` (0 on inserted tokens) and ours given the same tokens with
    those tokens out of the targets: loss and gradients equal within 1e-5 (dapo and grpo)."""
    from transformers import AutoModelForCausalLM

    from framework.tasks.completions import target_logprobs
    from framework.tasks.grpo import Grpo, GrpoConfig
    from framework.tasks.online_rl.rollout import rollout_batch
    from helpers import grads
    from test_grpo import COMPLETIONS, MAX_COMPLETION, PROMPTS, ours_layout, trl_inputs

    sampled = [[1, 0, 1], [1, 1, 0, 0, 1, 1], [1, 1], [1, 0, 0, 0, 1, 1]]
    trainer, folder = trl_trainer
    for loss in ("dapo", "grpo"):
        trainer.loss_type, trainer.beta = loss, 0.0
        g = torch.Generator().manual_seed(5)
        advantage = torch.randn(len(PROMPTS), generator=g)
        inputs = trl_inputs(advantage, None, None)
        tool_mask = torch.zeros_like(inputs["completion_mask"])
        for i, s in enumerate(sampled):
            tool_mask[i, :len(s)] = torch.tensor(s)
        with torch.no_grad():
            logps = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), MAX_COMPLETION)[0]
        old = logps + 0.3 * torch.randn(logps.shape, generator=g)
        inputs = trl_inputs(advantage, old, None)
        inputs["tool_mask"] = tool_mask
        inputs["num_items_in_batch"] = (inputs["completion_mask"] * tool_mask).sum()  # TRL counts the loss mask
        trainer.model.zero_grad()
        trl_loss = trainer._compute_loss(trainer.model, inputs)
        trl_loss.backward()
        trl_grads = grads(trainer.model)

        policy = AutoModelForCausalLM.from_pretrained(folder).train()
        algorithm = Grpo(GrpoConfig(loss=loss, beta=0.0, epsilon=0.2, epsilon_high=0.28, temperature=0.7,
                                    max_completion_length=MAX_COMPLETION))
        batch = rollout_batch(PROMPTS, COMPLETIONS, [True] * len(PROMPTS), 1, "cpu", sampled=sampled)
        batch.update(advantages=advantage, old=ours_layout(old, batch["input_ids"].shape[1]))
        ours = target_logprobs(policy, batch, batch["targets"], 5, True, temperature=0.7)
        loss_sum, _ = algorithm.loss(ours, torch.zeros_like(ours), batch)
        mask = (batch["targets"] != -100).float()
        assert int(mask.sum()) == sum(map(sum, sampled))
        our_loss = loss_sum / algorithm.normaliser(mask)
        our_loss.backward()
        loss_diff = abs(our_loss.item() - trl_loss.item())
        ours_grads = grads(policy)
        grad_diff = max((ours_grads[name] - value).abs().max().item() for name, value in trl_grads.items())
        print(f"{loss} with a tool mask: loss {our_loss.item():.6f} vs TRL {trl_loss.item():.6f} "
              f"(|diff| {loss_diff:.1e}), gradients max |diff| {grad_diff:.1e}")
        assert loss_diff <= 1e-5 and grad_diff <= 1e-5


# ---------------------------------------------------------------- the user's mistakes


@pytest.mark.parametrize("override,message", [
    (f"grpo.tools=[{ROOT}/missing.py:multiply]", f"grpo.tools: '{ROOT}/missing.py:multiply': {ROOT}/missing.py does "
                                                 "not exist"),
    (f"grpo.tools=[{__file__}:no_docstring]", f"grpo.tools: '{__file__}:no_docstring': no JSON schema can be made of "
                                              "'no_docstring'"),
    (f"grpo.tools=[{CALCULATOR}:divide]", f"grpo.tools: '{CALCULATOR}:divide': {CALCULATOR} has no 'divide'"),
    (f"grpo.environment={__file__}:Script", f"grpo.environment: '{__file__}:Script' has no reset method"),
    ("data.chat_template=chatml", "data.chat_template: the chat template ignores the tools of grpo.tools"),
    ("data.chat_template={template}", "data.chat_template: the tokenizer splits </tool_call> into several tokens"),
])
def test_a_bad_tool_key_exits_2_naming_it(hf_home, tool_tokenizer, tool_prompts, tmp_path, override, message):
    """A tool file that does not exist, a function without a docstring (no schema), a missing function, an
    environment without reset, a template that ignores tools (chatml), chatml-tools' text as a file (the tokenizer
    then lacks the call tokens): exit 2 before training, one error line naming the key."""
    from framework.templates import CHATML_TOOLS

    (tmp_path / "template.jinja").write_text(CHATML_TOOLS)
    override = override.format(template=tmp_path / "template.jinja")
    out = tmp_path / "out"
    proc = run_captured(tool_args(tool_tokenizer, tool_prompts, out, override), hf_home)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: " + message), errors
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_tools_under_a_sharded_strategy_are_refused_by_key(tool_tokenizer, tool_prompts, tmp_path, strategy):
    """Each process's rollouts take their own number of turns, and a sharded model generates in lockstep: refused
    by the recipe's checks, naming grpo.tools, before anything loads."""
    from framework.errors import UserError
    from framework.recipe import load_config

    with pytest.raises(UserError) as refused:
        load_config(TINY_GRPO, tool_args(tool_tokenizer, tool_prompts, tmp_path / "out",
                                         f"distributed.strategy={strategy}")[2:])
    assert "- grpo.tools: tools and environments do not run under FSDP or DeepSpeed yet" in str(refused.value)

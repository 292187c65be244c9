"""What every task promises, checked for each on its tiny recipe: 1 process = 2 processes (gloo) = gradient
accumulation (the same examples in each optimizer step) within the task's stated tolerances; 2 processes under each
sharding strategy (FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, tensor parallelism) train what 1 process does too, or are
refused by key (the task x strategy matrix), and each cell's half-way checkpoint resumes on one process to the same
end (DeepSpeed's: written whole); a run killed
mid-training resumes to bitwise the uninterrupted run's weights and logged losses; a bad row is refused with
exit 2 and a message naming its column; ``--dry-run`` exits 0 after printing the plan.

The runs of a task are made once (module scope), when a check first needs them, and shared by its checks."""

from __future__ import annotations

import subprocess
from functools import cached_property
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from helpers import (LLAMA_CONFIG, ROOT, assert_bitwise_equal_models, assert_same_weights, cores, crash_then_resume,
                     documents, dpo_args, grpo_args, lm_args, losses_by_step, mlm_args, pairs, preferences, read_metrics,
                     review_conversations, reward_model_args, rloo_args, runs_in_one_launch, sft_args, summary,
                     synthetic_rows, task_names, tiny_args, write_jsonl)
from in_process import run_captured, train_ok

# The language models' runs: one document per row (packing off; masked LMs never pack): micro-batches of very
# different token counts; and
# SGD (Adam's update divides by the gradient's own size, which turns rounding-level differences of near-zero
# gradients into visible ones).
LM = ["data.packing=false", "train.max_steps=5", "train.max_grad_norm=null", "backend=auto", "optim.name=sgd",
      "optim.lr=0.5"]
# A run killed at a micro-batch after a checkpoint (every 5 steps) and resumed, against the uninterrupted one.
RESUME = ["train.max_steps=16", "checkpoint.every_steps=5", "train.log_every=2"]


def bad_text(rows):
    rows[17]["text"] = ["not", "text"]
    return rows


def bad_role(rows):
    rows[17]["messages"][0]["role"] = "robot"
    return rows


def bad_pair(rows):
    rows[7]["rejected"] = rows[7]["chosen"]
    return rows


def blank_prompt(rows):
    rows[7]["prompt"] = "   "
    return rows


# task: fixtures (what its arguments take before the output folder), arguments, the equivalence runs' overrides,
# the 1-process batch (2 processes and accumulation take half), the weights' (rtol, atol) or None, the logged
# losses' relative tolerance (None: torch.testing.assert_close's float32 default), the eval figure compared and
# its relative tolerance, the resumed runs' overrides, the micro-batch the run is killed at and the step it
# resumes from, its rows, how to spoil one, the refusal's message ({data}: the file), the cells marked slow, and
# (optionally) logged figures that must be equal at every step ("same").
CONTRACTS = {
    "text_classification": dict(
        fixtures=("tiny_encoder", "easy_data"), args=tiny_args, batch=8, weights=(1e-5, 1e-6), losses=None,
        overrides=["train.max_steps=6", "optim.lr=3e-3", "train.max_grad_norm=null", "train.eval_batch_size=3"],
        eval=("loss", 1e-5), rows=lambda: synthetic_rows(100, seed=1), spoil=bad_text,
        # 16 steps of 5 per epoch (40 rows): killed mid-epoch in the third epoch, after step 10's checkpoint.
        resume=["backend=cpu", "data.max_train_samples=40", *RESUME], kill_at=13, resumed_from=10,
        message="data.text_column: column 'text' of data.train_file {data} holds values of several JSON types",
        slow=()),
    "causal_lm": dict(
        fixtures=("word_tokenizer", "corpus"), args=lm_args, batch=8, weights=(1e-5, 1e-6), losses=None,
        overrides=LM, eval=("loss", 1e-5), resume=RESUME, kill_at=12, resumed_from=10,
        rows=lambda: documents(100, seed=3), spoil=bad_text,
        message="data.text_column: column 'text' of data.train_file {data} holds values of several JSON types",
        slow=()),
    "masked_lm": dict(
        fixtures=("word_tokenizer", "corpus"), args=mlm_args, batch=8, weights=(1e-5, 1e-6), losses=None,
        overrides=LM[1:], eval=("loss", 1e-5), resume=RESUME[:2], kill_at=13, resumed_from=10,
        rows=lambda: documents(100, seed=3), spoil=bad_text,
        message="data.text_column: column 'text' of data.train_file {data} holds values of several JSON types",
        slow=()),
    "sft": dict(
        fixtures=("chat_data",), args=sft_args, batch=8, weights=(1e-5, 1e-6), losses=None,
        overrides=[*LM[:1], "train.max_steps=4", *LM[2:]], eval=("loss", 1e-5), resume=RESUME, kill_at=12,
        resumed_from=10,
        rows=lambda: review_conversations(40, seed=0), spoil=bad_role, message="unknown role 'robot'",
        slow=("two_processes",)),
    # DPO's runs use Adam; the losses are equal up to the order of float sums (gloo's all-reduce, then Adam):
    # measured bitwise through step 6 and 2.6e-5 apart (3.6e-5 relative) at step 8.
    "dpo": dict(
        fixtures=("pair_tokenizer", "pair_data"), args=dpo_args, batch=8, weights=None, losses=1e-4,
        overrides=["train.max_steps=8", "train.log_every=2"], eval=("reward_margin", 1e-3),
        # The frozen reference is not in the checkpoint: the resumed run rebuilds it from the starting weights.
        resume=RESUME, kill_at=12, resumed_from=10, rows=lambda: pairs(40, seed=2), spoil=bad_pair,
        message="dpo.chosen_column: the row with prompt 'review : ", slow=("two_processes", "resume")),
    # A reward model on preference pairs (pairs scored by a sequence classifier: one forward pass over both sides).
    "reward_model": dict(
        fixtures=("pair_tokenizer", "preference_data"), args=reward_model_args, batch=8, weights=(1e-5, 1e-6),
        losses=None, overrides=["train.max_steps=4", "optim.name=sgd", "optim.lr=0.1", "train.max_grad_norm=null"],
        eval=("margin", 1e-5), resume=RESUME, kill_at=12, resumed_from=10, rows=lambda: preferences(40, seed=2),
        spoil=bad_pair, message="reward_model.chosen_column: the row with prompt 'review : ", slow=()),
    # GRPO samples 4 completions of each prompt, keyed by (seed, epoch, prompt index, completion): every run
    # draws the same ones, which the step's reward and completion lengths (over all 32) show at every step.
    "grpo": dict(
        fixtures=("pair_tokenizer", "pair_data"), args=grpo_args, batch=8, weights=(1e-5, 1e-6), losses=None,
        overrides=["train.max_steps=4", "optim.name=sgd", "optim.lr=0.5", "train.max_grad_norm=null"],
        eval=("reward", 1e-5), resume=RESUME, kill_at=12, resumed_from=10, rows=lambda: pairs(40, seed=2),
        spoil=blank_prompt, message="grpo.prompt_column: the row", slow=(),
        same=("reward", "reward_std", "completions/mean_length", "completions/max_length")),
    # RLOO on GRPO's sampling and rewards: the same completions drawn (keyed alike), its own advantages and loss.
    "rloo": dict(
        fixtures=("pair_tokenizer", "pair_data"), args=rloo_args, batch=8, weights=(1e-5, 1e-6), losses=None,
        overrides=["train.max_steps=4", "optim.name=sgd", "optim.lr=0.5", "train.max_grad_norm=null"],
        eval=("reward", 1e-5), resume=RESUME, kill_at=12, resumed_from=10, rows=lambda: pairs(40, seed=2),
        spoil=blank_prompt, message="rloo.prompt_column: the row", slow=(),
        same=("reward", "reward_std", "completions/mean_length", "completions/max_length")),
}


# The task x strategy matrix, the one owner of "strategy X trains what one process does": each strategy on 2 CPU
# processes, chosen by its keys (the launch configs that choose one, fsdp.yaml and deepspeed_*.yaml, are
# tests/test_launch.py's, tests/test_fsdp.py's and tests/test_deepspeed.py's). Those files go deeper into each
# (resume, memory, the contracts with accelerate and DeepSpeed). Found by it: the default recipe's BERT classifier
# under FSDP2 ended in a TypeError inside fully_shard (BERT lists its embeddings among its blocks, which accelerate
# then sharded twice: backend.fsdp2_wrap_classes leaves the embeddings' block out).
STRATEGIES = {"fsdp2": ["distributed.strategy=fsdp"],
              "zero2": ["distributed.strategy=deepspeed", "distributed.deepspeed.zero_stage=2"],
              "zero3": ["distributed.strategy=deepspeed", "distributed.deepspeed.zero_stage=3"],
              "tp": ["distributed.tensor_parallel=2"]}
# Tensor parallelism needs a model with a plan in transformers: the tasks whose tiny model is a GPT-2 built from its
# config take tests/tiny_llama.yaml's Llama instead (untied head), in the TP run and in its 1-process reference,
# with the whole batch (both processes of the tp dimension see the same batches). The MiniLM classifier and the
# masked LM's BERT have no plan: refused by key.
LLAMA = LLAMA_CONFIG
TP_LLAMA = ("causal_lm", "sft", "dpo", "reward_model", "grpo", "rloo")
# The cells refused by key, and the message's start.
SHARDING = ("fsdp2", "zero2", "zero3")
REFUSED = {**{("dpo", s): "dpo.loss: sigmoid's reference model is not built under FSDP or DeepSpeed" for s in SHARDING},
           ("masked_lm", "fsdp2"): "task: masked_lm does not run under FSDP2 yet",
           **{(t, "tp"): "distributed.tensor_parallel: Bert" for t in ("text_classification", "masked_lm")},
           ("dpo", "tp"): "dpo.loss: sigmoid's reference model is not built under tensor parallelism yet"}
# A sharded strategy sums each gradient in another order than one process (reduce-scatter or bucketed reductions):
# tests/test_fsdp.py's bounds, for weights and the logged losses.
SHARDED_WEIGHTS, SHARDED_LOSSES = (1e-4, 2e-5), 1e-5
# A task's 2-process runs, in the order its one launch (accelerate_configs/cpu_ddp.yaml) makes them: DDP's
# equivalence run first, DeepSpeed's after the runs without it.
LAUNCHED = {"two": [], **{s: STRATEGIES[s] for s in ("tp", "fsdp2", "zero2", "zero3")}}


def refused_before_loading(task: str, cell: str) -> bool:
    """Refused by key before anything loads, in one process as in two: no launch."""
    return (task, cell) in REFUSED and cell in SHARDING


def test_every_task_has_a_contract():
    assert sorted(CONTRACTS) == sorted(task_names())


class Runs:
    """A task's runs, each made when a check first asks for it."""

    def __init__(self, task: str, request, tmp: Path):
        self.task, self.spec, self.tmp = task, CONTRACTS[task], tmp
        self.hf_home = request.getfixturevalue("hf_home")
        self.inputs = [request.getfixturevalue(name) for name in self.spec["fixtures"]]

    @property
    def steps(self) -> int:
        """The equivalence runs' optimizer steps."""
        return int(next(o for o in reversed(self.spec["overrides"]) if o.startswith("train.max_steps="))
                   .split("=")[1])

    def args(self, out: Path, *extra: str):
        return self.spec["args"](*self.inputs, out, *extra)

    def equivalence(self, name: str, *extra: str) -> Path:
        return self.args(self.tmp / name, *self.spec["overrides"], *extra)

    @cached_property
    def one(self) -> Path:
        """1 process, the whole batch."""
        train_ok(self.equivalence("one", f"train.batch_size={self.spec['batch']}"), self.hf_home)
        return self.tmp / "one"

    @cached_property
    def one_llama(self) -> Path:
        """1 process, the whole batch, the tiny Llama (tensor parallelism's reference)."""
        train_ok(self.equivalence("one_llama", f"train.batch_size={self.spec['batch']}", *LLAMA), self.hf_home)
        return self.tmp / "one_llama"

    @cached_property
    def accumulation(self) -> Path:
        train_ok(self.equivalence("accumulation", f"train.batch_size={self.spec['batch'] // 2}",
                                  "train.gradient_accumulation_steps=2"), self.hf_home)
        return self.tmp / "accumulation"

    @cached_property
    def whole(self) -> Path:
        """The uninterrupted run a killed one must equal."""
        train_ok(self.args(self.tmp / "whole", *self.spec["resume"]), self.hf_home)
        return self.tmp / "whole"

    @cached_property
    def two_processes(self) -> Path:
        proc = self.launch["two"]
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "num_processes: 2" in proc.stdout
        self.two_stdout = proc.stdout
        return self.tmp / "two"

    def recipe(self, strategy: str) -> List[str]:
        """A strategy's cell: half the batch on each process (all of it under tensor parallelism, whose processes
        see the same batches, on the tiny Llama where the task's model has no plan), a checkpoint half way."""
        batch, model = self.spec["batch"] // 2, []
        if strategy == "tp":
            batch, model = self.spec["batch"], (LLAMA if self.task in TP_LLAMA else [])
        return [f"train.batch_size={batch}", *model, f"checkpoint.every_steps={self.steps // 2}"]

    @cached_property
    def launch(self) -> Dict[str, subprocess.CompletedProcess]:
        """The 2-process runs, "two" (DDP, the equivalence run) and the strategies' cells, made in one launch
        (helpers.runs_in_one_launch: a launch each would start 5 times as many processes)."""
        cells = [c for c in LAUNCHED if not refused_before_loading(self.task, c)]
        args = {c: self.equivalence(c, *(self.recipe(c) if c in STRATEGIES else
                                         [f"train.batch_size={self.spec['batch'] // 2}"]), *LAUNCHED[c])
                for c in cells}
        return runs_in_one_launch(self.hf_home, args, "cpu_ddp.yaml", self.tmp / "launch")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Runs:
    """A task's runs (the parameter), shared by the module's checks of that task."""
    return Runs(request.param, request, tmp_path_factory.mktemp(request.param))


def tasks(cell: str):
    """The tasks as parameters of ``runs`` for one cell: marked slow where the task's cell is (make test-slow)."""
    return pytest.mark.parametrize("runs", [
        pytest.param(task, marks=[pytest.mark.slow] if cell in CONTRACTS[task]["slow"] else [])
        for task in task_names()], indirect=True)


def assert_equivalent(spec: dict, got: Path, expected: Path) -> None:
    if spec["weights"]:
        assert_same_weights(got, expected, *spec["weights"])
    a, b = losses_by_step(got), losses_by_step(expected)
    assert a.keys() == b.keys()
    if spec["losses"] is None:  # the logged losses: the mean over all the step's targets
        torch.testing.assert_close(torch.tensor(list(a.values())), torch.tensor(list(b.values())))
    else:
        # abs: a loss about 0 (GRPO's, whose advantages sum to about 0 in each group) has no relative precision.
        assert all(a[k] == pytest.approx(b[k], rel=spec["losses"], abs=1e-6) for k in a), (a, b)
    key, rel = spec["eval"]
    assert summary(got)["eval"][key] == pytest.approx(summary(expected)["eval"][key], rel=rel)
    for name in spec.get("same", ()):
        a, b = ([r[name] for r in read_metrics(out) if "loss" in r] for out in (got, expected))
        assert a == b and len(a) == len(losses_by_step(expected)), name


@tasks("accumulation")
def test_gradient_accumulation_equals_one_batch(runs):
    assert_equivalent(runs.spec, runs.accumulation, runs.one)


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="backend auto would train on the GPU here")
@tasks("two_processes")
def test_two_processes_equal_one_with_double_batch(runs):
    """Equal weights mean the two processes together saw exactly the examples of the single process's batch,
    split into disjoint halves; the eval counts every example once."""
    two, one = runs.two_processes, runs.one
    assert summary(two)["num_processes"] == 2
    assert_equivalent(runs.spec, two, one)
    counts = {"examples", "tokens", "answers", "pairs"}
    assert {k: v for k, v in summary(two)["eval"].items() if k in counts} == \
        {k: v for k, v in summary(one)["eval"].items() if k in counts}


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="backend auto would train on the GPU here")
@pytest.mark.parametrize("runs", ["text_classification"], indirect=True)
def test_two_processes_share_the_cores_and_count_each_eval_example_once(runs):
    """Launched the way users type it, with the default backend (auto): on a machine without GPUs the 2 launched
    processes train together on the CPU, each with its share of the cores (the launcher's OMP_NUM_THREADS=1
    overridden). Eval: 40 examples over 2 processes x 3 per batch (not a multiple of 6): each counted exactly once."""
    two, one = runs.two_processes, runs.one
    assert "strategy: ddp" in runs.two_stdout
    assert f"cpu_threads: {max(1, cores() // 2)} (auto: {cores()} cores / 2 processes" in runs.two_stdout
    two_eval, one_eval = (next(r for r in reversed(read_metrics(o)) if "eval_accuracy" in r) for o in (two, one))
    assert two_eval["eval_examples"] == one_eval["eval_examples"] == 40
    assert two_eval["eval_accuracy"] == one_eval["eval_accuracy"] and two_eval["eval_f1"] == one_eval["eval_f1"]
    assert summary(two)["train"]["samples"] == 6 * 8


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU processes' matrix (make test-gpu has its own)")
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@tasks("two_processes")
def test_each_sharding_strategy_on_two_processes_trains_what_one_process_does_or_is_refused(runs, strategy):
    out, one, refused = runs.tmp / strategy, runs.one, REFUSED.get((runs.task, strategy))
    if refused_before_loading(runs.task, strategy):
        proc = run_captured(runs.equivalence(strategy, *STRATEGIES[strategy]), runs.hf_home)
        assert proc.returncode == 2 and refused in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert not (out / "summary.json").exists()
        return
    if strategy == "tp":
        one = runs.one_llama if runs.task in TP_LLAMA else None
    proc = runs.launch[strategy]
    if refused:  # tensor parallelism's: the model's missing plan, found with both processes
        assert proc.returncode != 0 and refused in proc.stderr and "[rank0]: Traceback" not in proc.stderr, \
            proc.stderr[-3000:]
        assert not (out / "summary.json").exists()
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(out)["num_processes"] == 2
    assert summary(out)["plan"]["strategy"].startswith(("fsdp", "deepspeed", "tensor parallel"))
    # Online RL under FSDP2 and ZeRO-3 generates on the weights gathered once (they fit the machine's memory), not
    # block by block: that path is the one the cell holds to one process.
    assert summary(out)["memory_plan"]["gathers_weights"] == (
        strategy in ("fsdp2", "zero3") and runs.task in ("grpo", "rloo"))
    spec = dict(runs.spec, weights=runs.spec["weights"] and SHARDED_WEIGHTS, losses=SHARDED_LOSSES)
    assert_equivalent(spec, out, one)
    assert_resumes_on_one_process(runs, strategy, runs.recipe(strategy), one)


def assert_resumes_on_one_process(runs, strategy: str, recipe, one: Path) -> None:
    """The strategy's half-way checkpoint resumed on one process (the effective batch kept by the accumulation, or
    as it is under tensor parallelism) ends where one process's uninterrupted run ends: its losses after the
    checkpoint and its weights within the sharded bounds. DeepSpeed's own checkpoints load only into DeepSpeed's
    layout: there the cell checks that the checkpoint was written whole (its manifest verifies)."""
    from framework.checkpoint import verify

    half = runs.steps // 2
    checkpoint = runs.tmp / strategy / "checkpoints" / f"step_{half}"
    assert checkpoint.is_dir() and verify(checkpoint) is None, verify(checkpoint)
    if strategy.startswith("zero"):
        return
    resumed = runs.tmp / f"{strategy}_resumed"
    proc = run_captured(runs.args(resumed, *runs.spec["overrides"], *recipe, f"checkpoint.resume={checkpoint}"),
                        runs.hf_home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {checkpoint}" in proc.stdout
    if runs.spec["weights"]:
        assert_same_weights(resumed, one, *SHARDED_WEIGHTS)
    a, b = losses_by_step(resumed), {k: v for k, v in losses_by_step(one).items() if k > half}
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=SHARDED_LOSSES, abs=1e-6) for k in a), (a, b)


# README.md's "What runs where" columns each strategy of the matrix fills.
README_COLUMNS = {"FSDP2 / HSDP": ("fsdp2",), "TP": ("tp",), "DeepSpeed": ("zero2", "zero3")}


def test_the_readme_table_says_what_the_matrix_shows():
    """Each task's cell under FSDP2, TP and DeepSpeed: "refused: `KEY`" naming the key of the matrix's refusal, or
    "tested: ... `test_task_contract.py`" where the matrix trains it."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| ")]
    header = next(line for line in lines if line.startswith("| task | CPU, 1 process |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = {cells[0].strip("`"): cells for line in lines
            if (cells := [c.strip() for c in line.strip("|").split("|")]) and len(cells) == len(columns)
            and "tested: `test_task_contract.py`" in line}
    assert sorted(rows) == sorted(task_names())
    for task, cells in rows.items():
        for column, strategies in README_COLUMNS.items():
            cell = cells[columns.index(column)]
            refused = [s for s in strategies if (task, s) in REFUSED]
            refusals = {REFUSED[(task, s)].split(":")[0] for s in refused}
            assert len(refusals) <= 1 and len(refused) in (0, len(strategies)), (task, column)  # one cell says it
            if refusals:
                assert cell.startswith(f"refused: `{refusals.pop()}`"), (task, column, cell)
            else:
                assert cell.startswith("tested: ") and "`test_task_contract.py`" in cell, (task, column, cell)


@tasks("resume")
def test_a_killed_run_resumes_bitwise(runs):
    resumed = runs.tmp / "resumed"
    proc = crash_then_resume(runs.hf_home, runs.args(resumed, *runs.spec["resume"]), kill_at_micro=runs.spec["kill_at"])
    assert "resuming from" in proc.stdout and f"step_{runs.spec['resumed_from']}" in proc.stdout
    assert_bitwise_equal_models(runs.whole, resumed)
    assert losses_by_step(resumed) == losses_by_step(runs.whole)  # to the last bit, before and after the resume point
    assert summary(resumed)["train"]["resumed_from_step"] == runs.spec["resumed_from"]
    assert summary(resumed)["eval"] == summary(runs.whole)["eval"]


@tasks("bad_row")
def test_a_bad_row_is_refused_naming_its_column(runs):
    data = write_jsonl(runs.tmp / "bad.jsonl", runs.spec["spoil"](runs.spec["rows"]()))
    out = runs.tmp / "bad"
    proc = run_captured(runs.args(out, f"data.train_file={data}"), runs.hf_home)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert runs.spec["message"].format(data=data) in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-2000:]
    assert proc.stderr.count("error:") == 1 and not (out / "summary.json").exists()


@tasks("dry_run")
def test_dry_run_prints_the_plan_and_trains_nothing(runs):
    out = runs.tmp / "dry_run"
    proc = run_captured(runs.args(out, "--dry-run"), runs.hf_home)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "plan:" in proc.stdout and "total_steps:" in proc.stdout and "memory plan per device" in proc.stdout
    assert not (out / "metrics.jsonl").exists() and not (out / "model").exists()

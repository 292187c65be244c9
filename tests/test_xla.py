"""The XLA path, run for real on the CPU (PJRT_DEVICE=CPU) in its own venv: `make test-xla`.

Static shapes keep the number of compiled graphs bounded and independent of the run length; the losses
match the CPU backend's; gradient accumulation on XLA equals the larger batch.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import (ACCELERATE_COMMAND, CHUNK, GRPO_REWARDS, NEGATIVE, NEUTRAL, POSITIVE, ROOT, RUN, STEADY_XLA,
                     TINY_LM, WORDS, assert_bitwise_equal_models, assert_no_graph_after_the_first_evaluation,
                     assert_same_weights, batch, build, cli_runner, crash_then_resume, documents, finite_checkpoints,
                     grads, grpo_args, launch_cmd, lm_args, packed_batch, read_metrics, review_conversations, rloo_args,
                     segments, targets_of, tiny_args, tiny_causal_lm, train_losses, weights, worst_gradient)

pytest.importorskip("torch_xla", reason="torch_xla is not installed: run `make test-xla`")
pytestmark = pytest.mark.xla

# Two buckets that every epoch of this sample fills, so a longer run meets no shape the shorter one did not.
SAMPLE = ["data.max_train_samples=192", "data.max_eval_samples=100", "data.max_length=32", "data.pad_buckets=[16,32]",
          "train.batch_size=16", "train.log_every=4"]
BUCKETS = 2


@pytest.fixture(autouse=True)
def xla_on_cpu(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")


def summary(out):
    return json.loads((out / "summary.json").read_text())


def assert_same_eval(a: dict, b: dict) -> None:
    """Two classification evaluations: the figures within rounding, the counts (per class, the confusion matrix)
    equal."""
    assert a.keys() == b.keys()
    numbers = [k for k, v in a.items() if not isinstance(v, (dict, list))]
    assert {k: a[k] for k in numbers} == pytest.approx({k: b[k] for k in numbers}, rel=1e-5)
    assert a["confusion_matrix"] == b["confusion_matrix"]
    assert a["per_class"].keys() == b["per_class"].keys()
    for c in a["per_class"]:
        assert a["per_class"][c] == pytest.approx(b["per_class"][c], rel=1e-5), c


@pytest.mark.slow
def test_default_recipe_compiles_a_bounded_number_of_graphs(cli, tmp_path):
    one, two = tmp_path / "one_epoch", tmp_path / "two_epochs"
    proc = cli([*SAMPLE, "train.epochs=1", f"output_dir={one}"])
    assert "backend: xla" in proc.stdout and "padding: static, lengths [16, 32]" in proc.stdout
    cli([*SAMPLE, "train.epochs=2", f"output_dir={two}"])
    short, long = summary(one)["xla"], summary(two)["xla"]
    assert summary(two)["train"]["steps"] == 2 * summary(one)["train"]["steps"] == 24
    assert short["compiles"] <= BUCKETS + 3, short
    assert long["compiles"] == short["compiles"], (short, long)  # twice the steps and evaluations, no new graph
    assert long["warning"] is None and short["compile_seconds"] > 0 and short["transfers_to_host"] > 0
    # Nothing in the step reads the device: every transfer to the host happens in logging or evaluation.
    assert short["transfers_in_steps"] == long["transfers_in_steps"] == 0, (short, long)


# The tiny model's shared runs: 8 steps, a checkpoint every 4. One device with the whole batch of 8 (and a
# profiled window), and FSDP over 4 virtual devices with 2 examples each; the other runs compare with them.
XLA_BASE = ["train.max_steps=8", "optim.lr=3e-3", "train.log_every=1", "checkpoint.every_steps=4"]
ONE_DEVICE = ["train.batch_size=8", "train.eval_batch_size=12"]
FOUR_DEVICES = ["train.batch_size=2", "train.eval_batch_size=3"]  # per device: the same batches


def shared_run(hf_home, args, devices: int = 1):
    """A run for several tests (module scope), on ``devices`` virtual XLA CPU devices."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PJRT_DEVICE", "CPU")
        if devices > 1:
            mp.setenv("CPU_NUM_DEVICES", str(devices))
        else:
            mp.delenv("CPU_NUM_DEVICES", raising=False)
        return cli_runner(hf_home)(args)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, tiny_model, easy_data, hf_home):
    out = tmp_path_factory.mktemp("xla_one_device") / "out"
    proc = shared_run(hf_home, tiny_args(tiny_model, easy_data, out, *XLA_BASE, *ONE_DEVICE,
                                                           "train.profile_steps=[2,3]"))
    return out, proc


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, tiny_model, easy_data, hf_home):
    out = tmp_path_factory.mktemp("xla_fsdp") / "out"
    proc = shared_run(hf_home, tiny_args(tiny_model, easy_data, out, *XLA_BASE, *FOUR_DEVICES,
                                                           "distributed.strategy=xla_fsdp"), devices=4)
    return out, proc


def test_xla_losses_match_the_cpu_backend(one_device, cli, tiny_model, easy_data, tmp_path):
    xla, _ = one_device
    cpu = tmp_path / "cpu"
    cli(tiny_args(tiny_model, easy_data, cpu, *XLA_BASE, *ONE_DEVICE, "backend=cpu"))
    assert summary(xla)["backend"] == "xla" and summary(cpu)["backend"] == "cpu"
    # Static padding on XLA, dynamic on the CPU: the attention mask makes them the same computation,
    # up to float32 reduction order.
    torch.testing.assert_close(torch.tensor(train_losses(xla)), torch.tensor(train_losses(cpu)), rtol=1e-4, atol=1e-5)


def test_gradient_accumulation_on_xla_equals_the_larger_batch(one_device, cli, tiny_model, easy_data, tmp_path):
    big, _ = one_device
    accum = tmp_path / "batch4x2"
    cli(tiny_args(tiny_model, easy_data, accum, *XLA_BASE, *ONE_DEVICE, "train.batch_size=4",
                  "train.gradient_accumulation_steps=2"))
    assert summary(accum)["backend"] == "xla"
    assert_same_weights(big, accum, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(train_losses(big)), torch.tensor(train_losses(accum)), rtol=1e-4,
                               atol=1e-5)


def test_spmd_over_four_devices_equals_one_device(one_device, cli, tiny_model, easy_data, tmp_path, monkeypatch):
    """Data parallel on several XLA devices without a TPU: SPMD over 4 virtual CPU devices, 2 examples
    each, against one device with the whole batch of 8."""
    single, _ = one_device
    spmd = tmp_path / "spmd"
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    proc = cli(tiny_args(tiny_model, easy_data, spmd, *XLA_BASE, *FOUR_DEVICES, "distributed.strategy=xla_spmd"))
    assert "xla spmd (batch sharded over 4 devices)" in proc.stdout and "effective_batch: 8" in proc.stdout
    torch.testing.assert_close(torch.tensor(train_losses(spmd)), torch.tensor(train_losses(single)),
                               rtol=1e-5, atol=1e-6)
    assert_same_weights(spmd, single, rtol=1e-5, atol=1e-6)
    assert_same_eval(summary(spmd)["eval"], summary(single)["eval"])  # all 40 examples, once
    assert summary(spmd)["xla"]["transfers_in_steps"] == 0  # batches arrive on the devices already split


def test_the_tpu_launch_config_trains_and_exits_non_zero_on_a_user_error(tiny_model, easy_data, hf_home, tmp_path):
    """accelerate_configs/tpu.yaml's own launcher (xmp.spawn of recipes/run.py's main(), which ignores its
    return value), here on one XLA CPU device: it trains, and a recipe error still ends with a non-zero exit."""
    env = {**os.environ, "HF_HOME": str(hf_home), "PJRT_DEVICE": "CPU", "PYTHONUNBUFFERED": "1"}
    env.pop("CPU_NUM_DEVICES", None)
    launch = launch_cmd(RUN, "tpu.yaml", launcher=ACCELERATE_COMMAND)
    out = tmp_path / "tpu"
    ok = subprocess.run(launch + tiny_args(tiny_model, easy_data, out, "train.max_steps=4", "train.log_every=2"),
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert summary(out)["backend"] == "xla" and summary(out)["train"]["steps"] == 4
    bad = subprocess.run(launch + tiny_args(tiny_model, easy_data, tmp_path / "bad", "train.batchsize=3"),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "unknown key 'train.batchsize'; did you mean 'train.batch_size'?" in bad.stderr


def test_resume_on_xla_after_a_kill_equals_the_uninterrupted_run(one_device, tiny_model, easy_data, hf_home,
                                                                 tmp_path):
    """Checkpoints on XLA save and load (accelerate's loader wrapper lacked what save_state reads), and a run
    killed after step 4's checkpoint resumes to the same weights as the uninterrupted run."""

    whole, _ = one_device
    resumed = tmp_path / "resumed"
    proc = crash_then_resume(hf_home, tiny_args(tiny_model, easy_data, resumed, *XLA_BASE, *ONE_DEVICE,
                                                "train.profile_steps=[2,3]"), kill_at_micro=6, in_process=False)
    assert "resuming from" in proc.stdout and "step_4" in proc.stdout
    assert summary(resumed)["backend"] == "xla" and summary(resumed)["train"]["resumed_from_step"] == 4
    assert_bitwise_equal_models(whole, resumed)
    assert train_losses(resumed) == train_losses(whole)


def test_xla_profile_and_no_mfu_for_a_device_without_a_known_peak(one_device):
    """torch_xla's profiler traced steps 2 to 3: its Chrome trace names the executed graphs' HLO ops (the
    embedding's gather, the layers' dot products). The XLA CPU device has no peak figure: no MFU, said once."""
    import gzip

    out, proc = one_device
    (trace,) = (out / "profile").rglob("*.trace.json.gz")
    assert f"profile of steps 2-3 written to {trace}" in proc.stdout + proc.stderr
    names = {e.get("name", "") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
    assert any(n.startswith("gather") for n in names) and any(n.startswith("dot") or "fusion" in n for n in names)
    assert any("ExecuteComputation" in n for n in names)  # the device executing the step's graph
    assert proc.stdout.count("no peak FLOP/s known for cpu") == 1
    assert summary(out)["mfu"] is None and not any("mfu" in r for r in read_metrics(out))


# ---------------------------------------------------------------- language models on XLA


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_packed_logits_equal_each_document_alone_on_xla(kind):
    import torch_xla

    from framework.config import RunConfig
    from framework.tasks import get_task

    xla = torch_xla.device()
    model, batch = tiny_causal_lm(kind).to(xla), packed_batch()
    task = get_task("causal_lm").bind(RunConfig(), model, None)
    with torch.no_grad():
        logits = task.forward(model, {k: v.to(xla) for k, v in batch.items()})[0].cpu()
        worst = 0.0
        for row, a, b in segments(batch):
            alone = model(input_ids=batch["input_ids"][row:row + 1, a:b].to(xla)).logits[0].cpu()
            worst = max(worst, (logits[row, a:b - 1] - alone[:-1]).abs().max().item())
    print(f"{kind} on XLA: packed vs alone max |diff| {worst:.2e}")
    assert worst < 1e-5


def test_chunked_loss_and_gradients_on_xla_equal_the_cpu():
    """framework/losses.py on an XLA device (static chunks, every token): loss, gradients and evaluation
    outputs equal the CPU's."""
    import torch_xla

    from framework import losses

    def run(dev):
        model = build("gpt2").to(dev)
        model.tie_weights()  # moving to XLA unties the embedding and the head; the framework ties them again
        inputs, labels = batch("gpt2")
        inputs, targets = {k: v.to(dev) for k, v in inputs.items()}, targets_of("gpt2", labels).to(dev)
        head = losses.output_head(model)
        hidden, _ = losses.hidden_states(model, head, **inputs)
        loss = losses.linear_cross_entropy(hidden, head, targets, CHUNK)
        loss.backward()
        token_losses, correct = losses.token_outputs(hidden.detach(), head, targets, CHUNK)
        if dev.type == "xla":  # one graph for all of it: each tensor read alone would compile its own (2 min)
            torch_xla.sync()
        return loss.cpu(), {k: v.cpu() for k, v in grads(model).items()}, token_losses.cpu(), correct.cpu()

    # The XLA device first: autograd's engine sizes its device queues at its first backward (the CPU run's).
    device = torch_xla.device()
    cpu, xla = run(torch.device("cpu")), run(device)
    torch.testing.assert_close(xla[0], cpu[0], rtol=1e-6, atol=0)
    assert worst_gradient(xla[1], cpu[1]) < 1e-5
    torch.testing.assert_close(xla[2], cpu[2], rtol=1e-5, atol=1e-6)
    assert torch.equal(xla[3], cpu[3])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_causal_lm_on_xla_matches_the_cpu_and_compiles_a_bounded_number_of_graphs(kind, cli, tmp_path):
    """The tiny GPT-2 of tests/tiny_lm.yaml, and a tiny Llama shaped as SmolLM2 is (tests/tiny_llama.yaml: grouped
    key/value heads, rotary positions, RMSNorm, the output layer tied to the embedding)."""
    from framework.testing import save_word_tokenizer

    tokenizer = save_word_tokenizer(tmp_path / "tokenizer", WORDS)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in documents(240, seed=3)))
    recipe = TINY_LM if kind == "gpt2" else ROOT / "tests" / "tiny_llama.yaml"
    # The chunked loss in 3 chunks of a 4 x 32 batch (48, 48, 32 tokens): on XLA over every token, on the CPU
    # over the target tokens only.
    args = lambda out, *extra: ["--config", str(recipe), f"model.tokenizer={tokenizer}",  # noqa: E731
                                f"data.train_file={corpus}", f"output_dir={out}", "backend=auto",
                                "train.loss_chunk_tokens=48", *extra]
    xla, cpu = tmp_path / "xla", tmp_path / "cpu"
    cli(args(xla, *STEADY_XLA))
    cli(args(cpu, *STEADY_XLA, "backend=cpu"))
    a = summary(xla)
    assert a["backend"] == "xla" and summary(cpu)["backend"] == "cpu"
    assert_no_graph_after_the_first_evaluation(xla)
    assert a["xla"]["transfers_in_steps"] == 0
    torch.testing.assert_close(torch.tensor(train_losses(xla)), torch.tensor(train_losses(cpu)), rtol=1e-4, atol=1e-5)
    assert a["eval"]["perplexity"] == pytest.approx(summary(cpu)["eval"]["perplexity"], rel=1e-4)


@pytest.mark.slow  # make test-slow: SPMD itself is in the tier (test_spmd_over_four_devices_equals_one_device)
def test_causal_lm_spmd_and_xla_fsdp_over_four_devices_equal_one_device(cli, tmp_path, monkeypatch):
    """The tiny GPT-2 (its output layer tied to the embedding) with the batch over 4 devices, and with its weights
    sharded over them too: the losses of one device; xla_fsdp's model/ holds the tied matrix once, as one device's
    does (the host copies assembled from the shards are separate tensors: their second name left out)."""
    from framework.testing import save_word_tokenizer

    tokenizer = save_word_tokenizer(tmp_path / "tokenizer", WORDS)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in documents(240, seed=3)))
    common = ["train.max_steps=5", "train.max_grad_norm=null", "train.eval_batch_size=2"]
    single, spmd = tmp_path / "single", tmp_path / "spmd"
    cli(lm_args(tokenizer, corpus, single, "backend=auto", *common, "train.batch_size=8"))
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    cli(lm_args(tokenizer, corpus, spmd, "backend=auto", *common, "train.batch_size=2", "distributed.strategy=xla_spmd"))
    torch.testing.assert_close(torch.tensor(train_losses(spmd)), torch.tensor(train_losses(single)), rtol=1e-5, atol=1e-6)
    assert summary(spmd)["eval"]["tokens"] == summary(single)["eval"]["tokens"]
    fsdp = tmp_path / "fsdp"
    cli(lm_args(tokenizer, corpus, fsdp, "backend=auto", *common, "train.batch_size=2", "distributed.strategy=xla_fsdp"))
    torch.testing.assert_close(torch.tensor(train_losses(fsdp)), torch.tensor(train_losses(single)), rtol=1e-5, atol=1e-6)
    assert "lm_head.weight" not in weights(single)
    assert_same_weights(fsdp, single, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # make test-slow, with the other variants of a run the tier checks
def test_lora_on_xla_matches_the_cpu_and_4_bit_is_refused(cli, tiny_model, easy_data, tmp_path):
    lora = ["train.max_steps=10", "peft.r=4", "peft.alpha=8", "peft.merge=true", "optim.lr=1e-2"]
    xla, cpu = tmp_path / "xla", tmp_path / "cpu"
    cli(tiny_args(tiny_model, easy_data, xla, *lora))
    cli(tiny_args(tiny_model, easy_data, cpu, *lora, "backend=cpu"))
    assert summary(xla)["backend"] == "xla"
    assert summary(xla)["memory"]["trainable_parameters"] == summary(cpu)["memory"]["trainable_parameters"]
    torch.testing.assert_close(torch.tensor(train_losses(xla)), torch.tensor(train_losses(cpu)), rtol=1e-4, atol=1e-5)
    # Saved from the XLA device: the adapter and the merged model, as on the CPU.
    for name in ("adapter/adapter_model.safetensors", "model.safetensors"):
        a, b = load_file(xla / "model" / name), load_file(cpu / "model" / name)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-5)
    proc = cli(tiny_args(tiny_model, easy_data, tmp_path / "qlora", *lora, "peft.quantize=4bit"), check=False)
    assert proc.returncode == 2 and "peft.quantize: 4-bit weights need bitsandbytes kernels" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- online RL on XLA

# The tests' GRPO and RLOO (tests/tiny_grpo.yaml, tests/tiny_rloo.yaml) with SGD, as the task contract takes them
# (Adam would turn rounding-level gradient differences into steps of the learning rate's size), 8 steps, evaluated
# every 4: from step 5 on every graph (the step's generation and update, the evaluation's greedy generation) exists.
ONLINE_RL = ["train.max_steps=8", "optim.name=sgd", "optim.lr=0.5", "train.max_grad_norm=null", "eval.every_steps=4"]
ONLINE_RL_ARGS = {"grpo": grpo_args, "rloo": rloo_args}
SAME_DRAWS = ("reward", "reward_std", "completions/mean_length", "completions/min_length", "completions/max_length")


def training_figures(out: Path, keys) -> dict:
    return {r["step"]: tuple(r[k] for k in keys) for r in read_metrics(out) if "loss" in r}


def evaluations(out: Path) -> dict:
    """The greedy evaluations' mean rewards and prompts counted, by step."""
    return {r["step"]: (r["eval_reward"], r["eval_prompts"]) for r in read_metrics(out) if "eval_reward" in r}


@pytest.fixture(scope="module")
def online_rl_on_cpu(tmp_path_factory, cli_module, pair_tokenizer, pair_data):
    """The CPU run of each task the XLA runs compare with (one process, 4 prompts a step), run once."""
    runs = {}

    def run(task: str) -> Path:
        if task not in runs:
            runs[task] = tmp_path_factory.mktemp(f"{task}_cpu") / "out"
            cli_module(ONLINE_RL_ARGS[task](pair_tokenizer, pair_data, runs[task], *ONLINE_RL, "backend=cpu"))
        return runs[task]
    return run


@pytest.mark.parametrize("task,strategy", [("grpo", None),
                                           pytest.param("grpo", "xla_spmd", marks=pytest.mark.slow),  # make test-slow
                                           pytest.param("grpo", "xla_fsdp", marks=pytest.mark.slow),
                                           pytest.param("rloo", None, marks=pytest.mark.slow),
                                           pytest.param("rloo", "xla_spmd", marks=pytest.mark.slow),
                                           pytest.param("rloo", "xla_fsdp", marks=pytest.mark.slow)])
def test_online_rl_on_xla_trains_what_the_cpu_trains(task, strategy, online_rl_on_cpu, cli, pair_tokenizer, pair_data,
                                                     tmp_path, monkeypatch):
    """One XLA device, or 4 (xla_spmd: one prompt each; xla_fsdp: one prompt each and the weights sharded over the
    4, the generation on the sharded model), against one CPU process with the same 4 prompts a step: the same
    completions drawn (the step's rewards and completion lengths equal at every step: the keyed sampling draws its
    noise on the host, the CPU's streams), the same greedy evaluations, the weights within the XLA tolerances;
    generation on the device itself with fixed shapes, so the compiled graphs stop growing once each kind of step
    has run (counted at every log step) and stay few."""
    cpu, out, devices = online_rl_on_cpu(task), tmp_path / "xla", 1 if strategy is None else 4
    monkeypatch.setenv("CPU_NUM_DEVICES", str(devices))
    extra = [] if strategy is None else ["train.batch_size=1", f"distributed.strategy={strategy}"]
    proc = cli(ONLINE_RL_ARGS[task](pair_tokenizer, pair_data, out, *ONLINE_RL, "backend=xla", *extra))
    assert {None: "device: xla:0", "xla_spmd": "xla spmd (batch sharded over 4 devices)",
            "xla_fsdp": "xla fsdp (parameters, gradients and optimizer state sharded over 4 devices"}[strategy] \
        in proc.stdout
    expected = training_figures(cpu, SAME_DRAWS)
    assert len(expected) == 8 and len({v[0] for v in expected.values()}) > 3  # rewards that move
    assert summary(out)["backend"] == "xla"
    assert training_figures(out, SAME_DRAWS) == expected
    # 20 prompts in batches of 8: XLA's last batch filled with 4 copies, left out of the figures.
    assert evaluations(out) == evaluations(cpu) and [n for _, n in evaluations(cpu).values()] == [20, 20]
    assert_same_weights(out, cpu, rtol=1e-4, atol=1e-5)
    compiles, xla = training_figures(out, ("xla/compiles",)), summary(out)["xla"]
    on_cpu = weights(cpu)
    worst = max(float((w - on_cpu[name]).abs().max()) for name, w in weights(out).items())
    print(f"{task} on {devices} device(s) ({strategy or 'one device'}): compiles by step "
          f"{[c for (c,) in compiles.values()]}, in all "
          f"{xla['compiles']} ({xla['compile_seconds']:.0f} s); transfers in steps {xla['transfers_in_steps']}; "
          f"weights at most {worst:.1e} from the CPU's; wall {summary(out)['train']['wall_seconds']:.1f} s "
          f"(CPU {summary(cpu)['train']['wall_seconds']:.1f} s)")
    assert len({compiles[step] for step in range(5, 9)}) == 1, compiles  # none after step 4
    # xla_fsdp: two graphs more (13 by step 8, 14 with the final save's check), none after step 4 either.
    assert xla["compiles"] <= (14 if strategy == "xla_fsdp" else 12) and xla["warning"] is None, xla


@pytest.mark.slow  # make test-slow, with the online-RL variants above
def test_dynamic_sampling_on_xla_replaces_the_groups_the_cpu_replaces(cli, pair_tokenizer, pair_data, tmp_path):
    """grpo.dynamic_sampling=3 with tests/test_grpo.py's reward, flat for every 'rotten' prompt, on one XLA device
    against one CPU process: every step's rewards, completion lengths and dynamic-sampling figures equal, the same
    weights within the XLA tolerances; each round samples as many groups as the step, so the rounds compile no
    graph of their own (none after step 4, as without dynamic sampling)."""
    dynamic = [f"grpo.reward_functions=[{GRPO_REWARDS}:characters_when_fresh]", "grpo.dynamic_sampling=3", *ONLINE_RL]
    cpu, xla = tmp_path / "cpu", tmp_path / "xla"
    cli(grpo_args(pair_tokenizer, pair_data, cpu, *dynamic, "backend=cpu"))
    cli(grpo_args(pair_tokenizer, pair_data, xla, *dynamic, "backend=xla"))
    keys = (*SAME_DRAWS, "dynamic_sampling/replacements", "dynamic_sampling/rounds", "dynamic_sampling/flat_first")
    expected = training_figures(cpu, keys)
    assert len(expected) == 8 and sum(v[len(SAME_DRAWS)] for v in expected.values()) > 0  # groups replaced
    assert training_figures(xla, keys) == expected
    assert_same_weights(xla, cpu, rtol=1e-4, atol=1e-5)
    compiles, stats = training_figures(xla, ("xla/compiles",)), summary(xla)["xla"]
    print(f"dynamic sampling on XLA: replacements by step {[v[len(SAME_DRAWS)] for v in expected.values()]}, "
          f"compiles by step {[c for (c,) in compiles.values()]}, in all {stats['compiles']}")
    assert len({compiles[step] for step in range(5, 9)}) == 1, compiles
    assert stats["compiles"] <= 12 and stats["warning"] is None, stats


@pytest.mark.slow  # make test-slow, with the online-RL variants above
def test_online_rl_under_xla_fsdp_resumes_after_a_kill_to_the_uninterrupted_run(cli, pair_tokenizer, pair_data,
                                                                               hf_home, tmp_path, monkeypatch):
    """GRPO under xla_fsdp over 4 devices, checkpointed every 2 steps and killed in step 5: resumed from step 4, it
    logs the uninterrupted run's rewards at every step and ends with its weights, bitwise."""
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    common = [*ONLINE_RL, "backend=xla", "train.batch_size=1", "distributed.strategy=xla_fsdp",
              "checkpoint.every_steps=2"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    cli(grpo_args(pair_tokenizer, pair_data, full, *common))
    resumed = crash_then_resume(hf_home, grpo_args(pair_tokenizer, pair_data, cut, *common), kill_at_micro=5,
                                in_process=False)
    assert f"resuming from {cut}/checkpoints/step_4: step 4" in resumed.stdout
    assert training_figures(cut, ("reward",)) == training_figures(full, ("reward",))
    assert_same_weights(cut, full, rtol=0, atol=0)


def test_the_generator_on_an_xla_device_draws_what_it_draws_on_the_cpu():
    """framework/tasks/online_rl/generator.py with fixed shapes on the XLA device (tests/test_generator.py's tiny
    Llama, prompts and seeds; its keyed noise drawn on the host), with the mask builders a run on XLA registers
    (backend.build): the CPU's completions and recorded log-probabilities (within 1e-5), sampled and greedy; the
    first sampled call compiles two graphs, the prefill and the decode step (its 16 steps), greedy decoding one
    more (its decode step), and the calls after none."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from framework.backend import build
    from framework.tasks.online_rl.generator import Generator
    from test_generator import PROMPTS, SEEDS, settings, tiny_llama

    def compiles() -> int:
        data = met.metric_data("CompileTime")
        return data[0] if data else 0

    model, s = tiny_llama(), settings(top_k=5)
    expected, greedy = Generator()(model, PROMPTS, SEEDS, s, logprobs=True), Generator()(model, PROMPTS, SEEDS, s,
                                                                                          greedy=True)
    build._masks_without_host_reads()  # else transformers reads the mask in the prefill: a graph cut in two
    model = model.to(torch_xla.device())
    generate = Generator(static=True, prompt_slots=16, sync=torch_xla.sync)
    before = compiles()  # the session's earlier tests' graphs (the counter is the process's)
    counts = []
    for _ in range(3):
        out = generate(model, PROMPTS, SEEDS, s, logprobs=True)
        assert out.completions == expected.completions
        assert max(abs(a - b) for x, y in zip(out.logprobs, expected.logprobs) for a, b in zip(x, y)) <= 1e-5
        counts.append(compiles() - before)
    for _ in range(2):
        assert generate(model, PROMPTS, SEEDS, s, greedy=True).completions == greedy.completions
        counts.append(compiles() - before)
    print(f"compiled graphs after each call: {counts}; decode steps {generate.timings.steps}")
    assert counts == [2, 2, 2, 3, 3] and generate.timings.steps == 16, counts


def test_a_diverging_run_on_xla_stops_before_writing_non_finite_weights(cli, word_tokenizer, corpus, tmp_path):
    """tests/test_faults.py's diverging run (lr 1e4, here a checkpoint every step, the last 2 kept) on XLA, where the
    loss is read only where the loop reads it anyway (log steps), and the weights before each checkpoint: status 4
    and one line naming the step (and the loss where it is the loss), no model/ nor summary, the checkpoints kept
    all finite and from before. Without the weights' check, step 2's checkpoint held infinite weights behind a
    finite logged loss. And train.on_nonfinite=skip, which would read the device in every step, is refused by key."""
    out = tmp_path / "out"
    args = lm_args(word_tokenizer, corpus, out, "backend=xla", "optim.lr=1e4", "train.max_steps=30",
                   "checkpoint.every_steps=1", "checkpoint.keep_last=2", "train.max_grad_norm=null")
    proc = cli(args, check=False)
    assert proc.returncode == 4 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "backend: xla" in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("diverged:")]
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    stop = len(losses)
    assert len(lines) == 1 and (f"the training loss is {losses[-1]} at step {stop}" in lines[0]
                                or f"a weight is not finite after step {stop}, although the loss was" in lines[0])
    assert not (out / "model").exists() and not (out / "summary.json").exists()
    kept = finite_checkpoints(out)
    assert kept and all(kept.values()) and max(kept) < stop, (kept, losses)
    print(lines[0], {"checkpoints kept (step: finite)": kept})

    skip = cli(lm_args(word_tokenizer, corpus, tmp_path / "skip", "backend=xla", "train.on_nonfinite=skip"),
               check=False)
    assert skip.returncode == 2 and "Traceback" not in skip.stderr, skip.stderr[-3000:]
    assert "train.on_nonfinite: skip is not available here: on XLA" in skip.stderr

# ---------------------------------------------------------------- parameters sharded over devices (XLA FSDP)

def per_device_fraction(out: Path) -> tuple:
    """The share of the weights and of the optimizer state the first device holds, read from the shards."""
    memory = summary(out)["memory"]
    held = memory["per_device"]
    return held["weight_bytes"] / memory["weight_bytes"], held["optimizer_state_bytes"] / memory["optimizer_state_bytes"]


def test_xla_fsdp_over_four_devices_equals_one_device_with_a_quarter_on_each(fsdp_run, one_device):
    """distributed.strategy=xla_fsdp on 4 virtual CPU devices (the default [1, 4] mesh) against one device with
    the whole batch: the same losses, weights and evaluation; each device holds a quarter of the weights and of
    AdamW's state (a little more: the devices do not divide every dimension, and the shards are padded)."""
    from transformers import pipeline

    (fsdp, proc), (single, _) = fsdp_run, one_device
    assert ("strategy: xla fsdp (parameters, gradients and optimizer state sharded over 4 devices, batch over 4; "
            "mesh data 1 x fsdp 4)") in proc.stdout
    assert "optimizer state (adamw): 0.0 MiB (sharded over 4 devices)" in proc.stdout  # the plan per device
    torch.testing.assert_close(torch.tensor(train_losses(fsdp)), torch.tensor(train_losses(single)), rtol=1e-5,
                               atol=1e-6)
    assert_same_weights(fsdp, single, rtol=1e-5, atol=1e-6)  # under the model's own names: no wrapper prefix
    assert_same_eval(summary(fsdp)["eval"], summary(single)["eval"])
    weights, state = per_device_fraction(fsdp)
    assert 0.25 <= weights < 0.26 and 0.25 <= state < 0.26, (weights, state)
    assert "per_device" not in summary(single)["memory"]
    classify = pipeline("text-classification", model=str(fsdp / "model"), device="cpu")
    assert classify("the movie was great")[0]["label"] in ("pos", "neg")
    # The steps, checkpoints and evaluation compile no more graphs than on one device, and nothing in the steps
    # reads the device.
    xla = summary(fsdp)["xla"]
    assert xla["compiles"] <= summary(single)["xla"]["compiles"] + 2 and xla["transfers_in_steps"] == 0, xla


def test_xla_fsdp_on_a_2x2_mesh_equals_one_device_with_half_on_each(one_device, cli, tiny_model, easy_data,
                                                                    tmp_path, monkeypatch):
    """distributed.mesh=[2,2]: 2 replicas (data) of parameters sharded 2 ways (fsdp), the batch over all 4."""
    single, _ = one_device
    mesh = tmp_path / "mesh"
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    proc = cli(tiny_args(tiny_model, easy_data, mesh, *XLA_BASE, *FOUR_DEVICES, "distributed.strategy=xla_fsdp",
                         "distributed.mesh=[2,2]"))
    assert "sharded over 2 devices, batch over 4; mesh data 2 x fsdp 2" in proc.stdout
    torch.testing.assert_close(torch.tensor(train_losses(mesh)), torch.tensor(train_losses(single)), rtol=1e-5,
                               atol=1e-6)
    weights, state = per_device_fraction(mesh)
    assert 0.5 <= weights < 0.51 and 0.5 <= state < 0.51, (weights, state)
    bad = cli(tiny_args(tiny_model, easy_data, tmp_path / "bad", "distributed.strategy=xla_fsdp",
                        "distributed.mesh=[3,2]"), check=False)
    assert bad.returncode == 2 and "distributed.mesh: [3, 2] covers 6 devices, but there are 4" in bad.stderr


def test_xla_fsdp_resumes_after_a_kill_to_the_uninterrupted_weights(fsdp_run, tiny_model, easy_data, hf_home,
                                                                    tmp_path, monkeypatch):
    """Checkpoints of a sharded run hold the whole weights and optimizer state (assembled from the shards); a run
    killed after step 4's checkpoint resumes, shards again, and ends with the uninterrupted run's weights."""

    whole, _ = fsdp_run
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    resumed = tmp_path / "resumed"
    proc = crash_then_resume(hf_home, tiny_args(tiny_model, easy_data, resumed, *XLA_BASE, *FOUR_DEVICES,
                                                "distributed.strategy=xla_fsdp"), kill_at_micro=6, in_process=False)
    assert "resuming from" in proc.stdout and "step_4" in proc.stdout
    assert summary(resumed)["train"]["resumed_from_step"] == 4
    assert_bitwise_equal_models(whole, resumed)
    assert train_losses(resumed) == train_losses(whole)
    weights, state = per_device_fraction(resumed)  # sharded again after the resume, optimizer state too
    assert weights < 0.26 and state < 0.26, (weights, state)
    # The checkpoint holds whole tensors under the wrapper's names: its own format, loaded by the same strategy.
    saved = torch.load(resumed / "checkpoints" / "step_8" / "pytorch_model.bin", map_location="cpu")
    assert any(name.endswith("word_embeddings.weight") for name in saved)


def test_sft_on_xla_matches_the_cpu_with_a_bounded_number_of_graphs(cli, tmp_path):
    """Conversations packed into blocks, padded to buckets: the XLA run's losses and answer accuracy are the CPU's."""
    from framework.testing import save_word_tokenizer

    tokenizer = save_word_tokenizer(tmp_path / "tokenizer", POSITIVE + NEGATIVE + NEUTRAL + [
        "system", "user", "assistant", "positive", "negative", "answer", "with", "one", "word"])
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in review_conversations(120, seed=0)))
    common = ["--config", str(Path(__file__).parent / "tiny_lm.yaml"), "task=sft", f"model.tokenizer={tokenizer}",
              f"data.train_file={data}", "data.chat_template=chatml", "train.max_steps=6", "train.log_every=1",
              "eval.every_steps=3"]
    xla, cpu = tmp_path / "xla", tmp_path / "cpu"
    cli([*common, "backend=auto", f"output_dir={xla}"])
    cli([*common, "backend=cpu", f"output_dir={cpu}"])
    a, b = summary(xla), summary(cpu)
    assert a["backend"] == "xla" and b["backend"] == "cpu"
    torch.testing.assert_close(torch.tensor(train_losses(xla)), torch.tensor(train_losses(cpu)), rtol=1e-4, atol=1e-5)
    assert a["eval"]["tokens"] == b["eval"]["tokens"] and a["eval"]["answers"] == b["eval"]["answers"]
    assert a["eval"]["answer_accuracy"] == b["eval"]["answer_accuracy"]
    assert a["eval"]["loss"] == pytest.approx(b["eval"]["loss"], rel=1e-4)
    assert a["xla"]["transfers_in_steps"] == 0 and a["xla"]["compiles"] <= 12, a["xla"]

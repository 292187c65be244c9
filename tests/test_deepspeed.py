"""DeepSpeed ZeRO for real on CPU processes (DeepSpeed's CPU accelerator, gloo): accelerate's own DeepSpeed path, set
up by backend.deepspeed_on_cpu_processes. On 2 processes ZeRO-1, -2 and -3 train what DDP does within fp32
rounding (the bounds below); model/ is the whole model, loadable by pipeline();
DeepSpeed's own checkpoints (ZeRO-2 and ZeRO-3) resume bitwise after SIGKILL; the launch config's ZeRO stage is the
stage that runs.

The tiny GPT-2 of tests/tiny_lm.yaml, as tests/test_fsdp.py trains it."""

import importlib
import inspect
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import crash_then_resume, lm_args, lora_lm_args, losses_by_step, runs_in_one_launch, summary, weights
from sharding import COMMON, CUDA, LOSS_TOLERANCE, WEIGHT_TOLERANCE, launch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install -e '.[test,deepspeed]'")
FAULT_SCRIPT = Path(__file__).resolve().parent / "scripts" / "fault_at.py"
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(CUDA, reason="the CPU path; make test-gpu runs ZeRO on GPUs")]


def zero_args(word_tokenizer, corpus, out: Path, stage: int) -> list:
    return lm_args(word_tokenizer, corpus, out, *COMMON, "distributed.strategy=deepspeed",
                   f"distributed.deepspeed.zero_stage={stage}")


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, corpus, word_tokenizer, hf_home):
    """zero_runs(stage): that stage's run (output folder, arguments, process), the three made in one launch for the
    tests that read them (each run's stdout ends with what it left alive in each process: tests/scripts/one_launch.py)."""
    folder = tmp_path_factory.mktemp("zero")
    args = {stage: zero_args(word_tokenizer, corpus, folder / f"zero{stage}", stage) for stage in (1, 2, 3)}
    made = {}

    def run(stage: int):
        if not made:
            procs = runs_in_one_launch(hf_home, {f"zero{s}": a for s, a in args.items()}, "cpu_ddp.yaml", folder)
            made.update({s: (folder / f"zero{s}", args[s], procs[f"zero{s}"]) for s in args})
        assert made[stage][2].returncode == 0, made[stage][2].stderr[-3000:]
        return made[stage]
    return run


@pytest.fixture(scope="module")
def zero2_run(zero_runs):
    return zero_runs(2)


def test_the_deepspeed_contract_the_cpu_switch_relies_on():
    """What backend.deepspeed_on_cpu_processes relies on, read from the installed accelerate and DeepSpeed: a new
    version that changes one of them fails here, by name, before any run trains something else."""
    from accelerate.state import AcceleratorState, PartialState

    torch_backend = importlib.import_module("deepspeed.comm.torch")
    assert callable(torch_backend.build_shm_op)  # the JIT build skipped, by this name
    assert "build_shm_op()" in inspect.getsource(torch_backend.TorchBackend.__init__)
    partial = inspect.getsource(PartialState.__init__)  # DeepSpeed's process group, for a launched non-CPU process
    assert 'os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"' in partial
    assert "if not cpu and self.backend != \"xla\":" in partial
    state = inspect.getsource(AcceleratorState.__init__)  # the plugin kept only where cpu is false
    assert 'os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not cpu' in state
    assert 'if parse_flag_from_env("ACCELERATE_USE_CPU"):' in state


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_on_2_cpu_processes_trains_what_ddp_does(stage, ddp_lm_run, zero_runs):
    out, _, proc = zero_runs(stage)
    assert f"strategy: deepspeed (ZeRO stage {stage})" in proc.stdout and "num_processes: 2" in proc.stdout
    assert "shm_comm_op built" not in proc.stdout + proc.stderr  # nothing compiled
    a, b = losses_by_step(out), losses_by_step(ddp_lm_run)
    assert len(a) == 12 and a.keys() == b.keys()
    wa, wb = weights(out), weights(ddp_lm_run)
    assert wa.keys() == wb.keys()
    torch.testing.assert_close(torch.tensor(list(a.values())), torch.tensor(list(b.values())), **LOSS_TOLERANCE)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], **WEIGHT_TOLERANCE, msg=lambda m: f"{name}: {m}")
    print(stage, {"max loss difference": max(abs(a[s] - b[s]) for s in a),
                  "max weight difference": max((wa[k] - wb[k]).abs().max().item() for k in wa)})


def test_bf16_under_zero2_and_zero3_follows_ddp_bf16(ddp_lm_run, hf_home, corpus, word_tokenizer, tmp_path):
    """precision=bf16: DDP autocasts fp32 weights, DeepSpeed's bf16 mode trains bf16 weights over fp32 master
    copies, so the two differ by bf16's rounding: over 12 steps the losses stay within 1e-3 of DDP's (measured
    3.2e-4), and model/ holds the bf16 weights DeepSpeed trained (the fp32 masters stay in the checkpoints)."""
    keys = {"ddp": ["distributed.strategy=ddp"], "zero2": ["distributed.strategy=deepspeed"],
            "zero3": ["distributed.strategy=deepspeed", "distributed.deepspeed.zero_stage=3"]}
    runs = {name: tmp_path / name for name in keys}
    procs = runs_in_one_launch(hf_home, {name: lm_args(word_tokenizer, corpus, runs[name], *COMMON, "precision=bf16",
                                                       *keys[name]) for name in keys}, "cpu_ddp.yaml", tmp_path)
    assert all(p.returncode == 0 and "precision: bf16" in p.stdout for p in procs.values()), procs
    reference = losses_by_step(runs["ddp"])
    assert len(reference) == 12 and losses_by_step(ddp_lm_run) != reference  # bf16 changed the fp32 run's losses
    for name in ("zero2", "zero3"):
        got = losses_by_step(runs[name])
        assert got.keys() == reference.keys()
        differences = [abs(got[s] - reference[s]) / reference[s] for s in got]
        assert max(differences) < 1e-3, (name, differences)
        assert {t.dtype for t in weights(runs[name]).values()} == {torch.bfloat16}
        print(name, {"max relative loss difference": max(differences)})


def test_model_is_whole_and_loadable_by_pipeline(zero2_run):
    from transformers import pipeline

    out, _, _ = zero2_run
    generate = pipeline("text-generation", model=str(out / "model"), device="cpu")
    assert generate("the cat", max_new_tokens=3, do_sample=False)[0]["generated_text"].startswith("the cat")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_checkpoint_resumes_bitwise_after_sigkill(stage, zero_runs, hf_home, tmp_path):
    """DeepSpeed's own checkpoint (each process's partition of the optimizer state; under ZeRO-3 of the weights
    too) and the framework's schedule: before prepare_scheduler, a DeepSpeed checkpoint held no scheduler state and
    a resume restarted the warmup."""
    out, args, _ = zero_runs(stage)
    step_8 = out / "checkpoints" / "step_8"
    assert {"pytorch_model", "scheduler.bin"} <= {p.name for p in step_8.iterdir()}
    resumed = tmp_path / "resumed"
    resumed_args = [a if not a.startswith("output_dir=") else f"output_dir={resumed}" for a in args]
    proc = crash_then_resume(hf_home, resumed_args, 10, launch="cpu_ddp.yaml", launch_args=launch())
    assert "resuming from" in proc.stdout and "step_8" in proc.stdout
    assert summary(resumed)["train"]["resumed_from_step"] == 8
    assert losses_by_step(resumed) == losses_by_step(out)
    wa, wb = weights(resumed), weights(out)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_launch_configs_stage_runs_and_a_contradicting_recipe_is_refused(hf_home, corpus, word_tokenizer,
                                                                             tmp_path):
    """accelerate_configs/deepspeed_zero3.yaml with the recipe's stage unset (strategy auto): ZeRO-3 runs. The same
    launch with distributed.deepspeed.zero_stage=2: exit 2 naming both stages."""
    out = tmp_path / "zero3"
    runs = {"zero3": lm_args(word_tokenizer, corpus, out, *COMMON[:1], "train.max_steps=2", "train.cpu_threads=1"),
            "bad": lm_args(word_tokenizer, corpus, tmp_path / "bad", "backend=cpu", "distributed.deepspeed.zero_stage=2")}
    procs = runs_in_one_launch(hf_home, runs, "deepspeed_zero3.yaml", tmp_path / "launch")
    proc, bad = procs["zero3"], procs["bad"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy: deepspeed (ZeRO stage 3)" in proc.stdout and "num_processes: 2" in proc.stdout
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert ("distributed.deepspeed.zero_stage: 2, but the launch config sets ZeRO stage 3; set "
            "distributed.deepspeed.zero_stage=3 or null") in bad.stderr
    assert not os.path.exists(tmp_path / "bad" / "summary.json")


def test_one_unlaunched_process_trains_and_offloading_is_refused_on_the_cpu(cli_module, corpus, word_tokenizer,
                                                                           tmp_path):
    """python recipes/run.py with strategy deepspeed (no launcher): a process group of one, ZeRO-2 trains. Offloading
    to the host means nothing on CPU processes (everything is there already): refused by key, exit 2."""
    out = tmp_path / "one"
    proc = cli_module(lm_args(word_tokenizer, corpus, out, "backend=cpu", "train.max_steps=2",
                              "distributed.strategy=deepspeed"))
    assert "strategy: deepspeed (ZeRO stage 2)" in proc.stdout and summary(out)["train"]["steps"] == 2
    bad = cli_module(lm_args(word_tokenizer, corpus, tmp_path / "bad", "backend=cpu", "distributed.strategy=deepspeed",
                             "distributed.deepspeed.offload_optimizer=cpu"), check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "distributed.deepspeed.offload_optimizer: offloading to the host needs a GPU" in bad.stderr


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nothing_of_the_engine_outlives_the_run(stage, zero_runs):
    """After a finished run each process holds no parameter, optimizer or DeepSpeed engine: what was left used to be
    torn down during the interpreter's shutdown, where on CI a finished ZeRO-2 run's second process aborted (SIGABRT
    after "done"). Without backend.release each process still held the model, the optimizer and the engine (through
    the engine's gradient hooks; under ZeRO-3 also its forward stack and its coordinator's cache)."""
    _, _, proc = zero_runs(stage)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"left"')]
    assert reports == [{"left": [], "gc_enabled": True}] * 2, reports


def test_a_weight_made_nan_under_zero3_stops_the_run_before_its_checkpoint(cli, corpus, word_tokenizer, tmp_path,
                                                                             monkeypatch):
    """ZeRO-3 keeps each process's part of a weight in ``ds_tensor``, the parameter itself being empty between
    forwards: process 1's part made NaN after step 2's update (tests/fault_injection.py), with a checkpoint every
    step. The weights' check before step 2's checkpoint reads each process's partition: status 4, the line names
    the weight at step 2, only step 1's checkpoint. Reading the empty parameters instead, the check passed, step
    2's checkpoint was written, and the run stopped a step later on the NaN loss."""
    out = tmp_path / "out"
    monkeypatch.setenv("FAULT", "nan@micro:2")
    monkeypatch.setenv("FAULT_RANK", "1")
    proc = cli(zero_args(word_tokenizer, corpus, out, 3) + ["checkpoint.every_steps=1"], launch="cpu_ddp.yaml",
               launch_args=launch(), script=FAULT_SCRIPT, check=False)
    assert proc.returncode != 0 and "exitcode  : 4" in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("diverged:")]
    assert len(lines) == 1 and "a weight is not finite after step 2, although the loss was" in lines[0], lines
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    assert not (out / "model").exists()


def test_lora_under_zero2_and_zero3_trains_what_ddp_does(hf_home, pretrained_lm, corpus, tmp_path):
    """LoRA (r 4) on a pretrained tiny GPT-2, the adapter and the merged model against DDP's: ZeRO-2 bitwise (only
    the adapters' gradients are reduced, in DDP's order), ZeRO-3 within 2.2e-7 (measured)."""
    common = ["backend=cpu", "train.max_steps=12", "train.log_every=1", "peft.merge=true", "train.cpu_threads=1"]
    keys = {"ddp": ["distributed.strategy=ddp"], "zero2": ["distributed.strategy=deepspeed"],
            "zero3": ["distributed.strategy=deepspeed", "distributed.deepspeed.zero_stage=3"]}
    runs = {name: tmp_path / name for name in keys}
    procs = runs_in_one_launch(hf_home, {name: lora_lm_args(pretrained_lm, corpus, runs[name], *common, *keys[name])
                                         for name in keys}, "cpu_ddp.yaml", tmp_path)
    assert all(p.returncode == 0 for p in procs.values()), procs
    for name, tolerance in (("zero2", dict(rtol=0, atol=0)), ("zero3", dict(rtol=1e-5, atol=1e-6))):
        for file in ("adapter/adapter_model.safetensors", "model.safetensors"):
            got, expected = (load_file(runs[r] / "model" / file) for r in (name, "ddp"))
            assert got.keys() == expected.keys() and (file == "model.safetensors" or any("lora_A" in k for k in got))
            for key in got:
                torch.testing.assert_close(got[key], expected[key], **tolerance, msg=lambda m: f"{name} {key}: {m}")

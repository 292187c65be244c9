"""FSDP2 for real on CPU processes (gloo; NCCL on GPUs under make test-gpu): accelerate's own FSDP2 path
(backend.fsdp2_on_cpu_processes). 2 processes of FSDP2 train what 2 of DDP do (what one process with twice the batch
does, for every task: the task contract's matrix), each holding half of the weights, gradients and optimizer state
(as the memory plan says); sharded checkpoints
(torch.distributed.checkpoint) resume bitwise after SIGKILL; model/ is the full model in safetensors, loadable by
pipeline() (resuming on another layout: tests/test_resharding.py). Tensor parallelism (accelerate's ParallelismConfig
tp_size, transformers' plan) on 2 processes trains what one does, on a tiny Llama, and its checkpoints resume
bitwise; so do FSDP2 with activation checkpointing on that Llama (tied, as SmolLM2) and, what DDP does, QLoRA under
FSDP2.

The tiny GPT-2 of tests/tiny_lm.yaml: its blocks are what FSDP wraps (transformer_based_wrap), its embedding
is tied to the output layer."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import (ROOT, cli_runner, crash_then_resume, free_port, lm_args, lora_lm_args, losses_by_step, machines,
                     read_metrics, run_ok, runs_in_one_launch, summary, weights)
from in_process import train_ok
from sharding import BACKEND, COMMON, CUDA, DDP_LAUNCH, WEIGHT_TOLERANCE, assert_trains_alike, into, launch, llama_args

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(CUDA and torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.fixture(scope="module")
def fsdp_run(fsdp_lm_run):
    """The common run under FSDP2 (tests/conftest.py's ``fsdp_lm_run``, which tests/test_resharding.py resumes too)."""
    return fsdp_lm_run


def test_fsdp2_contract_with_the_installed_accelerate(cli_module):
    """What backend.fsdp2_on_cpu_processes relies on (tests/scripts/fsdp_contract.py says each assumption)."""
    proc = cli_module([str(free_port())], launch="cpu_ddp.yaml", script=ROOT / "tests" / "scripts" / "fsdp_contract.py",
                      launch_args=launch())
    assert "fsdp2 contract holds" in proc.stdout


def test_generating_mid_training_under_fsdp2_leaves_the_weights_bitwise(cli_module):
    """backend.generating on 2 FSDP2 processes: unsharded to generate, resharded and back in training mode after,
    the final weights bitwise those of the same run without it; with the weights gathered once (gather_once) the
    same tokens and weights, at most one all-gather per FSDP module and none while generating, where block by block
    each block gathers in each forward (tests/scripts/generating_mid_training.py)."""
    proc = cli_module(["fsdp"], launch="cpu_ddp.yaml", script=ROOT / "tests" / "scripts" / "generating_mid_training.py",
                      launch_args=launch())
    assert "generating mid-training kept the weights (fsdp)" in proc.stdout


def test_fsdp2_trains_what_ddp_does(fsdp_run, ddp_lm_run):
    """2 processes of FSDP2 and of DDP on the same batches (one process's equivalence is the task contract's matrix,
    tests/test_task_contract.py): losses and weights within the sharded bounds, the tied output layer saved once (the
    same weight names), every eval token counted once over the 2 processes."""
    out, _, proc = fsdp_run
    assert "strategy: fsdp (version 2)" in proc.stdout and "num_processes: 2" in proc.stdout
    assert len(losses_by_step(out)) == 12
    assert_trains_alike(out, ddp_lm_run)
    ev, ev_ddp = ([r for r in read_metrics(o) if "eval_loss" in r][-1] for o in (out, ddp_lm_run))
    assert ev["eval_tokens"] == ev_ddp["eval_tokens"]
    assert ev["eval_loss"] == pytest.approx(ev_ddp["eval_loss"], rel=1e-5)


def test_each_process_holds_half_of_the_states_as_the_plan_says(fsdp_run):
    """summary.json's per_device bytes are read from the first process's local shards (DTensor.to_local()); the
    plan counts FSDP2's chunks of each parameter's first dimension. The optimizer's step counters (one 4-byte
    scalar per parameter tensor, not sharded) are all the two differ by."""
    out, _, _ = fsdp_run
    result = summary(out)
    measured, plan = result["memory"], result["memory_plan"]
    held = measured["per_device"]
    for key in ("weight_bytes", "gradient_bytes", "optimizer_state_bytes"):
        ratio = held[key] / measured[key]
        assert 0.5 <= ratio < 0.51, (key, ratio)
    assert held["weight_bytes"] == plan["weight_bytes"] and held["gradient_bytes"] == plan["gradient_bytes"]
    tensors = 2 + 2 * 12 + 2  # 2 embeddings; 2 blocks of 2 norms and 4 linear layers (weight, bias); the last norm
    assert held["optimizer_state_bytes"] - plan["optimizer_state_bytes"] == 4 * tensors
    assert plan["sharded"] == ["gradients", "optimizer_state", "weights"] and plan["shards"] == 2


def test_model_is_the_full_model_in_safetensors_loadable_by_pipeline(fsdp_run):
    from transformers import pipeline

    out, _, _ = fsdp_run
    w = weights(out)
    vocab = json.loads((out / "model" / "config.json").read_text())["vocab_size"]
    assert w["transformer.wte.weight"].shape == (vocab, 32)  # whole, not a shard
    generate = pipeline("text-generation", model=str(out / "model"), device="cpu")
    assert generate("the cat", max_new_tokens=3, do_sample=False)[0]["generated_text"].startswith("the cat")


def test_sharded_checkpoint_resumes_bitwise_after_sigkill(fsdp_run, hf_home, tmp_path):
    """The DCP states (framework/backend/states.py): each process writes its shards of the parameters and of the
    optimizer's state, named by parameter; killed after step 8's checkpoint, the same command resumes bitwise.
    (On another layout: tests/test_resharding.py.)"""
    out, args, _ = fsdp_run
    states = out / "checkpoints" / "step_8" / "states"
    assert {p.suffix for p in states.iterdir()} == {".distcp", ""}  # both processes' shards, and .metadata
    assert len(list(states.glob("*.distcp"))) == 2
    resumed = tmp_path / "resumed"
    # Killed at micro-batch 10 of each process: after step 8's checkpoint, mid-epoch.
    proc = crash_then_resume(hf_home, into(args, resumed), 10, launch="fsdp.yaml", launch_args=launch())
    assert "resuming from" in proc.stdout and "step_8" in proc.stdout
    same_weights(resumed, out)
    if not CUDA:
        assert losses_by_step(resumed) == losses_by_step(out)
    assert summary(resumed)["train"]["resumed_from_step"] == 8


# ---------------------------------------------------------------- make test-slow: variants of the run above


def same_weights(a: Path, b: Path) -> None:
    """Bitwise on the CPU (deterministic kernels, the same collectives); within the tolerance on GPUs."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        if CUDA:
            torch.testing.assert_close(wa[name], wb[name], **WEIGHT_TOLERANCE)
        else:
            assert torch.equal(wa[name], wb[name]), name


@pytest.mark.slow
def test_activation_checkpointing_offload_and_plain_loading_train_what_the_default_does(fsdp_run, cli_module,
                                                                                        tmp_path):
    """Recomputing each block in backward (asked as users ask it of any run, train.gradient_checkpointing: under
    FSDP the plugin's activation checkpointing), offloading the shards (CPUOffloadPolicy: the optimizer steps on the
    host) and loading on every process instead of broadcasting from the first change where the numbers are, not
    what they are."""
    out, args, _ = fsdp_run
    other = tmp_path / "options"
    cli_module([*into(args, other),
                "train.gradient_checkpointing=true", "distributed.fsdp.offload_params=true",
                "distributed.fsdp.cpu_ram_efficient_loading=false"], launch="fsdp.yaml", launch_args=launch())
    assert summary(other)["memory_plan"]["gradient_checkpointing"] is True
    assert summary(other)["memory_plan"]["offloaded"] == ["gradients", "optimizer_state", "weights"]
    same_weights(out, other)
    assert losses_by_step(other) == losses_by_step(out) or CUDA


@pytest.mark.slow
def test_bf16_mixed_precision_policy(fsdp_run, cli_module, tmp_path):
    """precision bf16 under FSDP2: accelerate's MixedPrecisionPolicy computes in bf16 (all-gathers bf16 copies)
    and keeps the fp32 shards the optimizer steps. bf16 keeps 8 bits of mantissa (relative rounding 2^-9): over 12
    steps the losses stayed within 1e-3 of fp32's, the weights within 1.3e-2 (measured over 6 steps: 8e-4, 1.3e-2)."""
    out, args, _ = fsdp_run
    bf16 = tmp_path / "bf16"
    proc = cli_module([*into(args, bf16), "precision=bf16"], launch="fsdp.yaml", launch_args=launch())
    assert "precision: bf16" in proc.stdout and "strategy: fsdp (version 2)" in proc.stdout
    torch.testing.assert_close(torch.tensor(list(losses_by_step(bf16).values())),
                               torch.tensor(list(losses_by_step(out).values())), rtol=0, atol=5e-3)
    w, expected = weights(bf16), weights(out)
    assert all(t.dtype == torch.float32 for t in w.values())  # the saved model is the fp32 shards, gathered
    for name in w:
        torch.testing.assert_close(w[name], expected[name], rtol=0, atol=5e-2)


@pytest.mark.slow
def test_full_state_dict_checkpoints_resume_bitwise_and_model_is_the_best(fsdp_run, cli_module, hf_home,
                                                                         corpus, word_tokenizer, tmp_path):
    """distributed.fsdp.state_dict=full: the model and optimizer gathered and written whole, by the first process
    (every tensor one chunk of the DCP states, which any layout loads as it loads shards). With eval.metric
    (here the highest loss: the first evaluation's, at step 4) model/ is the best model, saved from the shards
    when it was evaluated: the weights of the sharded run's step_4 checkpoint, read with torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    full = [*COMMON, "distributed.fsdp.state_dict=full", "eval.every_steps=4", "eval.metric=loss",
            "eval.greater_is_better=true"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    cli_module(lm_args(word_tokenizer, corpus, whole, *full), launch="fsdp.yaml", launch_args=launch())
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(whole / "checkpoints" / "step_8" / "states")).read_metadata()
    chunks = [len(item.chunks) for item in metadata.state_dict_metadata.values() if hasattr(item, "chunks")]
    assert chunks and set(chunks) == {1}  # whole tensors, not each process's shards
    assert summary(whole)["best"]["step"] == 4
    proc = crash_then_resume(hf_home, lm_args(word_tokenizer, corpus, resumed, *full), 10, launch="fsdp.yaml",
                             launch_args=launch())
    assert "resuming from" in proc.stdout and "step_8" in proc.stdout
    same_weights(whole, resumed)
    if not CUDA:
        assert losses_by_step(resumed) == losses_by_step(whole) == losses_by_step(fsdp_run[0])

    sharded_run = fsdp_run[0]
    converted = tmp_path / "step_4.pt"
    dcp_to_torch_save(sharded_run / "checkpoints" / "step_4" / "states", converted)
    at_step_4 = torch.load(converted, weights_only=True)["model"]
    best = weights(whole)
    for name, tensor in best.items():
        torch.testing.assert_close(tensor, at_step_4[name], rtol=0, atol=0 if not CUDA else 1e-5)
    from transformers import pipeline  # the best model, gathered from the shards, is a whole model users load

    generate = pipeline("text-generation", model=str(whole / "model"), device="cpu")
    assert generate("the cat", max_new_tokens=3, do_sample=False)[0]["generated_text"].startswith("the cat")


@pytest.mark.slow
def test_lora_under_fsdp2_trains_what_ddp_does_saves_adapter_and_merged_model_and_resumes_exactly(
        hf_home, pretrained_lm, corpus, tmp_path):  # noqa: F811 (the fixture imported above)
    """LoRA on the FSDP2-sharded base (frozen, sharded too): the adapter and the merged model equal DDP's (bitwise
    on the CPU: only the adapters' small gradients are reduced, in the same order), pipeline() loads the merged
    model, and a kill mid-epoch resumes to the same adapter."""
    from transformers import pipeline

    common = [BACKEND, "train.max_steps=12", "checkpoint.every_steps=4", "train.log_every=1", "peft.merge=true",
              "train.cpu_threads=1"]
    fsdp, ddp, resumed = tmp_path / "fsdp", tmp_path / "ddp", tmp_path / "resumed"
    procs = runs_in_one_launch(hf_home, {"fsdp": lora_lm_args(pretrained_lm, corpus, fsdp, *common,
                                                              "distributed.strategy=fsdp"),
                                         "ddp": lora_lm_args(pretrained_lm, corpus, ddp, *common)},
                               DDP_LAUNCH, tmp_path / "launch")
    assert all(p.returncode == 0 for p in procs.values()), procs
    assert "strategy: fsdp (version 2)" in procs["fsdp"].stdout
    adapter = load_file(fsdp / "model" / "adapter" / "adapter_model.safetensors")
    assert any("lora_A" in k for k in adapter)
    expected = load_file(ddp / "model" / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == expected.keys()
    for name in adapter:
        torch.testing.assert_close(adapter[name], expected[name], rtol=0 if not CUDA else 1e-4,
                                   atol=0 if not CUDA else 1e-5)
    merged, merged_ddp = weights(fsdp), weights(ddp)
    assert merged.keys() == merged_ddp.keys() and not any("lora" in k for k in merged)
    for name in merged:
        torch.testing.assert_close(merged[name], merged_ddp[name], rtol=0 if not CUDA else 1e-4,
                                   atol=0 if not CUDA else 1e-5)
    text = pipeline("text-generation", model=str(fsdp / "model"), device="cpu")("the king", max_new_tokens=4,
                                                                                 do_sample=False)[0]["generated_text"]
    assert text.startswith("the king")

    proc = crash_then_resume(hf_home, lora_lm_args(pretrained_lm, corpus, resumed, *common,
                                                   "distributed.strategy=fsdp"), 10, launch="fsdp.yaml",
                             launch_args=launch())
    assert "resuming from" in proc.stdout and "step_8" in proc.stdout
    again = load_file(resumed / "model" / "adapter" / "adapter_model.safetensors")
    for name in adapter:
        assert torch.equal(adapter[name], again[name]) or CUDA, name
    if not CUDA:
        assert losses_by_step(resumed) == losses_by_step(fsdp)


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="two machines on one host: gloo")
def test_two_machines_of_one_process_train_what_one_machine_of_two_does(fsdp_run, hf_home, tmp_path):
    """accelerate_configs/multi_node.yaml, machine ranks 0 and 1 on this host, one process each, strategy fsdp."""
    out, args, _ = fsdp_run
    two = tmp_path / "two_machines"
    main, _ = run_ok(machines([*into(args, two), "distributed.strategy=fsdp"], 2, hf_home, free_port()))
    assert "num_processes: 2" in main and "strategy: fsdp (version 2)" in main
    same_weights(out, two)
    assert losses_by_step(two) == losses_by_step(out)


@pytest.mark.slow
def test_unpacked_rows_under_fsdp2_train_what_one_process_with_twice_the_batch_does(cli_module, hf_home, corpus,
                                                                                     word_tokenizer, tmp_path):
    """data.packing=false: one padded document per row, so each process's micro-batch has its own count of target
    tokens. The loss is normalised by the step's targets over both processes (token-exact), which is what makes
    2 processes equal one process holding both halves of the batch (a mean of each process's mean would weigh the
    rows of the process with fewer targets more: relative gradient errors of the order of the count imbalance).
    Each process pads its 4 rows to their own longest, one process its 8 to the longest of all: other shapes, so
    other fp32 roundings, and more of them than packed: measured over 12 steps, FSDP2 vs one process 1.7e-6 (loss)
    and 3.5e-5 (weights), DDP vs one process 1.3e-5 and 7.4e-5. The weights are held to 1e-4."""
    unpacked = [*COMMON, "data.packing=false"]
    fsdp, one = tmp_path / "fsdp", tmp_path / "one"
    cli_module(lm_args(word_tokenizer, corpus, fsdp, *unpacked), launch="fsdp.yaml", launch_args=launch())
    train_ok(lm_args(word_tokenizer, corpus, one, *unpacked, "train.batch_size=8"), hf_home)
    assert_trains_alike(fsdp, one, weight_tolerance=dict(rtol=1e-4, atol=1e-4))


@pytest.mark.slow
def test_streaming_under_fsdp2_trains_what_ddp_does(hf_home, corpus, word_tokenizer, tmp_path):
    """data.streaming: each process reads its own share of the stream; the token-normalised loss over both."""
    stream = [*COMMON, "data.streaming=true", "data.shuffle_buffer=16", "eval.batches=2"]
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    runs = {"fsdp": lm_args(word_tokenizer, corpus, fsdp, *stream, "distributed.strategy=fsdp"),
            "ddp": lm_args(word_tokenizer, corpus, ddp, *stream, "distributed.strategy=ddp")}
    procs = runs_in_one_launch(hf_home, runs, DDP_LAUNCH, tmp_path / "launch")
    assert all(p.returncode == 0 for p in procs.values()), procs
    assert_trains_alike(fsdp, ddp)


@pytest.mark.slow
@pytest.mark.skipif(CUDA and torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_hsdp_on_a_2_by_2_mesh_trains_what_4_ddp_processes_do(hf_home, corpus, word_tokenizer, tmp_path):
    """distributed.fsdp.replicas=2 on 4 processes: 2 replicas, each sharded over 2 processes (accelerate's
    ParallelismConfig dp_replicate_size=2 x dp_shard_size=2); each process holds half of the states."""
    common = [*COMMON, "train.max_steps=8"]
    hsdp, ddp = tmp_path / "hsdp", tmp_path / "ddp"
    runs = {"hsdp": lm_args(word_tokenizer, corpus, hsdp, *common, "distributed.strategy=fsdp",
                            "distributed.fsdp.replicas=2"),
            "ddp": lm_args(word_tokenizer, corpus, ddp, *common, "distributed.strategy=ddp")}
    procs = runs_in_one_launch(hf_home, runs, DDP_LAUNCH, tmp_path / "launch", processes=4)
    assert all(p.returncode == 0 for p in procs.values()), procs
    assert "strategy: fsdp (version 2, HSDP: 2 replicas x 2 shards)" in procs["hsdp"].stdout
    assert_trains_alike(hsdp, ddp)
    result = summary(hsdp)
    held, plan = result["memory"]["per_device"], result["memory_plan"]
    assert plan["shards"] == 2 and held["weight_bytes"] == plan["weight_bytes"]
    assert 0.5 <= held["weight_bytes"] / result["memory"]["weight_bytes"] < 0.51


# ------------------------------------------------ the tiny Llama: tensor parallelism (make test), QLoRA (slow)


def test_tensor_parallel_on_2_processes_trains_what_one_process_does(tp_llama_run, llama_one_process):
    """distributed.tensor_parallel=2: accelerate's ParallelismConfig(tp_size=2) (backend.build._tensor_parallel) and the tiny
    Llama sharded by transformers' own tensor-parallel plan (colwise q/k/v/gate/up, rowwise o/down, the vocabulary
    of the embedding and the head). The output layer is tied to the embedding (SmolLM2's, most small chat
    models'): the plan shards the two alike, each as a parameter of its own, and the run ties them again to one
    sharded matrix (backend.build.tensor_parallel_model), which model/ holds once. Both processes train on the same batches, so the run is one process's with the
    same batch: the rowwise layers' all-reduce sums each product's two halves where one process sums it whole, the
    same fp32 rounding as DDP's (measured over 12 steps: losses within 2.6e-7, weights within 3.1e-6), hence the
    tolerances above. Each process holds half of each sharded matrix and its gradient and AdamW moments (the norms
    stay whole: 0.504 of the bytes), as the memory plan says; model/ is the whole model, gathered, that pipeline()
    loads."""
    from transformers import pipeline

    (tp, _, proc), one = tp_llama_run, llama_one_process
    assert "strategy: tensor parallel (2 processes)" in proc.stdout and "effective_batch: 4" in proc.stdout
    assert len(losses_by_step(tp)) == 12
    assert_trains_alike(tp, one)  # each weight whole, not a shard: assert_close compares shapes too
    w = weights(tp)
    assert "lm_head.weight" not in w  # tied: the matrix once
    result, result_one = summary(tp), summary(one)
    assert result["eval"]["tokens"] == result_one["eval"]["tokens"]  # each process evaluated all: counted once
    assert result["eval"]["loss"] == pytest.approx(result_one["eval"]["loss"], rel=1e-5)
    assert result["train"]["samples"] == result_one["train"]["samples"]
    measured, plan = result["memory"], result["memory_plan"]
    for key in ("weight_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert 0.5 <= measured["per_device"][key] / measured[key] < 0.51, key
    held = measured["per_device"]
    assert held["weight_bytes"] == plan["weight_bytes"] and held["gradient_bytes"] == plan["gradient_bytes"]
    assert held["optimizer_state_bytes"] - plan["optimizer_state_bytes"] == 4 * len(w)  # AdamW's step counters
    text = pipeline("text-generation", model=str(tp / "model"), device="cpu")("the cat", max_new_tokens=3,
                                                                               do_sample=False)[0]["generated_text"]
    assert text.startswith("the cat")


def test_a_tensor_parallel_checkpoint_resumes_bitwise(tp_llama_run, hf_home, tmp_path):
    """Each process writes its shards of the sharded matrices (DTensors) into the checkpoint's states; the run
    resumed from step 4 on the same layout ends bitwise where the uninterrupted run ends."""
    tp, args, _ = tp_llama_run
    states = tp / "checkpoints" / "step_4" / "states"
    assert len(list(states.glob("*.distcp"))) == 2
    resumed = tmp_path / "resumed"
    proc = cli_runner(hf_home)([*into(args, resumed), f"checkpoint.resume={states.parent}"], launch=DDP_LAUNCH,
                               launch_args=launch())
    assert f"resuming from {states.parent}: step 4" in proc.stdout
    same_weights(resumed, tp)
    if not CUDA:
        assert losses_by_step(resumed) == {k: v for k, v in losses_by_step(tp).items() if k > 4}


def test_fsdp2_with_activation_checkpointing_on_the_tied_llama_trains_what_one_process_does(
        cli_module, corpus, word_tokenizer, llama_one_process, tmp_path):
    """SmolLM2's shape under FSDP2 (the Llama's decoder layers wrapped, the output layer tied to the sharded
    embedding) with each layer recomputed in backward (train.gradient_checkpointing, the plugin's activation
    checkpointing): 2 processes of half the batch train what one process with the whole batch does, to the
    tolerances above; model/ holds the tied matrix once and pipeline() loads it."""
    from transformers import pipeline

    out = tmp_path / "fsdp"
    proc = cli_module(llama_args(word_tokenizer, corpus, out, "distributed.strategy=fsdp", "train.batch_size=2",
                                 "train.gradient_checkpointing=true"), launch="fsdp.yaml", launch_args=launch())
    assert "strategy: fsdp (version 2)" in proc.stdout and "effective_batch: 4" in proc.stdout
    assert summary(out)["memory_plan"]["gradient_checkpointing"] is True
    assert len(losses_by_step(out)) == 12
    assert_trains_alike(out, llama_one_process)
    assert "lm_head.weight" not in weights(out)
    text = pipeline("text-generation", model=str(out / "model"), device="cpu")("the cat", max_new_tokens=3,
                                                                                do_sample=False)[0]["generated_text"]
    assert text.startswith("the cat")


@pytest.mark.slow
def test_qlora_under_fsdp2_trains_what_ddp_does(hf_home, corpus, llama_one_process, tmp_path):
    """peft.quantize=4bit (NF4 bitsandbytes Linear4bit) on the tiny tied Llama under FSDP2: accelerate 1.15 leaves the
    frozen uint8 Params4bit out of fully_shard (its DTensor conversion would drop their quant_state; with a float
    quant_storage bitsandbytes then failed "quant_state is required", measured), so each process holds the whole
    4-bit base and FSDP2 shards the rest (the adapters, the embedding and the head tied to it, the norms). The
    adapters train what DDP's do, bitwise on the CPU (as LoRA's: only the adapters' gradients are reduced). Killed
    after step 3's checkpoint, the same command resumes to the same adapters and losses, bitwise: the 4-bit layers'
    quantization state in the checkpoint, which no layer loads, is checked against the layers' own and set aside."""
    common = ["--config", str(ROOT / "tests" / "tiny_lm.yaml"), "model.config=null",
              f"model.name_or_path={llama_one_process / 'model'}", f"data.train_file={corpus}", BACKEND, "peft.r=4",
              "peft.alpha=8", "peft.target_modules=all-linear", "peft.quantize=4bit", "train.max_steps=6",
              "train.log_every=1", "train.cpu_threads=1", "checkpoint.every_steps=3"]
    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    procs = runs_in_one_launch(hf_home, {"fsdp": [*common, f"output_dir={fsdp}", "distributed.strategy=fsdp"],
                                         "ddp": [*common, f"output_dir={ddp}"]}, DDP_LAUNCH, tmp_path / "launch")
    assert all(p.returncode == 0 for p in procs.values()), procs
    assert "strategy: fsdp (version 2)" in procs["fsdp"].stdout
    exact = dict(rtol=0, atol=0) if not CUDA else WEIGHT_TOLERANCE
    torch.testing.assert_close(torch.tensor(list(losses_by_step(fsdp).values())),
                               torch.tensor(list(losses_by_step(ddp).values())), **exact)
    adapter = load_file(fsdp / "model" / "adapter_model.safetensors")
    expected = load_file(ddp / "model" / "adapter_model.safetensors")
    assert adapter.keys() == expected.keys() and any("lora_A" in k for k in adapter)
    for name in adapter:
        torch.testing.assert_close(adapter[name], expected[name], **exact, msg=lambda m: f"{name}: {m}")
    resumed = tmp_path / "resumed"
    proc = crash_then_resume(hf_home, [*common, f"output_dir={resumed}", "distributed.strategy=fsdp"],
                             kill_at_micro=5, launch="fsdp.yaml", launch_args=launch())
    assert "resuming from" in proc.stdout and "step_3" in proc.stdout
    assert losses_by_step(resumed) == losses_by_step(fsdp)
    again = load_file(resumed / "model" / "adapter_model.safetensors")
    assert all(torch.equal(again[name], adapter[name]) for name in adapter)
    result = summary(fsdp)["memory"]
    # The 4-bit base is smaller than the fp32 layers it replaced, and held whole: more than half on each process.
    assert result["weight_bytes"] < summary(llama_one_process)["memory"]["weight_bytes"]
    assert 0.5 < result["per_device"]["weight_bytes"] / result["weight_bytes"] < 1

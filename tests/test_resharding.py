"""A checkpoint resumes on another topology and continues the same run (framework/resharding.py,
framework/backend/states.py): 2 processes -> 1 (the accumulation doubled), 1 -> 2 (the per-device batch halved), DDP ->
FSDP2, FSDP2 -> DDP, tensor parallelism -> DDP, and an online-RL run 2 -> 1. Each resumes step 4's checkpoint of a
12-step run made on the first layout (``checkpoint.resume``) on the second, and ends where that uninterrupted run
ends: the logged losses after the resume and the saved weights within the bounds the task contract holds one process
and two to (a different split of the same sums: tests/sharding.py), the same completions drawn by the RL run. The
plan says what changed in one line; a layout that cannot keep the effective batch, a stream, and DeepSpeed's own
checkpoints are refused by key. Each transition prints the largest weight difference and the time the checkpoint
took to load (for the notes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import ROOT, cli_runner, grpo_args, lm_args, losses_by_step, read_metrics, summary, weights
from in_process import run_captured
from sharding import COMMON, CUDA, DDP_LAUNCH, LOSS_TOLERANCE, WEIGHT_TOLERANCE, launch, llama_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(CUDA, reason="the CPU processes' layouts")]


def step_4(run: Path) -> str:
    return f"checkpoint.resume={run / 'checkpoints' / 'step_4'}"


def assert_continues(resumed: Path, whole: Path, name: str) -> None:
    """``resumed`` (from step 4) ends where ``whole`` does: its losses from step 5 on and its weights."""
    a, b = losses_by_step(resumed), losses_by_step(whole)
    after = [step for step in b if step > 4]
    assert sorted(a) == after, (sorted(a), after)  # the resumed run's own log starts after its checkpoint
    torch.testing.assert_close(torch.tensor([a[s] for s in after]), torch.tensor([b[s] for s in after]),
                               **LOSS_TOLERANCE)
    wa, wb = weights(resumed), weights(whole)
    assert wa.keys() == wb.keys()
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], **WEIGHT_TOLERANCE, msg=lambda m: f"{key}: {m}")
    print(f"{name}: largest weight difference from the uninterrupted run {worst:.2e}, checkpoint loaded in "
          f"{summary(resumed)['train']['resume_load_seconds']:.2f} s")


@pytest.fixture(scope="module")
def one_lm_run(tmp_path_factory, word_tokenizer, corpus, hf_home) -> Path:
    """The common run on one process with the whole batch (8): what 2 processes of 4 train."""
    out = tmp_path_factory.mktemp("one_lm") / "out"
    proc = run_captured(lm_args(word_tokenizer, corpus, out, *COMMON, "train.batch_size=8"), hf_home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_two_processes_resume_on_one_with_the_accumulation_doubled(ddp_lm_run, word_tokenizer, corpus, hf_home,
                                                                    tmp_path):
    out = tmp_path / "one"
    proc = run_captured(lm_args(word_tokenizer, corpus, out, *COMMON, "distributed.strategy=ddp", step_4(ddp_lm_run)),
                        hf_home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("resuming 2 process(es), ddp, 4 per device x 1 accumulation x 2 replica(s) = 8 as 1 process(es), single "
            "process, 4 per device x 2 accumulation x 1 replica(s) = 8: train.gradient_accumulation_steps 1 -> 2 keep "
            "its effective batch of 8") in proc.stdout
    assert summary(out)["plan"]["gradient_accumulation_steps"] == 2
    assert_continues(out, ddp_lm_run, "2 processes -> 1")


def test_one_process_resumes_on_two_with_the_batch_halved(one_lm_run, word_tokenizer, corpus, hf_home, tmp_path):
    out = tmp_path / "two"
    proc = cli_runner(hf_home)(lm_args(word_tokenizer, corpus, out, *COMMON, "train.batch_size=8",
                                       step_4(one_lm_run)), launch=DDP_LAUNCH, launch_args=launch())
    assert "train.batch_size 8 -> 4 keep its effective batch of 8" in proc.stdout
    assert summary(out)["num_processes"] == 2
    assert_continues(out, one_lm_run, "1 process -> 2")


def test_ddp_resumes_under_fsdp2_and_fsdp2_under_ddp(ddp_lm_run, fsdp_lm_run, word_tokenizer, corpus, hf_home,
                                                     tmp_path):
    cli = cli_runner(hf_home)
    to_fsdp, to_ddp = tmp_path / "to_fsdp", tmp_path / "to_ddp"
    proc = cli(lm_args(word_tokenizer, corpus, to_fsdp, *COMMON, "distributed.strategy=fsdp", step_4(ddp_lm_run)),
               launch="fsdp.yaml", launch_args=launch())
    assert "strategy: fsdp (version 2)" in proc.stdout and "as 2 process(es), fsdp" in proc.stdout
    assert_continues(to_fsdp, ddp_lm_run, "DDP -> FSDP2")
    fsdp_out = fsdp_lm_run[0]
    proc = cli(lm_args(word_tokenizer, corpus, to_ddp, *COMMON, "distributed.strategy=ddp", step_4(fsdp_out)),
               launch=DDP_LAUNCH, launch_args=launch())
    assert "strategy: ddp" in proc.stdout
    assert_continues(to_ddp, fsdp_out, "FSDP2 -> DDP")


def test_tensor_parallel_resumes_under_ddp(tp_llama_run, word_tokenizer, corpus, hf_home, tmp_path):
    """2 tensor-parallel processes make one replica of 4 examples a step; 2 DDP processes split them 2 and 2."""
    tp_out, _, _ = tp_llama_run
    out = tmp_path / "ddp"
    proc = cli_runner(hf_home)(llama_args(word_tokenizer, corpus, out, step_4(tp_out)), launch=DDP_LAUNCH,
                               launch_args=launch())
    assert "train.batch_size 4 -> 2 keep its effective batch of 4" in proc.stdout
    assert_continues(out, tp_out, "TP -> DDP")


def test_an_online_rl_run_resumes_on_one_process_drawing_the_same_rollouts(pair_tokenizer, pair_data, hf_home,
                                                                           tmp_path):
    """GRPO on 2 processes (4 prompts each), resumed from step 4 on one process (8 prompts, accumulation 2): every
    later step draws the same completions (its rewards and lengths equal), and it ends where the 2-process run ends."""
    common = ["train.max_steps=8", "checkpoint.every_steps=4", "train.cpu_threads=1", "optim.name=sgd", "optim.lr=0.5",
              "train.max_grad_norm=null"]
    two, one = tmp_path / "two", tmp_path / "one"
    cli_runner(hf_home)(grpo_args(pair_tokenizer, pair_data, two, *common), launch=DDP_LAUNCH, launch_args=launch())
    proc = run_captured(grpo_args(pair_tokenizer, pair_data, one, *common, step_4(two)), hf_home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train.gradient_accumulation_steps 1 -> 2 keep its effective batch of 8" in proc.stdout
    a, b = ([r for r in read_metrics(out) if "loss" in r and r["step"] > 4] for out in (one, two))
    for key in ("reward", "reward_std", "completions/mean_length", "completions/max_length"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-6), key
    assert_continues(one, two, "GRPO 2 processes -> 1")


def test_layouts_that_cannot_continue_the_run_are_refused_by_key(ddp_lm_run, word_tokenizer, corpus, hf_home,
                                                                 tmp_path):
    """8 examples a step over 3 replicas: no whole split; refused naming the key, with the numbers, nothing written."""
    out = tmp_path / "three"
    proc = cli_runner(hf_home)(lm_args(word_tokenizer, corpus, out, *COMMON, "distributed.strategy=ddp",
                                       step_4(ddp_lm_run)), launch=DDP_LAUNCH, launch_args=launch(3), check=False)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr and "[rank0]: Traceback" not in proc.stderr, \
        proc.stderr[-3000:]
    assert ("train.gradient_accumulation_steps: the checkpoint trained with an effective batch of 8 examples per "
            "optimizer step, which 3 data-parallel replica(s) cannot split") in proc.stderr
    assert not (out / "summary.json").exists()


def test_a_length_grouped_batch_that_cannot_split_names_the_counts_that_can():
    """The default recipe groups batches by length, so its batches keep their size (32) on another process count:
    its effective batch of 32 cannot continue on 2 replicas, and the refusal names the count that can (1), not a
    divisor rule the grouping does not follow."""
    from framework.errors import UserError
    from framework.recipe import load_config
    from framework.resharding import split

    cfg = load_config(ROOT / "recipes" / "text_classification.yaml", [])
    assert cfg.data.group_by_length and cfg.train.batch_size == 32
    with pytest.raises(UserError) as refused:
        split(32, 2, cfg, lambda candidate: [])
    assert "(data.group_by_length); launch 1 data-parallel replica(s), or choose a new output_dir" in str(refused.value)
    assert split(64, 2, cfg, lambda candidate: []).train.gradient_accumulation_steps == 1

"""Preference tuning (task dpo): the loss, rewards and reward accuracy equal TRL's DPOTrainer (sigmoid, ipo) and
CPOTrainer (simpo) on a fixed batch; training through the real CLI raises reward accuracy; the three ways of
having a reference (a frozen copy, peft's adapter switched off, precomputed log-probabilities) give the same
run; bad rows are refused naming the key (tests/test_task_contract.py: 1 process = 2 = accumulation, exact
resume, a chosen answer equal to the rejected one)."""

import copy
import json
from pathlib import Path

import pytest
import torch

from helpers import (ROOT, STEADY_XLA, assert_no_graph_after_the_first_evaluation, dpo_args, losses_by_step, pairs,
                     read_metrics, summary, write_jsonl)
from in_process import run_main

GPT2 = ROOT / "assets" / "gpt2-tokenizer"
# A fixed batch for the comparisons with TRL: uneven prompts and completions, completions of several tokens,
# and a prompt ending mid-word (its last token merges with the completion's first: TRL's common prefix).
ROWS = [
    {"prompt": "Review: the movie was good.\nSentiment:", "chosen": " fresh", "rejected": " rotten"},
    {"prompt": "Review: a dull film with some music.\nSentiment:", "chosen": " rotten", "rejected": " fresh, fresh"},
    {"prompt": "Review: lovely sto", "chosen": "ry and a great ending. Fresh", "rejected": "p it. Rotten"},
    {"prompt": "Review: boring", "chosen": " and rotten", "rejected": " but very fine, superb acting"},
]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, pair_tokenizer) -> Path:
    """A tiny GPT-2 (random, seeded) saved with the word tokenizer: a pretrained model for LoRA to adapt."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("tiny_gpt2")
    tokenizer = AutoTokenizer.from_pretrained(pair_tokenizer)
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def gpt2_config(tokenizer):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_head=2, n_embd=32, n_positions=64, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


# ---------------------------------------------------------------- TRL


def gpt2_models():
    """A GPT-2 tokenizer, a tiny policy and a differently seeded reference (so the rewards are not zero)."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    if not (GPT2 / "tokenizer.json").exists():
        pytest.fail(f"{GPT2} is missing: run `make install` (or `python tools/assets.py assets`)")
    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(gpt2_config(tokenizer))
    torch.manual_seed(1)
    reference = GPT2LMHeadModel(gpt2_config(tokenizer)).eval()
    return tokenizer, policy, reference


def ours(tokenizer, policy, reference, batch_or_rows, **dpo):
    """Our per-pair outputs and metrics: from raw rows (prepared and collated by the task), or from a batch."""
    import datasets

    from framework.config import DataConfig
    from framework.recipe import schema
    from framework.tasks import get_task
    from framework.tasks.completions import Reference
    from framework.tasks.dpo import DpoConfig, DpoRun

    cfg = schema()(task="dpo", data=DataConfig(max_length=1024), dpo=DpoConfig(**dpo))
    task = get_task("dpo")
    run = DpoRun(task, cfg, reference=Reference(reference) if reference is not None else None)
    if isinstance(batch_or_rows, list):
        features = task.prepare(datasets.Dataset.from_list(batch_or_rows), tokenizer, policy, cfg)
        batch = task.collator(tokenizer, cfg, None)(list(features))
    else:
        batch = batch_or_rows
    with torch.no_grad():
        outputs = run.eval_outputs(policy, batch)
    return batch, run.metrics({k: v.numpy() for k, v in outputs.items()})


def assert_metrics_equal_trl(mine: dict, trl: dict, loss: float, logps: bool = True) -> None:
    """Ours against TRL's logged figures, each within 1e-5; ``logps``: the summed log-probabilities too (CPOTrainer
    logs per-token means for simpo, which its rewards, beta times them, already compare)."""
    got = {"loss": mine["loss"], "rewards/chosen": mine["rewards_chosen"], "rewards/rejected": mine["rewards_rejected"],
           "rewards/accuracies": mine["reward_accuracy"], "rewards/margins": mine["reward_margin"]}
    if logps:
        got.update({"logps/chosen": mine["logps_chosen"], "logps/rejected": mine["logps_rejected"]})
    want = {"loss": loss, **{k: trl[k] for k in got if k != "loss"}}
    print("TRL differences:", {key: got[key] - want[key] for key in got})
    for key in got:
        assert abs(got[key] - want[key]) <= 1e-5, (key, got[key], want[key])
    assert 0 < mine["reward_accuracy"] < 1 and abs(mine["reward_margin"]) > 1e-3  # a batch that tells apart


def test_dpo_and_ipo_equal_trl_dpo_trainer(tmp_path):
    """TRL's DPOTrainer tokenizes the same rows and computes its loss and logged metrics on its own batch, for
    sigmoid and then ipo (one trainer: building one takes seconds): the token sequences and completion masks are
    ours, and the figures equal ours within 1e-5."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    tokenizer, policy, reference = gpt2_models()
    args = DPOConfig(output_dir=str(tmp_path), beta=0.3, loss_type=["sigmoid"], per_device_train_batch_size=len(ROWS),
                     report_to=[], use_cpu=True, bf16=False, max_length=1024)
    trainer = DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                         train_dataset=datasets.Dataset.from_list(ROWS), processing_class=tokenizer)
    trl_batch = next(iter(trainer.get_train_dataloader()))

    def sequences(input_ids, attention_mask, completion_mask):
        return sorted((tuple(i[m.bool()].tolist()), tuple(c[m.bool()].tolist()))
                      for i, m, c in zip(input_ids, attention_mask, completion_mask))

    for loss in ("sigmoid", "ipo"):
        trainer.loss_types = [loss]  # what DPOConfig(loss_type=[loss]) sets
        with torch.no_grad():
            trl_loss = float(trainer.compute_loss(trainer.model, trl_batch))
        trl = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        batch, mine = ours(tokenizer, policy, reference, ROWS, loss=loss, beta=0.3)
        completion = (batch["labels"] != -100).long()
        assert sequences(batch["input_ids"], batch["attention_mask"], completion) == sequences(
            trl_batch["input_ids"], trl_batch["attention_mask"], trl_batch["completion_mask"])
        assert_metrics_equal_trl(mine, trl, trl_loss)


def test_simpo_equals_trl_cpo_trainer(tmp_path):
    """SimPO is TRL's CPOTrainer with loss_type simpo and cpo_alpha 0 (no NLL term): on CPOTrainer's own batch
    (its tokenization differs from DPOTrainer's), our loss and metrics equal its within 1e-5."""
    import datasets
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tokenizer, policy, _ = gpt2_models()
    args = CPOConfig(output_dir=str(tmp_path), beta=2.0, loss_type="simpo", simpo_gamma=0.7, cpo_alpha=0.0,
                     per_device_train_batch_size=len(ROWS), report_to=[], use_cpu=True, bf16=False)
    trainer = CPOTrainer(model=copy.deepcopy(policy), args=args, train_dataset=datasets.Dataset.from_list(ROWS),
                         processing_class=tokenizer)
    trl_batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        trl_loss, trl = trainer.get_batch_loss_metrics(trainer.model, trl_batch)
    joined = trainer.concatenated_inputs(trl_batch, is_encoder_decoder=False, padding_value=tokenizer.pad_token_id)
    batch = {"input_ids": joined["concatenated_input_ids"], "attention_mask": joined["concatenated_attention_mask"],
             "labels": joined["concatenated_labels"]}
    _, mine = ours(tokenizer, policy, None, batch, loss="simpo", beta=2.0, simpo_gamma=0.7)
    assert_metrics_equal_trl(mine, trl, float(trl_loss), logps=False)


@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_chunked_log_probabilities_equal_full_logits(loss):
    """The sequences' log-probabilities through framework/losses.py (the head 7 tokens at a time, the GPT-2 head
    tied to the embeddings) give the full logits' loss and gradients within 1e-6 relative (fp32)."""
    import datasets

    from framework import losses
    from framework.config import DataConfig
    from framework.recipe import schema
    from framework.tasks import get_task
    from framework.tasks.completions import Reference
    from framework.tasks.dpo import DpoConfig, DpoRun
    from helpers import grads, relative, worst_gradient

    tokenizer, policy, reference = gpt2_models()
    assert losses.output_head(policy) is policy.lm_head  # the chunked path is taken
    cfg = schema()(task="dpo", data=DataConfig(max_length=1024), dpo=DpoConfig(loss=loss, beta=0.3))
    declared = get_task("dpo")
    full = DpoRun(declared, cfg, reference=None if loss == "simpo" else Reference(reference))
    features = declared.prepare(datasets.Dataset.from_list(ROWS), tokenizer, policy, cfg)
    batch = declared.collator(tokenizer, cfg, None)(list(features))
    results = []
    # One thread: with two, BLAS splits a 7-row chunk's product over the 50k-term vocabulary sum (softmax minus
    # one-hot: its terms cancel), the full logits' product over rows, so the two sum in other orders: measured
    # 4.2e-6 relative then, against 3.8e-7 (sigmoid) and 5.8e-7 (simpo) with one thread, where the full path itself
    # moves 2.2e-7 from one thread to two. The bound measures the chunking, not BLAS's threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for chunk in (None, 7):
            task = copy.copy(full)
            task.loss_chunk = chunk
            policy.zero_grad()
            value = task.loss_sum(policy, batch)
            value.backward()
            results.append((value.detach(), grads(policy)))
    finally:
        torch.set_num_threads(threads)
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # Each parameter's gradient by its norm, as tests/test_losses.py measures the chunked loss.
    worst = worst_gradient(got_grads, want_grads)
    print(f"dpo {loss}: chunked loss {relative(got, want):.1e}, gradients {worst:.1e} relative")
    # sigmoid's gradient is a difference of chosen and rejected log-probabilities' gradients (they cancel): on an
    # AMD EPYC (AVX2) it measured 1.3e-6 on one thread, every run, where an AVX-512 machine gave 3.8e-7.
    assert worst < 2e-6


# ---------------------------------------------------------------- runs


def test_dpo_raises_reward_accuracy_and_reports_it(hf_home, pair_tokenizer, pair_data, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_main(dpo_args(pair_tokenizer, pair_data, out, "eval.every_steps=10"), hf_home) == 0
    printed = capsys.readouterr().out
    s = summary(out)
    assert "frozen models (the task's reference, never trained)" in printed  # the plan counts the reference
    assert s["memory_plan"]["frozen_model_bytes"] == s["memory"]["weight_bytes"] > 0
    evals = [r for r in read_metrics(out) if "eval_reward_accuracy" in r]
    assert evals[-1]["eval_reward_accuracy"] >= 0.9 and s["eval"]["reward_accuracy"] == evals[-1]["eval_reward_accuracy"]
    assert s["eval"]["reward_margin"] > 0.5 and s["eval"]["rewards_chosen"] > s["eval"]["rewards_rejected"]
    assert s["eval"]["logps_chosen"] > s["eval"]["logps_rejected"] and s["eval"]["pairs"] == 20
    assert s["sample"]["prompt"].startswith("review :") and (out / "model" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["ipo", "simpo"])
def test_ipo_and_simpo_train(hf_home, pair_tokenizer, pair_data, tmp_path, loss):
    out = tmp_path / loss
    extra = ["dpo.beta=2.0"] if loss == "simpo" else []
    assert run_main(dpo_args(pair_tokenizer, pair_data, out, f"dpo.loss={loss}", *extra), hf_home) == 0
    s = summary(out)
    assert s["eval"]["reward_accuracy"] >= 0.8, s["eval"]
    assert s["memory_plan"]["frozen_model_bytes"] == (0 if loss == "simpo" else s["memory"]["weight_bytes"])


def test_a_precomputed_reference_equals_the_frozen_copy(hf_home, pair_tokenizer, pair_data, tmp_path):
    """The reference's log-probabilities computed once before training (one model in memory) give the run that
    a frozen copy computing them at every step gives."""
    copy_run, precomputed = tmp_path / "copy", tmp_path / "precomputed"
    common = ["train.max_steps=12", "train.log_every=2"]
    assert run_main(dpo_args(pair_tokenizer, pair_data, copy_run, *common), hf_home) == 0
    assert run_main(dpo_args(pair_tokenizer, pair_data, precomputed, *common, "dpo.precompute_reference=true"),
                    hf_home) == 0
    assert summary(precomputed)["memory_plan"]["frozen_model_bytes"] == 0
    a, b = losses_by_step(copy_run), losses_by_step(precomputed)
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-5 for k in a)
    for key, value in summary(copy_run)["eval"].items():
        assert abs(summary(precomputed)["eval"][key] - value) < 1e-5, key


def test_lora_reference_is_the_base_with_the_adapter_off(hf_home, pair_tokenizer, pretrained, pair_data, tmp_path):
    """Under peft no copy is made: the reference is the model with its adapter switched off, which is the
    starting model: the same run as with its log-probabilities precomputed from the model as loaded."""
    lora = ["model.config=null", f"model.name_or_path={pretrained}", "model.tokenizer=null", "peft.r=4",
            "optim.lr=1e-2", "train.max_steps=12", "train.log_every=2"]
    adapter_off, precomputed = tmp_path / "adapter_off", tmp_path / "precomputed"
    assert run_main(dpo_args(pair_tokenizer, pair_data, adapter_off, *lora), hf_home) == 0
    assert run_main(dpo_args(pair_tokenizer, pair_data, precomputed, *lora, "dpo.precompute_reference=true"),
                    hf_home) == 0
    s = summary(adapter_off)
    assert s["memory_plan"]["frozen_model_bytes"] == 0 and s["memory"]["trainable_parameters"] < 10_000
    a, b = losses_by_step(adapter_off), losses_by_step(precomputed)
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-5 for k in a)
    assert abs(s["eval"]["reward_margin"] - summary(precomputed)["eval"]["reward_margin"]) < 1e-5
    assert s["eval"]["reward_margin"] > 0 and (adapter_off / "model" / "adapter_config.json").exists()


def bad_rows(case: str):
    rows = pairs(40, seed=2)
    if case == "empty":
        rows[5]["chosen"] = "  "
    elif case == "missing":
        rows = [{"prompt": r["prompt"], "chosen": r["chosen"]} for r in rows]
    elif case == "mixed":
        rows[3]["chosen"] = [{"role": "assistant", "content": "fresh"}]
        rows = [{**r, "chosen": json.dumps(r["chosen"]) if isinstance(r["chosen"], list) else r["chosen"]} for r in rows]
    elif case == "conversation":
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                 "chosen": [{"role": "assistant", "content": r["chosen"]}],
                 "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]
    return rows


@pytest.mark.parametrize("case,message", [
    ("empty", "dpo.chosen_column: the row with prompt 'review : "),
    ("missing", "dpo.rejected_column: column 'rejected' is not in data.train_file"),
    ("conversation", "data.chat_template: the tokenizer has no chat template of its own"),
    ("mixed", "dpo.prompt_column: the row with prompt 'review : "),
])
def test_bad_pairs_are_refused_naming_the_key(hf_home, pair_tokenizer, tmp_path, capsys, case, message):
    data = write_jsonl(tmp_path / "bad.jsonl", bad_rows(case))
    assert run_main(dpo_args(pair_tokenizer, data, tmp_path / "out"), hf_home) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "out" / "summary.json").exists()


def test_bad_dpo_keys_are_refused(hf_home, pair_tokenizer, pair_data, tmp_path, capsys):
    args = dpo_args(pair_tokenizer, pair_data, tmp_path / "out", "dpo.loss=simpo", "dpo.precompute_reference=true",
                    "dpo.beta=0")
    assert run_main(args, hf_home) == 2
    err = capsys.readouterr().err
    assert "dpo.precompute_reference: simpo has no reference model" in err and "dpo.beta: 0.0 is out of range" in err


# ---------------------------------------------------------------- XLA


@pytest.mark.xla
def test_dpo_on_xla_matches_the_cpu_and_compiles_a_bounded_number_of_graphs(cli, pair_tokenizer, pair_data, tmp_path,
                                                                            monkeypatch):
    """Pairs padded to one length (chosen and rejected in one batch, the reference in the same graph): no graph
    compiled after the first evaluation, and the losses are the CPU backend's."""
    pytest.importorskip("torch_xla", reason="torch_xla is not installed: run `make test-xla`")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    common = ["data.pad_buckets=[32]", *STEADY_XLA]
    xla, cpu = tmp_path / "xla", tmp_path / "cpu"
    cli(dpo_args(pair_tokenizer, pair_data, xla, "backend=auto", *common), timeout=1800)
    cli(dpo_args(pair_tokenizer, pair_data, cpu, "backend=cpu", "data.padding=buckets", *common))
    a, c = summary(xla), summary(cpu)
    assert a["backend"] == "xla" and c["backend"] == "cpu"
    assert_no_graph_after_the_first_evaluation(xla)
    assert a["xla"]["transfers_in_steps"] == 0
    xla_losses, cpu_losses = losses_by_step(xla), losses_by_step(cpu)
    assert xla_losses.keys() == cpu_losses.keys()
    torch.testing.assert_close(torch.tensor(list(xla_losses.values())), torch.tensor(list(cpu_losses.values())),
                               rtol=1e-4, atol=1e-5)
    assert a["eval"]["reward_margin"] == pytest.approx(c["eval"]["reward_margin"], rel=1e-3, abs=1e-5)

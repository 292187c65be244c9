"""Language models: packed documents never see each other (logits and loss equal per-document ones, GPT-2 and
Llama), causal and masked LMs train through the real CLI and export to a pipeline, masks are drawn per example,
and bad input is refused by key. What every task promises (1 process = 2 = accumulation, exact resume) is
tests/test_task_contract.py's."""

import json

import pytest
import torch

from helpers import (documents, lm_args, mlm_args, packed_batch, read_metrics, segments, summary,
                     tiny_causal_lm)
from in_process import run_main

# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_packed_logits_and_loss_equal_each_document_alone(kind):
    from framework.config import RunConfig
    from framework.tasks import get_task, language

    model = tiny_causal_lm(kind)
    task = get_task("causal_lm").bind(RunConfig(), model, None)

    batch = packed_batch()
    assert batch["position_ids"].shape == (3, 32)  # 99 tokens with EOS-less docs: 3 blocks, 3 tokens dropped
    with torch.no_grad():
        logits, targets = task.forward(model, batch)
        naive = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[:, :-1]
        worst, naive_worst, per_segment_loss = 0.0, 0.0, torch.tensor(0.0)
        for row, a, b in segments(batch):
            alone = model(input_ids=batch["input_ids"][row:row + 1, a:b]).logits[0]
            span = slice(a, b - 1)  # the packed logits of this segment (the last position predicts nothing)
            worst = max(worst, (logits[row, span] - alone[:-1]).abs().max().item())
            naive_worst = max(naive_worst, (naive[row, span] - alone[:-1]).abs().max().item())
            per_segment_loss += language.loss_sum(alone[None, :-1], batch["input_ids"][row:row + 1, a + 1:b])
        packed_loss = language.loss_sum(logits, targets)
    print(f"{kind}: packed vs alone max |diff| {worst:.2e}; position_ids alone {naive_worst:.2e}")
    assert worst < 1e-5
    assert naive_worst > 1e-3  # without the explicit mask, tokens do attend across documents
    torch.testing.assert_close(packed_loss, per_segment_loss, rtol=1e-5, atol=1e-5)
    # Each segment's first token is never a target; every other token is.
    assert int((targets != -100).sum()) == sum(b - a - 1 for _, a, b in segments(batch))


def test_pack_restarts_positions_at_each_document_and_block():
    from framework.tasks.causal_lm import pack

    blocks = pack([[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]], 4)
    assert blocks["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # 10 tokens: 2 blocks of 4, the rest dropped
    assert blocks["position_ids"] == [[0, 1, 2, 0], [0, 1, 2, 3]]  # the cut document restarts in its new block


# ---------------------------------------------------------------- training through the CLI


def test_causal_lm_from_scratch_trains_exports_and_generates(hf_home, word_tokenizer, corpus, tmp_path, capsys):
    out = tmp_path / "lm"
    assert run_main(lm_args(word_tokenizer, corpus, out, "train.epochs=6", "eval.prompt=the cat"), hf_home) == 0
    printed = capsys.readouterr().out
    s = summary(out)
    # The grammar leaves about 6 choices at most tokens: a model that learned it is far below the vocabulary.
    assert s["eval"]["perplexity"] < 4.0, s["eval"]
    assert s["eval"]["perplexity"] == pytest.approx(2.718281828 ** s["eval"]["loss"], rel=1e-9)
    assert 0 < s["eval"]["accuracy"] <= 1 and s["eval"]["tokens"] > 0
    assert s["sample"]["prompt"] == "the cat" and s["sample"]["generated"].split()
    assert "sample: 'the cat' ->" in printed and "done: eval perplexity" in printed
    # Packed: every token is real, so tokens/s is samples x block / s exactly.
    assert s["train"]["tokens_per_second"] == pytest.approx(s["train"]["samples_per_second"] * 32, rel=1e-6)
    assert "logits:" in printed  # the memory plan counts them

    from transformers import pipeline

    generate = pipeline("text-generation", model=str(out / "model"))
    text = generate("the king", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith("the king") and len(text.split()) > 3


@pytest.mark.parametrize("extra", [["precision=bf16"], ["train.gradient_checkpointing=true"]], ids=["bf16", "checkpointing"])
def test_causal_lm_with_bf16_or_gradient_checkpointing(hf_home, word_tokenizer, corpus, tmp_path, capsys, extra):
    out = tmp_path / "lm"
    assert run_main(lm_args(word_tokenizer, corpus, out, "train.epochs=3", *extra), hf_home) == 0
    capsys.readouterr()
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert losses[-1] < 0.6 * losses[0]


def test_early_stopping_on_perplexity_keeps_the_best_model(hf_home, word_tokenizer, corpus, tmp_path, capsys):
    out = tmp_path / "lm"
    args = lm_args(word_tokenizer, corpus, out, "train.epochs=20", "eval.every_steps=4", "eval.metric=perplexity",
                   "train.early_stopping_patience=2", "optim.lr=3e-2")
    assert run_main(args, hf_home) == 0
    printed = capsys.readouterr().out
    evals = [r for r in read_metrics(out) if "eval_perplexity" in r]
    best = min(evals, key=lambda r: r["eval_perplexity"])
    s = summary(out)
    assert s["best"]["metric"] == "perplexity" and s["best"]["step"] == best["step"]
    if s["train"]["stopped_early"]:
        assert "early stopping" in printed


# ---------------------------------------------------------------- masked LM


def test_masked_lm_trains_and_fills_masks(hf_home, word_tokenizer, corpus, tmp_path, capsys):
    out = tmp_path / "mlm"
    assert run_main(mlm_args(word_tokenizer, corpus, out, "train.max_steps=16"), hf_home) == 0
    capsys.readouterr()
    s = summary(out)
    assert set(s["eval"]) >= {"loss", "perplexity", "accuracy", "tokens"}
    # About 15% of the eval tokens are targets (special tokens and padding never).
    eval_tokens = s["eval"]["tokens"]
    assert eval_tokens > 0
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert losses[-1] < losses[0]

    from transformers import pipeline

    fill = pipeline("fill-mask", model=str(out / "model"))
    assert len(fill("the cat <mask> the castle .")) > 0


def test_masking_is_seeded_per_example_and_epoch(word_tokenizer):
    from transformers import AutoTokenizer

    from framework.tasks.masked_lm import MaskingCollator

    tokenizer = AutoTokenizer.from_pretrained(word_tokenizer)
    texts = [d["text"] for d in documents(64, seed=5)]
    features = [{**tokenizer(t, truncation=True, max_length=64, return_special_tokens_mask=True), "index": i}
                for i, t in enumerate(texts)]
    collate = MaskingCollator(tokenizer, None, None, 0.15, seed=42)
    first = collate(features)
    again = collate(list(reversed(features)))  # another batch order: each example keeps its own masks
    assert torch.equal(first["labels"], collate(features)["labels"])
    assert torch.equal(first["labels"][0], again["labels"][-1][: first["labels"].shape[1]])
    collate.set_epoch(1)
    assert not torch.equal(first["labels"], collate(features)["labels"])
    chosen = first["labels"] != -100
    real = first["attention_mask"].bool()
    share = chosen.sum() / real.sum()
    assert 0.10 < share < 0.20, share  # 15% of the real tokens
    masked = (first["input_ids"] == tokenizer.mask_token_id) & chosen
    assert 0.7 < masked.sum() / chosen.sum() < 0.9  # about 80% of them replaced by the mask token


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("override,message", [
    (["data.text_column=body"], "data.text_column: column 'body' is not in"),
    (["data.block_size=128"], "data.block_size=128 is longer than the model takes (max_position_embeddings 64)"),
    (["model.config.model_type=nonsense"], "model.config: cannot build a model config"),
    (["model.config.model_type=bert"], "model.config: model_type 'bert' is not a causal language model"),
    (["model.config.n_head=3"], "model.config: cannot build the model"),
], ids=["missing column", "block too long", "config does not parse", "encoder config", "bad sizes"])
def test_bad_language_model_input_names_the_key(hf_home, word_tokenizer, corpus, tmp_path, capsys, override, message):
    status = run_main(lm_args(word_tokenizer, corpus, tmp_path / "out", *override), hf_home)
    out, err = capsys.readouterr()
    assert status == 2 and "Traceback" not in err
    assert message in err and err.count("error:") == 1, err


def test_empty_corpus_and_wrong_model_kind_are_refused(hf_home, word_tokenizer, tiny_model, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": "  "}) + "\n" + json.dumps({"text": ""}) + "\n")
    assert run_main(lm_args(word_tokenizer, empty, tmp_path / "a"), hf_home) == 2
    assert "has no usable rows" in capsys.readouterr().err
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in documents(40, seed=1)))
    args = lm_args(word_tokenizer, data, tmp_path / "b", "model.config=null", "model.tokenizer=null",
                   f"model.name_or_path={tiny_model}")
    assert run_main(args, hf_home) == 2
    assert "is not a causal language model" in capsys.readouterr().err


def test_packing_needs_an_eos_token(hf_home, tiny_model, tmp_path, capsys):
    """The tiny BERT's WordPiece tokenizer has no EOS token."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in documents(40, seed=1)))
    args = lm_args(tiny_model, data, tmp_path / "o")
    assert run_main(args, hf_home) == 2
    err = capsys.readouterr().err
    assert "model.tokenizer:" in err and "no EOS token" in err and "data.packing=false" in err


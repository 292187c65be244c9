"""The chunked loss (framework/losses.py) against transformers' own: the loss and every gradient of
``model(**inputs, labels=...)`` within 1e-6 relative in fp32, for every architecture it is on for (tied and
untied embeddings, a bias on the head, BERT's transform before it), with LoRA on the head, ignored positions
and packed documents; per-sequence log-probabilities and evaluation outputs against full logits; no tensor
saved for backward is as large as the logits; and a run with it off trains the same as with it on."""

import json

import pytest
import torch

from framework import losses
from framework.losses import IGNORE
from in_process import train_ok
from helpers import (CHUNK, SIZES, VOCAB, batch, build, grads, lm_args, packed_batch, relative, targets_of,
                     worst_gradient)

def compare(model, kind, inputs, labels, select, autocast=False):
    """(loss relative error, worst gradient relative error) of the chunked loss against transformers'."""
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        reference = model(**inputs, labels=labels).loss
    reference.backward()
    expected = grads(model)
    model.zero_grad()
    head = losses.output_head(model)
    assert head is not None
    targets = targets_of(kind, labels)
    with context:
        hidden, called = losses.hidden_states(model, head, **inputs)
        assert called and hidden.shape[-1] != VOCAB
        loss = losses.linear_cross_entropy(hidden, head, targets, CHUNK, select) / (targets != IGNORE).sum()
    loss.backward()
    got = grads(model)
    model.zero_grad()
    return relative(loss, reference), worst_gradient(got, expected)


@pytest.mark.parametrize("kind", sorted(SIZES))
@pytest.mark.parametrize("select", [False, True])
def test_loss_and_gradients_equal_transformers(kind, select):
    assert kind in losses.EXACT_MODEL_TYPES
    model = build(kind)
    loss_error, grad_error = compare(model, kind, *batch(kind), select)
    print(f"{kind} select={select}: loss {loss_error:.1e}, gradients {grad_error:.1e} relative")
    assert loss_error < 1e-6 and grad_error < 1e-6


def test_every_exact_architecture_is_checked():
    assert losses.EXACT_MODEL_TYPES == set(SIZES)


def test_lora_on_the_head_and_bf16_autocast():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["q_proj", "lm_head"]))
    torch.manual_seed(2)
    for name, p in model.named_parameters():  # LoRA's B starts at zero: give it values, so its gradient shows
        if "lora_B" in name:
            p.data.normal_(std=0.1)
    assert "lora" in type(losses.output_head(model)).__module__
    inputs, labels = batch("llama")
    loss_error, grad_error = compare(model, "llama", inputs, labels, select=False)
    print(f"LoRA on lm_head: loss {loss_error:.1e}, gradients {grad_error:.1e}")
    assert loss_error < 1e-6 and grad_error < 1e-6
    bf16_loss, bf16_grad = compare(model, "llama", inputs, labels, select=True, autocast=True)
    print(f"bf16 autocast: loss {bf16_loss:.1e}, gradients {bf16_grad:.1e}")
    assert bf16_loss < 1e-2 and bf16_grad < 3e-2  # bf16 products rounded in another order


def test_packed_batch_through_the_task_equals_transformers():
    """The causal LM task's packed batch (4D document mask, restarting positions, no target at a segment's
    first token): its chunked loss over its target count equals transformers' loss with the batch's labels."""
    from framework.tasks import get_task
    from framework.tasks.causal_lm import CausalRun

    task = CausalRun(get_task("causal_lm"), _Recipe())
    task.select_targets = False  # static shapes, as on XLA
    model, packed = build("llama"), packed_batch()
    inputs, _ = task.inputs(model, packed)
    reference = model(**inputs, labels=packed["labels"]).loss
    reference.backward()
    expected = grads(model)
    model.zero_grad()
    loss = task.loss_sum(model, packed) / task.targets(packed)
    loss.backward()
    assert relative(loss, reference) < 1e-6
    assert worst_gradient(grads(model), expected) < 1e-6


class _Recipe:
    class train:
        chunked_loss, loss_chunk_tokens = True, CHUNK


@pytest.mark.parametrize("select", [False, True])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_summed_token_logprobs_and_eval_outputs_equal_full_logits(kind, select):
    model = build(kind)
    inputs, labels = batch(kind)
    targets = targets_of(kind, labels)
    head = losses.output_head(model)
    logits = model(**inputs).logits.float()
    full = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    full = full.masked_fill(targets == IGNORE, 0.0).sum(-1)
    weights = torch.tensor([1.0, -2.0, 0.5])  # a preference loss weighs its rows differently
    (full * weights).sum().backward()
    expected = grads(model)
    model.zero_grad()
    hidden, _ = losses.hidden_states(model, head, **inputs)
    chunked = losses.token_logprobs(hidden, head, targets, CHUNK, select).sum(-1)
    (chunked * weights).sum().backward()
    assert relative(chunked, full) < 1e-6
    assert worst_gradient(grads(model), expected) < 1e-6

    from framework.tasks.language import token_outputs

    with torch.no_grad():  # some targets the model's argmax, so that some tokens are correct
        targets = torch.where((targets != IGNORE) & (torch.arange(targets.shape[1]) % 2 == 0),
                              logits.argmax(-1), targets)
        full_losses, full_correct = token_outputs(logits, targets)
        token_losses, correct = losses.token_outputs(hidden, head, targets, CHUNK, select)
        torch.testing.assert_close(token_losses, full_losses, rtol=1e-6, atol=1e-6)
        assert torch.equal(correct, full_correct)
        assert full_correct.any()  # the check sees some correct tokens


def test_nothing_logits_sized_is_kept_for_backward():
    """The largest tensor autograd keeps for the backward pass: the full-logits loss keeps tokens x
    vocabulary ones; the chunked loss at most a chunk's, or the head's weight gradient."""
    model = build("gpt2")
    inputs, labels = batch("gpt2")
    targets = targets_of("gpt2", labels)
    head = losses.output_head(model)
    sizes = []

    def keep(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        hidden, _ = losses.hidden_states(model, head, **inputs)
        body = max(sizes)
        losses.linear_cross_entropy(hidden, head, targets, CHUNK).backward()
    chunked = max(sizes)
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(**inputs, labels=labels).loss.backward()
    full = max(sizes)
    tokens = targets.numel()
    assert full >= tokens * VOCAB
    assert chunked <= max(body, VOCAB * head.in_features)


def test_chunked_loss_off_trains_the_same(hf_home, word_tokenizer, corpus, tmp_path):
    """The same run with the chunked loss (the default) and without it: the same losses to float rounding,
    and the memory plan counts one chunk's logits instead of the whole batch's."""
    runs = {}
    for on in (True, False):
        out = tmp_path / str(on)
        train_ok(lm_args(word_tokenizer, corpus, out, "train.max_steps=6", "train.loss_chunk_tokens=8",
                         f"train.chunked_loss={str(on).lower()}"), hf_home)
        runs[on] = json.loads((out / "summary.json").read_text())
    on, off = runs[True], runs[False]
    assert on["eval"]["loss"] == pytest.approx(off["eval"]["loss"], rel=1e-5)
    assert on["eval"]["accuracy"] == pytest.approx(off["eval"]["accuracy"], abs=1e-6)
    assert on["memory_plan"]["logits_chunk"] == 8 and off["memory_plan"]["logits_chunk"] is None
    assert on["memory_plan"]["logit_bytes"] < off["memory_plan"]["logit_bytes"]

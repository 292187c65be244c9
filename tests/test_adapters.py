"""Adapters (peft): LoRA trains only the adapters and the classification head (the base weights bitwise
unchanged, optimizer state for the trainable parameters alone), QLoRA keeps the base in 4-bit NF4, model/
holds the adapter and with peft.merge a merged model that pipeline() loads and that computes what the adapted
model does, a killed run resumes bitwise, 2 processes equal 1, and bad adapter settings are refused by key."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY_RECIPE, checkpoint_states, crash_then_resume, lm_args, lora_lm_args, losses_by_step, read_metrics, summary
from in_process import run_main, train_ok

LORA = ["peft.r=4", "peft.alpha=8"]


def classifier_args(model: Path, data: Path, out: Path, *extra: str):
    return ["--config", str(TINY_RECIPE), f"model.name_or_path={model}", f"data.train_file={data}",
            f"output_dir={out}", "backend=cpu", *extra]


def base_name(name: str) -> str:
    """A parameter's name in the plain model, from its name in the PeftModel."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def adapter_weights(out: Path) -> dict:
    return load_file(out / "model" / "adapter_model.safetensors")


def tiny_bert_config(model: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model)


# ---------------------------------------------------------------- LoRA on a classifier


def test_lora_trains_only_the_adapters_and_the_head(hf_home, tiny_model, easy_data, tmp_path, capsys):
    out = tmp_path / "lora"
    args = classifier_args(tiny_model, easy_data, out, *LORA, "optim.lr=1e-2", "checkpoint.every_steps=45")
    assert run_main(args, hf_home) == 0
    printed = capsys.readouterr().out
    c = tiny_bert_config(tiny_model)
    h, labels = c.hidden_size, 2
    # r x (in + out) for query and value in every layer, and the whole new head.
    expected = c.num_hidden_layers * 2 * 4 * (h + h) + h * labels + labels
    memory = summary(out)["memory"]
    assert memory["trainable_parameters"] == expected
    assert memory["gradient_bytes"] == 4 * expected
    # AdamW's two fp32 moments per trainable parameter (and a step counter per tensor), nothing for the base.
    assert 8 * expected <= memory["optimizer_state_bytes"] < 8 * expected + 4 * 64
    assert f"({expected / 1e6:.2f}M trainable)" in printed  # the memory plan counts the same
    assert summary(out)["eval"]["accuracy"] >= 0.75

    # The last checkpoint holds the trained parameters alone, with their optimizer state: the frozen base comes
    # again from the pretrained model on a resume (so a base that training changed would not resume bitwise:
    # test_lora_causal_lm_resumes_bitwise_after_a_kill).
    saved = checkpoint_states(sorted((out / "checkpoints").glob("step_*"))[-1])
    assert saved["model"] and all("lora_" in k or "classifier" in k for k in saved["model"])
    assert sum(t.numel() for t in saved["model"].values()) == expected
    assert {k.rsplit(".", 1)[0] for k in saved["optimizer"] if k.startswith("state.")} == {
        f"state.{k}" for k in saved["model"]}

    # model/ holds the adapter in peft's format, whose base is the pretrained folder.
    config = json.loads((out / "model" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model.resolve()) and config["r"] == 4
    saved = adapter_weights(out)
    assert any("lora_B" in k for k in saved) and any("classifier" in k for k in saved)
    assert all(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # trained (they start at zero)


def load_classifier(model: Path, out: Path, quantize: bool = False):
    """The adapted model as training left it: the base loaded again (quantized like the run did) plus the
    saved adapter."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from framework import adapters

    labels = json.loads((out / "model" / "config.json").read_text())["id2label"]
    base = AutoModelForSequenceClassification.from_pretrained(model, num_labels=len(labels))
    if quantize:
        adapters._quantize_4bit(base, adapters._kept_in_full(base, []))
    return PeftModel.from_pretrained(base, out / "model" / "adapter").eval()


@pytest.mark.parametrize("quantize", [False, True], ids=["lora", "qlora"])
def test_merged_model_loads_in_a_pipeline_and_equals_the_adapted_one(hf_home, tiny_model, easy_data, tmp_path,
                                                                     capsys, quantize):
    out = tmp_path / "merged"
    extra = ["peft.quantize=4bit"] if quantize else []
    args = classifier_args(tiny_model, easy_data, out, *LORA, "peft.merge=true", "optim.lr=1e-2", *extra)
    assert run_main(args, hf_home) == 0
    capsys.readouterr()
    assert (out / "model" / "model.safetensors").exists() and (out / "model" / "adapter" / "adapter_config.json").exists()

    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    texts = ["the movie was great", "a dull and boring plot", "the actor had some lovely music"]
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    merged = AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        adapted = load_classifier(tiny_model, out, quantize)(**batch).logits
        # Merged into the dequantized 4-bit weights the adapters trained against: the same function.
        torch.testing.assert_close(merged(**batch).logits, adapted, rtol=1e-4, atol=1e-5)
    classify = pipeline("text-classification", model=str(out / "model"))
    assert {r["label"] for r in classify(texts)} <= {"neg", "pos"}


def test_a_qlora_checkpoint_loads_only_onto_the_base_it_was_quantized_from(pretrained_lm):
    """A 4-bit layer's checkpointed quantization state (bitsandbytes writes it; no layer loads it) is set aside
    on load when it is the layer's own, and refused naming the layer when the base differs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from framework import adapters
    from framework.errors import UserError

    def adapted(scale: float):
        base = AutoModelForCausalLM.from_pretrained(pretrained_lm)
        with torch.no_grad():
            base.transformer.h[0].attn.c_attn.weight.mul_(scale)
        adapters._quantize_4bit(base, adapters._kept_in_full(base, []))
        return get_peft_model(base, LoraConfig(r=4, target_modules=["c_attn"]))

    saved = adapted(1.0).state_dict()
    assert any(key.endswith("c_attn.base_layer.weight.absmax") for key in saved)
    result = adapted(1.0).load_state_dict(saved, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    with pytest.raises(UserError, match=r"resume: the checkpoint's 4-bit layer .*h\.0\.attn\.c_attn\.base_layer "
                                        "differs from the one quantized from model.name_or_path now"):
        adapted(1.5).load_state_dict(saved)


def test_qlora_keeps_the_base_in_4_bits(hf_home, tiny_model, easy_data, tmp_path, capsys):
    full, quantized = tmp_path / "lora", tmp_path / "qlora"
    # lr 3e-2: at 1e-2 two epochs left the random tiny base at chance (eval loss 0.69 = ln 2), and the
    # accuracy check then read noise (0.70 on one CPU, 0.675 on another).
    common = [*LORA, "optim.lr=3e-2", "train.epochs=2"]
    assert run_main(classifier_args(tiny_model, easy_data, full, *common), hf_home) == 0
    assert run_main(classifier_args(tiny_model, easy_data, quantized, *common, "peft.quantize=4bit"), hf_home) == 0
    capsys.readouterr()
    a, b = summary(full)["memory"], summary(quantized)["memory"]
    assert a["parameters"] == b["parameters"] and a["trainable_parameters"] == b["trainable_parameters"]
    # The linear layers' weights: 4 bytes each in fp32, half a byte in NF4 plus a scale per block of 64,
    # itself quantized to a byte (double quantization) with a few fp32 scales of its own.
    c = tiny_bert_config(tiny_model)
    h, i, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    linear = layers * (4 * h * h + 2 * h * i) + h * h  # attention, feed-forward, and the pooler
    assert a["weight_bytes"] - b["weight_bytes"] == pytest.approx(linear * (4 - 0.5 - 1 / 64), rel=2e-3)
    assert summary(quantized)["eval"]["accuracy"] >= 0.7
    assert summary(quantized)["eval"]["loss"] < 0.6  # learned: chance is ln 2 = 0.69


# ---------------------------------------------------------------- LoRA on a causal LM


@pytest.mark.parametrize("quantize", [False, True], ids=["lora", "qlora"])
def test_lora_causal_lm_resumes_bitwise_after_a_kill(hf_home, pretrained_lm, corpus, tmp_path, quantize):
    common = ["train.max_steps=12", "checkpoint.every_steps=5", "train.log_every=2", "peft.dropout=0.1",
              *(["peft.quantize=4bit"] if quantize else [])]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run_main(lora_lm_args(pretrained_lm, corpus, whole, *common), hf_home) == 0
    proc = crash_then_resume(hf_home, lora_lm_args(pretrained_lm, corpus, resumed, *common), kill_at_micro=8)
    assert "resuming from" in proc.stdout and "step_5" in proc.stdout
    a, b = adapter_weights(whole), adapter_weights(resumed)
    assert a.keys() == b.keys() and any("lora_A" in k for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert losses_by_step(whole) == losses_by_step(resumed)


@pytest.mark.parametrize("quantize", [False, True], ids=["lora", "qlora"])
def test_lora_causal_lm_merges_into_a_text_generation_pipeline(hf_home, pretrained_lm, corpus, tmp_path, capsys,
                                                               quantize):
    """GPT-2's linear layers are transformers Conv1D (weights transposed): QLoRA quantizes them too, and the merged
    model gives them back their layout; it computes what the adapted model does (on the dequantized weights)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from framework import adapters

    out = tmp_path / "lora"
    args = lora_lm_args(pretrained_lm, corpus, out, "train.epochs=3", "peft.merge=true", "optim.lr=1e-2",
                        "eval.prompt=the cat", *(["peft.quantize=4bit"] if quantize else []))
    assert run_main(args, hf_home) == 0
    base = AutoModelForCausalLM.from_pretrained(pretrained_lm)
    if quantize:
        adapters._quantize_4bit(base, adapters._kept_in_full(base, []))
        assert sum(type(m).__name__ == "Linear4bit" for m in base.modules()) == 2 * 4  # 4 Conv1D a block
    adapted = PeftModel.from_pretrained(base, out / "model" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    batch = AutoTokenizer.from_pretrained(out / "model")(["the king sat on a mat"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, adapted(**batch).logits, rtol=1e-4, atol=1e-5)
    capsys.readouterr()
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert losses[-1] < losses[0]
    s = summary(out)
    # GPT-2's c_attn (768 -> 3 x 768 here 32 -> 96) in each of the 2 layers: r x (in + out) each.
    assert s["memory"]["trainable_parameters"] == 2 * 4 * (32 + 96)
    assert s["sample"]["generated"].split()

    from transformers import pipeline

    generate = pipeline("text-generation", model=str(out / "model"))
    text = generate("the king", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert text.startswith("the king") and len(text.split()) > 2


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="backend auto would train on the GPU here")
def test_lora_two_processes_equal_one_with_double_batch(cli, hf_home, pretrained_lm, corpus, tmp_path):
    common = ["data.packing=false", "train.max_steps=4", "train.max_grad_norm=null", "optim.name=sgd", "optim.lr=0.5"]
    two, one = tmp_path / "two", tmp_path / "one"
    proc = cli(lora_lm_args(pretrained_lm, corpus, two, *common), launch="cpu_ddp.yaml")
    assert "num_processes: 2" in proc.stdout
    train_ok(lora_lm_args(pretrained_lm, corpus, one, *common, "train.batch_size=8"), hf_home)
    a, b = adapter_weights(two), adapter_weights(one)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- bad adapter settings


@pytest.mark.parametrize("extra,message", [
    (["peft.target_modules=[nothing_like_this]"], "peft.target_modules: "),
    (["peft.quantize=8bit"], "peft.quantize: '8bit' is not allowed"),
    (["peft.modules_to_save=[head]"], "peft.modules_to_save: 'head' names no module"),
    (["peft.lora_alpha=8"], "did you mean 'peft.alpha'"),
    (["peft.r=0"], "peft.r: 0 is out of range"),
    (["peft.quantize=4bit", "backend=xla"], "peft.quantize: 4-bit weights need bitsandbytes kernels"),
    (["distributed.strategy=xla_fsdp"], "peft: adapters run with one process, DDP, FSDP2 or DeepSpeed"),
    (["peft.quantize=4bit", "distributed.strategy=deepspeed"], "peft.quantize: 4-bit weights under DeepSpeed"),
], ids=["target_modules", "quantize", "modules_to_save", "typo", "rank", "xla", "xla_fsdp", "qlora_deepspeed"])
def test_bad_adapter_settings_are_refused_by_key(hf_home, tiny_model, easy_data, tmp_path, capsys, extra, message):
    out = tmp_path / "bad"
    assert run_main(classifier_args(tiny_model, easy_data, out, *LORA, *extra), hf_home) == 2
    captured = capsys.readouterr()
    assert message in captured.err + captured.out
    assert "Traceback" not in captured.err and not (out / "model").exists()


def test_adapters_on_a_model_built_from_a_config_are_refused(hf_home, word_tokenizer, corpus, tmp_path, capsys):
    assert run_main(lm_args(word_tokenizer, corpus, tmp_path / "lm", *LORA), hf_home) == 2
    assert "peft: adapters train on top of a pretrained model" in capsys.readouterr().err

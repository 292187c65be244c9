"""GGUF export (framework/export.py): the written file read back by transformers computes what the model folder
computes, within each type's rounding; its tokenizer encodes as the folder's and carries its chat template; bad
input exits 2 with one line. On tiny random models (a ByteLevel BPE tokenizer trained here on a few sentences,
ChatML's tokens and template) and on SmolLM2: its Q4_1 export is byte for byte the Q4_1 file llama.cpp made, which
the asset folder was dequantized from."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from framework import export
from framework.errors import UserError
from helpers import CHATML, ROOT, TEXTS, save_bpe_tokenizer, save_causal_lm, smollm2_gguf

GG = gguf.GGMLQuantizationType
SMOLLM2 = ROOT / "assets" / "SmolLM2-135M-Instruct"
TINY_LLAMA = ROOT / "tests" / "tiny_llama.yaml"
PROBES = ["the movie was good, 26 + 28?", "  Hello\n\nWORLD!! 1234 été", "<|im_start|>user\nhi<|im_end|>\n"]
CHAT = [{"role": "user", "content": "Is the film good? 26 + 28"}, {"role": "assistant", "content": "yes, 54"}]
# Measured max |logit difference| against the source model on the tiny Llama below (logits up to about 3): f16
# 0.0026, q8_0 0.085, q4_1 0.76; each file also computes exactly what the source computes with its weights rounded
# through the same quantizer in memory (0.0), so these bounds are the quantizers' own error.
BOUNDS = {"f16": 1e-2, "q8_0": 0.15, "q4_1": 1.5}
# SmolLM2 (logits up to 39, std 8.4): q8_0 1.32 at most, 0.20 on average over the 40 positions x 49,152 logits.
SMOLLM2_Q8_0_BOUND = 2.0


def logits(model, tokenizer_or_ids):
    ids = tokenizer_or_ids if torch.is_tensor(tokenizer_or_ids) else tokenizer_or_ids(
        " ".join(TEXTS[:3]), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(ids).logits


def load_gguf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def rounded(model, kind: str):
    """The model with each matrix rounded through the quantizer the kind writes it with, in memory."""
    spec = export.KINDS[kind]
    model = copy.deepcopy(model)
    out = model.get_output_embeddings().weight
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                qtype = spec.output if p is out else spec.weights
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qtype), qtype)))
    return model


def tensor_types(path) -> dict:
    return {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}


def field(path, key):
    return gguf.GGUFReader(path).fields[key].contents()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "model"
    return folder, save_causal_lm(folder)


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_1"])
def test_a_tiny_llama_reads_back_with_its_logits(kind, tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    folder, source = tiny_llama
    path = export.export_gguf(folder, kind, tmp_path / f"tiny-{kind}.gguf")
    model, _ = load_gguf(path)
    assert model.config.tie_word_embeddings and model.config.rope_parameters["rope_theta"] == 30000.0
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected, got = logits(source, tokenizer), logits(model, tokenizer)
    assert (got - expected).abs().max().item() < BOUNDS[kind]
    if kind != "f16":
        torch.testing.assert_close(got, logits(rounded(source, kind), tokenizer), rtol=0, atol=1e-5)
    spec, types = export.KINDS[kind], tensor_types(path)
    assert "output.weight" not in types and types["token_embd.weight"] == spec.output  # tied: one matrix
    assert types["blk.0.attn_q.weight"] == spec.weights and types["blk.1.ffn_down.weight"] == spec.weights
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == GG.F32
    assert field(path, "general.file_type") == spec.file_type and field(path, "general.name") == "tiny0"


def test_the_rotary_permutation_is_what_makes_the_logits_match(tiny_llama, tmp_path, monkeypatch):
    """The check above can see the layout: written unpermuted, the same file is off by units."""
    from transformers import AutoTokenizer

    folder, source = tiny_llama
    monkeypatch.setitem(export.ARCHITECTURES, "llama", export.Architecture(gguf.MODEL_ARCH.LLAMA, permute=False))
    model, _ = load_gguf(export.export_gguf(folder, "f16", tmp_path / "unpermuted.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (logits(model, tokenizer) - logits(source, tokenizer)).abs().max().item() > 0.5


@pytest.mark.parametrize("model_type, tied", [("mistral", True), ("qwen2", False)])
def test_mistral_and_qwen2_read_back_with_their_logits(model_type, tied, tmp_path):
    """Mistral is written as llama (as llama.cpp does); Qwen2 as qwen2, unpermuted, with its query/key/value
    biases and here an untied output matrix. (Not in a folder named "mistral": transformers reads a GGUF whose
    general.name is exactly that as architecture mistral, and fails to map its tensors.)"""
    from transformers import AutoTokenizer

    folder = tmp_path / f"tiny-{model_type}"
    source = save_causal_lm(folder, model_type, tied=tied)
    path = export.export_gguf(folder, "f16", tmp_path / "out.gguf")
    model, _ = load_gguf(path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (logits(model, tokenizer) - logits(source, tokenizer)).abs().max().item() < BOUNDS["f16"]
    assert field(path, "general.architecture") == ("llama" if model_type == "mistral" else "qwen2")
    assert ("output.weight" in tensor_types(path)) == (not tied)


@pytest.mark.parametrize("split, add_bos", [("gpt2", False), ("qwen2", True)])
def test_the_tokenizer_reads_back_with_its_ids_and_chat_template(split, add_bos, tmp_path):
    folder = tmp_path / "model"
    save_causal_lm(folder, "llama" if split == "gpt2" else "qwen2", split=split, add_bos=add_bos)
    path = export.export_gguf(folder, "q8_0", tmp_path / "out.gguf")
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(folder)
    _, read = load_gguf(path)
    for text in PROBES:
        assert read(text)["input_ids"] == source(text)["input_ids"], text
    assert (source("a")["input_ids"][0] == source.bos_token_id) == add_bos  # the case is real
    assert read.chat_template == source.chat_template == CHATML
    assert (read.apply_chat_template(CHAT, add_generation_prompt=True)
            == source.apply_chat_template(CHAT, add_generation_prompt=True))
    assert ([read.bos_token, read.eos_token, read.pad_token, read.unk_token]
            == [source.bos_token, source.eos_token, source.pad_token, source.unk_token])
    assert field(path, "tokenizer.ggml.model") == "gpt2" and field(path, "tokenizer.ggml.pre") == split
    assert field(path, "tokenizer.ggml.add_bos_token") is add_bos
    assert field(path, "tokenizer.ggml.token_type")[:4] == [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL]


def test_pre_tokenizer_names_and_refusals(tmp_path):
    """SmolLM's own split (digits one by one) is named as llama.cpp names it; a tokenizer llama.cpp would split
    otherwise (here word-level) is refused by file."""
    from framework.testing import save_word_tokenizer

    save_bpe_tokenizer(tmp_path / "smollm", split="smollm")
    assert export.pre_tokenizer_name(tmp_path / "smollm") == "smollm"
    save_word_tokenizer(tmp_path / "words", ["good", "bad"])
    with pytest.raises(UserError, match="tokenizer.json: a WordLevel tokenizer"):
        export.pre_tokenizer_name(tmp_path / "words")


def test_a_lora_adapter_folder_is_merged_into_its_base(tiny_llama, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, _ = tiny_llama
    torch.manual_seed(1)
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                             LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "model")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "model")
    path = export.export_gguf(tmp_path / "model", "f16", tmp_path / "merged.gguf")
    model, _ = load_gguf(path)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "model")
    merged = merged.merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(base)
    expected = logits(merged, tokenizer)
    assert (expected - logits(AutoModelForCausalLM.from_pretrained(base), tokenizer)).abs().max() > 0.1  # it moved
    assert (logits(model, tokenizer) - expected).abs().max().item() < BOUNDS["f16"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.gguf", "model"]  # the merged copy is gone


def test_the_command_writes_each_type_next_to_the_model_folder(tiny_llama, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_llama[0], run / "model")
    assert export.main([str(run), "--gguf", "Q8_0", "--gguf", "f16"]) == 0
    assert sorted(p.name for p in run.iterdir()) == ["model", "model-f16.gguf", "model-q8_0.gguf"]
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and said[0].startswith(f"wrote {run / 'model-q8_0.gguf'} (q8_0")
    assert export.main([str(run / "model"), "--gguf", "q4_1", "--out", str(tmp_path / "new" / "x.gguf")]) == 0
    assert field(tmp_path / "new" / "x.gguf", "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_1


def bad_inputs(tmp_path, tiny_llama):
    """(arguments, what the line must name) for each refusal."""
    from framework.testing import save_word_tokenizer

    folder = str(tiny_llama[0])
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("")
    words = tmp_path / "words"
    save_word_tokenizer(words, ["good", "bad"])
    (words / "config.json").write_text((tiny_llama[0] / "config.json").read_text())
    (words / "model.safetensors").symlink_to(tiny_llama[0] / "model.safetensors")
    hub_adapter = tmp_path / "hub_adapter"
    hub_adapter.mkdir()
    (hub_adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/some-model"}))
    return [
        ([str(tmp_path / "missing"), "--gguf", "f16"], "does not exist"),
        ([str(tmp_path / "empty"), "--gguf", "f16"], "holds no model"),
        ([folder, "--gguf", "q4_k_m"], "--gguf: no GGUF type 'q4_k_m'"),
        ([folder], "--gguf"),
        ([folder, "--gguf", "f16", "--out", str(tmp_path / "a_file" / "x.gguf")], "--out"),
        ([folder, "--gguf", "f16", "--out", str(tmp_path)], "--out"),
        ([folder, "--gguf", "f16", "--gguf", "q8_0", "--out", str(tmp_path / "x.gguf")], "--out"),
        ([str(words), "--gguf", "f16"], "tokenizer.json"),
        ([str(hub_adapter), "--gguf", "f16"], "peft.merge=true"),
    ]


def test_bad_input_exits_2_with_one_line_and_writes_nothing(tiny_llama, tmp_path, capsys):
    for argv, says in bad_inputs(tmp_path, tiny_llama):
        assert export.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and says in err and "\n" not in err and "Traceback" not in err, err
    assert not list(tmp_path.rglob("*.gguf")) and not list(tmp_path.rglob(".tmp_*"))
    assert not list(tiny_llama[0].parent.glob("*.gguf"))


def test_a_classifier_is_refused_by_the_command_in_one_line(tmp_path):
    """The command as a user runs it: a BERT classifier is no architecture it writes."""
    from framework.testing import save_tiny_bert

    save_tiny_bert(tmp_path / "bert", ["good", "bad"])
    done = subprocess.run([sys.executable, "-m", "framework.export", str(tmp_path / "bert"), "--gguf", "q8_0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-3000:]
    assert done.stderr.count("\n") == 1 and "BertForSequenceClassification" in done.stderr, done.stderr


def smollm2() -> None:
    if not SMOLLM2.is_dir():
        pytest.fail(f"{SMOLLM2} is missing: run `make install` (or `python tools/assets.py assets`)")


def test_smollm2_in_q4_1_is_the_file_llama_cpp_made(tmp_path):
    """The asset folder is SmolLM2's Q4_1 GGUF (made by llama.cpp's converter and llama-quantize) dequantized:
    written back in Q4_1 every tensor is byte for byte that file's (the permuted query and key rows, the tied
    embedding in Q8_0, the norms in F32), and so are the tokens, their types, merges, special ids and template."""
    smollm2()
    ours = gguf.GGUFReader(export.export_gguf(SMOLLM2, "q4_1", tmp_path / "smollm2-q4_1.gguf"))
    shipped = gguf.GGUFReader(smollm2_gguf())
    theirs = {t.name: t for t in shipped.tensors}
    assert sorted(t.name for t in ours.tensors) == sorted(theirs)
    for tensor in ours.tensors:
        assert tensor.tensor_type == theirs[tensor.name].tensor_type, tensor.name
        assert np.array_equal(tensor.data, theirs[tensor.name].data), tensor.name
    differ = [k for k, f in shipped.fields.items() if not k.startswith(("GGUF.", "general."))
              and (k not in ours.fields or ours.fields[k].contents() != f.contents())]
    # The folder's tokenizer.json, rebuilt by transformers from that file, splits as GPT-2 (digits in runs):
    # written as what the folder does. llama.cpp's converter left add_space_prefix (false, the default).
    assert sorted(differ) == ["tokenizer.ggml.add_space_prefix", "tokenizer.ggml.pre"]
    assert ours.fields["tokenizer.ggml.pre"].contents() == "gpt2"


@pytest.mark.slow
def test_smollm2_in_q8_0_reads_back_with_its_logits(tmp_path):
    """transformers reads a GGUF of SmolLM2's vocabulary slowly (about 15 s): with the test-slow tier."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    smollm2()
    source = AutoModelForCausalLM.from_pretrained(SMOLLM2).eval()
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 26 + 28?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    model, read = load_gguf(export.export_gguf(SMOLLM2, "q8_0", tmp_path / "smollm2-q8_0.gguf"))
    expected, got = logits(source, ids), logits(model, ids)
    assert (got - expected).abs().max().item() < SMOLLM2_Q8_0_BOUND
    assert got[0, -1].argmax() == expected[0, -1].argmax()
    assert read(PROBES[1])["input_ids"] == tokenizer(PROBES[1])["input_ids"]
    assert read.chat_template == tokenizer.chat_template


# ---------------------------------------------------------------- export.gguf: written by a run


def test_a_run_writes_its_export_gguf_file_which_transformers_loads(corpus, hf_home, tmp_path):
    """``export.gguf: [f16]`` in a tiny Llama's run (tests/tiny_llama.yaml over this module's BPE tokenizer): the
    file next to model/ computes what model/ computes, within f16's rounding; summary.json and the card list it."""
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers import summary
    from in_process import run_main

    save_bpe_tokenizer(tmp_path / "tokenizer")
    out = tmp_path / "run"
    assert run_main(["--config", str(TINY_LLAMA), f"model.tokenizer={tmp_path / 'tokenizer'}",
                     f"data.train_file={corpus}", f"output_dir={out}", "train.max_steps=3", "export.gguf=[F16]"],
                    hf_home) == 0
    assert summary(out)["exports"] == {"f16": "model-f16.gguf"}
    model, read = load_gguf(out / "model-f16.gguf")
    trained = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    assert (logits(model, tokenizer) - logits(trained, tokenizer)).abs().max().item() < BOUNDS["f16"]
    assert read(PROBES[0])["input_ids"] == tokenizer(PROBES[0])["input_ids"]
    assert "- `model-f16.gguf` (" in ModelCard.load(out / "model" / "README.md").text


def test_export_gguf_is_refused_by_key_before_training(word_tokenizer, tmp_path):
    """What the recipe tells before anything loads: a type the writer lacks, a task whose model is no causal LM, a
    model type it does not write, a tokenizer it does not map."""
    from framework.recipe import load_config
    from helpers import TINY_LM, TINY_RECIPE

    save_bpe_tokenizer(tmp_path / "bpe")
    llama = ["--config", TINY_LLAMA, f"model.tokenizer={tmp_path / 'bpe'}"]
    cases = [
        (llama + ["export.gguf=[f16,q4_k_m]"], "export.gguf: no GGUF type 'q4_k_m' here; use one of f16, q8_0, q4_1"),
        (["--config", TINY_RECIPE, "model.name_or_path=x", "export.gguf=[q8_0]"],
         "export.gguf: GGUF files hold causal language models, and text_classification trains a text-classification"),
        (["--config", TINY_LM, f"model.tokenizer={tmp_path / 'bpe'}", "export.gguf=[q8_0]"],
         "export.gguf: a gpt2 model has no GGUF writer here"),
        (["--config", TINY_LLAMA, f"model.tokenizer={word_tokenizer}", "export.gguf=[q8_0]"],
         "export.gguf: " + str(word_tokenizer / "tokenizer.json") + ": a WordLevel tokenizer"),
    ]
    for (_, path, *overrides), says in cases:
        with pytest.raises(UserError) as refused:
            load_config(path, ["data.train_file=x.csv", *overrides])
        assert says in str(refused.value) and str(refused.value).count("\n  - ") == 1, str(refused.value)
    allowed = load_config(TINY_LLAMA, ["data.train_file=x.csv", f"model.tokenizer={tmp_path / 'bpe'}", "export.gguf=[f16]"])
    assert allowed.export.gguf == ["f16"]

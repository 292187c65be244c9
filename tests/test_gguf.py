"""A GGUF file as ``model.name_or_path``: transformers reads it, the framework dequantizes it into an ordinary
float32 model and trains it as it trains the same weights saved as a folder; tools/assets.py's conversion of one
into a model folder (what `make install` does for SmolLM2); files it cannot read are refused with exit 2. The GGUF
here is a tiny random Llama written with the gguf library, carrying SmolLM2's metadata (its 49,152-token
tokenizer, ChatML template, special ids, tied output): the real model's shape of vocabulary and head, on which
the chunked loss, pipeline() with the model's own template and lm-evaluation-harness are checked too."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import TINY_LM, assert_same_weights, mlm_args, tiny_args, tiny_gguf, tools_assets, train_losses
from in_process import run_main


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def gguf_folder(gguf_file, tmp_path_factory):
    """The file converted by tools/assets.py, which checks the folder's logits against the GGUF model's."""
    folder = tmp_path_factory.mktemp("converted") / "tiny-llama"
    assert tools_assets().write_gguf_model(gguf_file, folder) == 0.0
    return folder


def test_the_converted_folder_is_an_ordinary_chat_model(gguf_folder):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(gguf_folder)
    assert (config.model_type, config.vocab_size, config.num_hidden_layers, config.tie_word_embeddings) == \
        ("llama", 49152, 2, True)
    assert getattr(config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(gguf_folder)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, len(tokenizer)) == ("<|im_end|>", 2, 49152)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), text
    assert GenerationConfig.from_pretrained(gguf_folder).eos_token_id == 2


def sft(model, chat_data, out, *extra):
    """tests/tiny_lm.yaml as sft from a pretrained ``model``, with the model's own chat template."""
    return ["--config", str(TINY_LM), "task=sft", "model.config=null", "model.tokenizer=null",
            f"model.name_or_path={model}", f"data.train_file={chat_data[1]}", f"output_dir={out}",
            "train.max_steps=3", "data.block_size=64", *extra]


@pytest.fixture(scope="module")
def from_folder(gguf_folder, chat_data, hf_home, tmp_path_factory):
    """3 steps of sft from the converted folder (the chunked loss on: the default)."""
    out = tmp_path_factory.mktemp("runs") / "folder"
    assert run_main(sft(gguf_folder, chat_data, out), hf_home) == 0
    return out


def test_a_gguf_file_trains_as_its_converted_folder_does(gguf_file, from_folder, chat_data, hf_home, tmp_path):
    from_file = tmp_path / "file"
    assert run_main(sft(gguf_file, chat_data, from_file), hf_home) == 0
    losses = train_losses(from_file)
    assert losses == train_losses(from_folder) and len(losses) == 3 and all(0 < x < 20 for x in losses), losses
    assert_same_weights(from_file, from_folder, rtol=0, atol=0)
    config = json.loads((from_file / "model" / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True


def test_lora_on_a_gguf_file_saves_the_merged_model_or_is_refused(gguf_file, gguf_folder, chat_data, hf_home,
                                                                 tmp_path, capsys):
    """peft cannot load an adapter's base from a GGUF file: model/ must hold the merged model."""
    assert run_main(sft(gguf_file, chat_data, tmp_path / "unmerged", "peft.r=4"), hf_home) == 2
    err = capsys.readouterr().err
    assert "peft.merge" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "unmerged").exists()
    out = tmp_path / "merged"
    assert run_main(sft(gguf_file, chat_data, out, "peft.r=4", "peft.merge=true"), hf_home) == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "model")
    base = AutoModelForCausalLM.from_pretrained(gguf_folder)
    changed = [n for n, p in merged.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed), changed


def test_a_gguf_file_starts_a_classifier_as_its_converted_folder_does(gguf_file, gguf_folder, easy_data, hf_home,
                                                                     tmp_path, capsys):
    """task text_classification from a GGUF chat model: its body under a new classification head (Llama's
    ``score``, seeded), trained as from the folder; a masked LM from a decoder is refused by key."""
    runs = {}
    for name, model in (("file", gguf_file), ("folder", gguf_folder)):
        runs[name] = tmp_path / name
        assert run_main(tiny_args(model, easy_data, runs[name], "train.max_steps=3", "data.max_length=16"),
                        hf_home) == 0
    losses = train_losses(runs["file"])
    assert losses == train_losses(runs["folder"]) and len(losses) == 3 and all(0 < x < 5 for x in losses), losses
    assert_same_weights(runs["file"], runs["folder"], rtol=0, atol=0)
    capsys.readouterr()
    assert run_main(mlm_args(gguf_file, easy_data, tmp_path / "mlm", "model.config=null", "model.tokenizer=null",
                             f"model.name_or_path={gguf_file}"), hf_home) == 2
    err = capsys.readouterr().err
    assert "model.name_or_path" in err and "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize("content, says", [(b"\x00" * 4096, "GGUF magic"), (None, "does not exist")])
def test_a_gguf_file_it_cannot_read_is_refused(content, says, chat_data, hf_home, tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    if content is not None:
        bad.write_bytes(content)
    assert run_main(sft(bad, chat_data, tmp_path / "out"), hf_home) == 2
    err = capsys.readouterr().err
    assert "model.name_or_path" in err and says in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "out").exists()


def test_the_chunked_loss_is_exact_at_the_real_vocabulary_with_a_tied_head(gguf_folder, from_folder, chat_data,
                                                                           hf_home, tmp_path):
    """49,152 logits a token through the embedding matrix the head shares: chunk by chunk (the default) against
    the full logits and transformers' head."""
    out = tmp_path / "full_logits"
    assert run_main(sft(gguf_folder, chat_data, out, "train.chunked_loss=false"), hf_home) == 0
    torch.testing.assert_close(torch.tensor(train_losses(out)), torch.tensor(train_losses(from_folder)),
                               rtol=1e-5, atol=1e-6)
    # Adam divides each gradient by its own scale, so a last-bit difference in an entry whose gradient is near
    # zero moves it by up to the learning rate: weights agree to a few lr-sized steps, not bitwise (measured
    # 7e-5 at most, one entry in 8192, lr 3e-3).
    assert_same_weights(out, from_folder, rtol=0, atol=3e-4)


def test_pipeline_answers_in_the_models_own_chat_template(from_folder):
    from transformers import pipeline

    chat = [{"role": "user", "content": "the movie was superb"}]
    out = pipeline("text-generation", model=str(from_folder / "model"))(chat, max_new_tokens=3, do_sample=False)
    reply = out[0]["generated_text"]
    assert reply[:-1] == chat and reply[-1]["role"] == "assistant" and isinstance(reply[-1]["content"], str)


def test_lm_evaluation_harness_scores_the_model_folder(from_folder, tmp_path):
    from framework.evaluate import main

    out = tmp_path / "harness.json"
    assert main([str(from_folder), "--tasks", "rt_sentiment", "--limit", "8", "--out", str(out)]) == 0
    scores = json.loads(out.read_text())["tasks"]["rt_sentiment"]
    assert 0.0 <= scores["acc"] <= 1.0 and scores["samples"] == 8, scores

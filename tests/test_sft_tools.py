"""SFT on tool-calling conversations (task sft, data.chat_template: chatml-tools): the built-in template renders
tools, calls and results (prefix-preserving); the mask marks exactly the assistant's turns, its calls included (an
independent computation from the rendered text's assistant spans), and the loss equals TRL 1.16's SFTTrainer's
``assistant_only_loss`` on the same rows with their ``tools``; packing keeps tool conversations whole; what the RL
tools loop reuses (a tool turn's tokens, parsing calls, the stop token) agrees with the conversation's own tokens;
bad tools and a template that ignores tools are refused by key."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from helpers import ROOT, TINY_LM
from in_process import run_captured, run_main
from test_sft import GPT2, ours, sft_config, trl_run

SMOLLM2 = ROOT / "assets" / "SmolLM2-135M-Instruct"


def schema(name: str, description: str) -> dict:
    """A two-integer function's JSON schema, as transformers' get_json_schema writes it."""
    number = {"type": "integer", "description": "A number."}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {"a": number, "b": number}, "required": ["a", "b"]}}}


MULTIPLY, ADD = schema("multiply", "Multiply two integers."), schema("add", "Add two integers.")


def call(name: str, a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def said(text: str) -> dict:
    return {"role": "assistant", "content": text}


def calls(*made: dict, content=None) -> dict:
    return {"role": "assistant", "content": content, "tool_calls": list(made)}


def result(name: str, text: str) -> dict:
    return {"role": "tool", "name": name, "content": text}


ROWS = [
    {"messages": [user("What is 37 x 58?"), calls(call("multiply", 37, 58)), result("multiply", "2146"), said("2146")],
     "tools": [MULTIPLY]},
    {"messages": [{"role": "system", "content": "Be brief."}, user("What is 12 x 34 + 5?"),
                  calls(call("multiply", 12, 34), content="Let me compute."), result("multiply", "408"),
                  calls(call("add", 408, 5)), result("add", "413"), said("It is 413.")], "tools": [MULTIPLY, ADD]},
    {"messages": [user("3 x 4 and 5 x 6?"), calls(call("multiply", 3, 4), call("multiply", 5, 6)),
                  result("multiply", "12"), result("multiply", "30"), said("12 and 30")], "tools": [MULTIPLY]},
    {"messages": [user("Hi"), said("Hello!")], "tools": None},
    {"messages": [{"role": "system", "content": "You can use tools."}, user("Hi"), said("Hello! Ask me.")],
     "tools": [MULTIPLY]},
]
# The chatml-tools template TRL is given: the built-in one with TRL's {% generation %} markers around what each
# assistant message generates (after its '<|im_start|>assistant\n' header, through '<|im_end|>\n'), as TRL's
# chatml-style training templates put them.
ASSISTANT_CALLS = "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}{{- '<|im_start|>assistant\\n' }}"
CALLS_END = "{{- '<|im_end|>\\n' }}{%- else %}"
PLAIN = "{%- else %}{{- '<|im_start|>' + message['role']"


def training_template() -> str:
    from framework.templates import CHATML_TOOLS

    marked = CHATML_TOOLS
    for old, new in ((ASSISTANT_CALLS, ASSISTANT_CALLS + "{%- generation %}"),
                     (CALLS_END, "{{- '<|im_end|>\\n' }}{%- endgeneration %}{%- else %}"),
                     (PLAIN, "{%- elif message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
                             "{%- generation %}{{- message['content'] + '<|im_end|>\\n' }}{%- endgeneration %}" + PLAIN)):
        assert marked.count(old) == 1, old
        marked = marked.replace(old, new, 1)
    return marked


def tools_config(*overrides: str):
    return sft_config("data.chat_template=chatml-tools", "model.config.n_positions=1024", "data.block_size=1024",
                      *overrides)


def gpt2_tools():
    from transformers import AutoTokenizer

    from framework import templates

    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    templates.use_template(tokenizer, "chatml-tools")
    return tokenizer


def assistant_spans_in(text: str) -> list:
    """Independently of framework/templates.py: the character spans of every assistant turn's body in the rendered
    text, from after its '<|im_start|>assistant\\n' header through its '<|im_end|>\\n'."""
    return [m.span(1) for m in re.finditer(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>\n)", text, re.S)]


def test_chatml_tools_renders_tools_calls_and_results():
    """The template as rendered for one conversation, in full; without tools, calls and tool messages it is chatml."""
    from framework import templates

    tokenizer = gpt2_tools()
    text = tokenizer.apply_chat_template(ROWS[0]["messages"], tools=ROWS[0]["tools"], tokenize=False)
    schema_line = json.dumps(MULTIPLY)
    assert text == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + schema_line +
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>{\"name\": <function-name>, \"arguments\": <args-json-object>}"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nWhat is 37 x 58?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>{\"name\": \"multiply\", \"arguments\": {\"a\": 37, \"b\": 58}}</tool_call>"
        "<|im_end|>\n"
        "<|im_start|>tool\n<tool_response>2146</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n2146<|im_end|>\n"), text
    # A system message goes first in the system turn; content before the calls; one line per call.
    text = tokenizer.apply_chat_template(ROWS[1]["messages"], tools=ROWS[1]["tools"], tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and text.count("<|im_start|>system") == 1
    assert ("<|im_start|>assistant\nLet me compute.\n<tool_call>{\"name\": \"multiply\", \"arguments\": {\"a\": 12, "
            "\"b\": 34}}</tool_call><|im_end|>\n") in text
    text = tokenizer.apply_chat_template(ROWS[2]["messages"], tools=ROWS[2]["tools"], tokenize=False)
    assert ("</tool_call>\n<tool_call>{\"name\": \"multiply\", \"arguments\": {\"a\": 5, \"b\": 6}}</tool_call>"
            "<|im_end|>\n<|im_start|>tool\n<tool_response>12</tool_response><|im_end|>\n<|im_start|>tool\n"
            "<tool_response>30</tool_response><|im_end|>\n") in text
    plain = [[{"role": "system", "content": "Be brief."}, user("2+2?"), said("4"), user("and 3+3?"), said("6")],
             [user("Hi"), said("Hello!")]]
    chatml = gpt2_tools()
    templates.use_template(chatml, "chatml")
    for messages in plain:
        assert tokenizer.apply_chat_template(messages, tokenize=False) == chatml.apply_chat_template(messages,
                                                                                                     tokenize=False)
    # Arguments as JSON text (OpenAI's) render as the mapping.
    as_text = [dict(m, tool_calls=[{"type": "function", "function": {"name": "multiply", "arguments": '{"a": 37, '
                                                                                                      '"b": 58}'}}])
               if m.get("tool_calls") else m for m in ROWS[0]["messages"]]
    assert (templates.render(tokenizer, templates.conversation(as_text, "row"), "row", tools=ROWS[0]["tools"])
            == tokenizer.apply_chat_template(ROWS[0]["messages"], tools=ROWS[0]["tools"], tokenize=False))


def test_the_mask_is_exactly_the_assistant_turns_calls_included():
    """The labels sft prepares mark exactly the tokens overlapping the assistant turns' spans found in the rendered
    text by a regular expression; the tool list, the tool results and the headers are never targets."""
    cfg = tools_config()
    _, features, _, _ = ours(cfg, ROWS)
    tokenizer = gpt2_tools()
    trained_tokens = 0
    for row, feature in zip(ROWS, features):
        text = tokenizer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        assert feature["input_ids"] == encoded["input_ids"]
        spans = assistant_spans_in(text)
        expected = [int(b > a and any(a < end and b > start for start, end in spans))
                    for a, b in encoded["offset_mapping"]]
        mask = [int(label != -100) for label in feature["labels"]]
        assert mask[1:] == expected[1:] and mask[0] == 0
        trained = tokenizer.decode([t for t, m in zip(feature["input_ids"], mask) if m])
        assert trained == "".join(text[start:end] for start, end in spans)
        assert "<tools>" not in trained and "<tool_response>" not in trained and "system" not in trained
        trained_tokens += sum(mask)
    first = tokenizer.decode([t for t, label in zip(features[0]["input_ids"], features[0]["labels"]) if label != -100])
    assert first == ('<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 58}}</tool_call><|im_end|>\n'
                     '2146<|im_end|>\n')
    print(f"mask: {trained_tokens} trained tokens of {sum(len(f['input_ids']) for f in features)} in {len(ROWS)} "
          "conversations equal the regular expression's assistant spans")


def trl_tools_run(model, rows):
    """TRL's SFTTrainer (assistant_only_loss) over the same rows and model, with chatml-tools' training template."""
    return trl_run(model, rows, training_template(), added_tokens=["<tool_call>", "</tool_call>"],
                   assistant_only_loss=True)


def test_targets_and_loss_equal_trl_with_tools():
    model, features, _, loss = ours(tools_config(), ROWS)
    reference, trl_loss = trl_tools_run(model, ROWS)
    assert [f["input_ids"] for f in features] == [f["input_ids"] for f in reference]
    assert [f["labels"][1:] for f in features] == [f["labels"][1:] for f in reference]
    targets = sum(sum(label != -100 for label in f["labels"][1:]) for f in features)
    print(f"tools vs TRL: {targets} targets equal; loss {loss.item():.7f} vs TRL {trl_loss.item():.7f}, "
          f"|diff| {abs(loss.item() - trl_loss.item()):.1e}")
    torch.testing.assert_close(loss, trl_loss, rtol=0, atol=1e-5)


def test_packing_keeps_tool_conversations_whole():
    """Packed blocks hold whole conversations (each segment is one row's tokens, in order) and give the loss of the
    same conversations one per row."""
    rows = ROWS * 3
    model, alone, _, rows_loss = ours(tools_config(), rows)
    _, blocks, batch, packed_loss = ours(tools_config("data.packing=true", "data.block_size=700"), rows, model)
    assert len(blocks) < len(rows) and "position_ids" in batch
    segments = []
    for block in blocks:
        starts = [i for i, p in enumerate(block["position_ids"]) if p == 0] + [len(block["input_ids"])]
        segments += [(block["input_ids"][a:b], block["labels"][a:b]) for a, b in zip(starts, starts[1:])]
    assert segments == [(f["input_ids"], f["labels"]) for f in alone]
    torch.testing.assert_close(packed_loss, rows_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokenizer_path", [GPT2, SMOLLM2], ids=["gpt2", "smollm2"])
def test_a_tool_turn_s_tokens_are_the_conversation_s_own(tokenizer_path):
    """What the RL tools loop builds (the prompt, the sampled call through its </tool_call> id, tool_turn_ids of the
    results, the answer) is token for token the rendering SFT trains on; parse_tool_calls reads the calls back."""
    from transformers import AutoTokenizer

    from framework import templates

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    templates.use_template(tokenizer, "chatml-tools")
    stop = templates.tool_call_end_id(tokenizer)
    assert stop is not None and tokenizer.convert_ids_to_tokens(stop) == "</tool_call>"
    for row in ROWS[:3]:
        messages, tools = row["messages"], row["tools"]
        whole = templates.encode(tokenizer, templates.render(tokenizer, messages, "row", tools=tools))[0]
        built = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if i == 0 or messages[i - 1]["role"] != "tool":  # a turn the prompt leads to
                built = templates.encode(tokenizer, templates.render(tokenizer, messages[:i], "row", True, tools))[0]
            results = []
            for later in messages[i + 1:]:
                if later["role"] != "tool":
                    break
                results.append(later)
            turn = templates.render(tokenizer, messages[:i + 1], "row", tools=tools)[
                len(templates.render(tokenizer, messages[:i], "row", True, tools)):]
            if results:  # sampled through </tool_call>, then the loop's tokens
                sampled = templates.encode(tokenizer, turn[:turn.rindex("</tool_call>") + len("</tool_call>")])[0]
                assert sampled[-1] == stop
                text = tokenizer.decode(sampled)
                assert templates.parse_tool_calls(text) == [
                    (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
                built += sampled + templates.tool_turn_ids(tokenizer, results)
            else:  # the final answer, sampled through the end of its turn
                built += templates.encode(tokenizer, turn)[0]
        assert built == whole


def test_parse_tool_calls_names_each_malformed_call():
    from framework.templates import MalformedCall, ToolCall, parse_tool_calls

    text = ('Sure.\n<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
            '<tool_call>{"name": 3}</tool_call><tool_call>{"name": "f", "arguments": [1]}</tool_call>'
            '<tool_call>{not json</tool_call><tool_call>{"name": "multiply", "arguments": {"a": 1')
    parsed = parse_tool_calls(text)
    assert parsed[:2] == [ToolCall("multiply", {"a": 3, "b": 4}), ToolCall("add", {"a": 1, "b": 2})]
    assert all(isinstance(p, MalformedCall) for p in parsed[2:]) and len(parsed) == 6
    assert [p.reason.split(" (")[0] for p in parsed[2:]] == [
        'not a {"name": ..., "arguments": {...}} object', "its arguments are not a JSON object", "not JSON",
        "no </tool_call> after it"]
    assert parse_tool_calls("no call here") == []


# ---------------------------------------------------------------- through the CLI


def multiplications(n: int, seed: int) -> list:
    """Tool demonstrations over one-digit factors: the user asks, the assistant calls multiply, the tool answers,
    the assistant repeats the product; a third of them carry a system message."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        messages = [user(f"what is {a} x {b} ?"), calls(call("multiply", a, b)), result("multiply", str(a * b)),
                    said(str(a * b))]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "use the tools"})
        rows.append({"messages": messages, "tools": [MULTIPLY]})
    return rows


@pytest.fixture(scope="module")
def tool_data(tmp_path_factory):
    """(word-level tokenizer, tool conversations jsonl)."""
    from framework.testing import save_word_tokenizer

    folder = tmp_path_factory.mktemp("sft_tools")
    words = ([str(n) for n in range(100)] + ["what", "is", "x", "use", "the", "tools", "name", "arguments", "a", "b",
                                             "multiply", "system", "user", "assistant", "tool"])
    path = folder / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in multiplications(160, seed=0)))
    return save_word_tokenizer(folder / "tokenizer", words), path


def tool_args(tool_data, out, *extra: str) -> list:
    tokenizer, data = tool_data
    return ["--config", str(TINY_LM), "task=sft", f"model.tokenizer={tokenizer}", f"data.train_file={data}",
            "data.chat_template=chatml-tools", "model.config.n_positions=512", "data.block_size=512",
            f"output_dir={out}", *extra]


def test_sft_trains_on_tool_conversations_through_the_cli(tool_data, hf_home, tmp_path, capsys):
    """The tools column is read (in memory and streamed); each conversation's two answers (its call, its product)
    are evaluated; the saved tokenizer keeps chatml-tools and its call tokens."""
    out = tmp_path / "run"
    assert run_main(tool_args(tool_data, out, "train.max_steps=6", "train.batch_size=4"), hf_home) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval"]["answers"] == 2 * 16, summary["eval"]  # 10% of 160 held out
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(out / "model")
    assert "<tools>" in saved.chat_template and len(saved("</tool_call>", add_special_tokens=False)["input_ids"]) == 1
    assert run_main(tool_args(tool_data, tmp_path / "stream", "data.streaming=true", "train.max_steps=2",
                              "train.batch_size=4"), hf_home) == 0
    capsys.readouterr()


def test_new_token_rows_start_from_their_pieces(tmp_path):
    """The rows chatml-tools adds to a pretrained model start as the mean of the rows of the pieces their text is
    (distinct, deterministic), and are marked for the adapters to train."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from framework import templates

    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_layer=1, n_head=2, n_embd=16, n_positions=64))
    old = model.get_input_embeddings().weight.detach().clone()
    templates.use_template(tokenizer, "chatml-tools")
    templates.resize_embeddings(model, tokenizer)
    weight = model.get_input_embeddings().weight.detach()
    assert getattr(model, templates.NEW_ROWS) == list(range(len(old), len(old) + 4)) == tokenizer.convert_tokens_to_ids(
        ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"])
    assert torch.equal(weight[:len(old)], old) and model.get_output_embeddings().weight is model.get_input_embeddings().weight
    pieces = {"<tool_call>": ["<", "tool", "_", "call", ">"], "</tool_call>": ["</", "tool", "_", "call", ">"]}
    for token, text in pieces.items():
        ids = tokenizer.convert_tokens_to_ids(text)
        torch.testing.assert_close(weight[tokenizer.convert_tokens_to_ids(token)], old[ids].mean(0))
    assert (weight[-1] - weight[-2]).norm() > 0.1 * weight[-1].norm()


def test_lora_trains_the_new_token_rows(tool_data, hf_home, tmp_path, capsys, recwarn):
    """LoRA on a pretrained model that chatml-tools gives four new tokens: their embedding rows (tied to the output
    layer) train beside the adapters and every other row stays. Frozen, a new row (the mean of its pieces' rows)
    could never be a greedy choice, and every answer ends with one (<|im_end|>), so no held-out answer would be
    reproduced; trained, they win greedy choices."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config

    from framework import templates

    tokenizer_path, _ = tool_data
    base = tmp_path / "base"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_head=2, n_embd=32, n_positions=512, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = tmp_path / "lora"
    args = tool_args(tool_data, out, "model.config=null", f"model.name_or_path={base}", "peft.r=8", "peft.merge=true",
                     "peft.target_modules=all-linear", "train.max_steps=12", "train.batch_size=4", "optim.lr=1e-2")
    assert run_main(args, hf_home) == 0
    capsys.readouterr()
    assert [str(w.message) for w in recwarn if "save_embedding_layers" in str(w.message)] == []
    summary = json.loads((out / "summary.json").read_text())
    before = AutoModelForCausalLM.from_pretrained(base).get_input_embeddings().weight.detach()
    after = AutoModelForCausalLM.from_pretrained(out / "model").get_input_embeddings().weight.detach()
    saved = AutoTokenizer.from_pretrained(out / "model")
    assert after.shape[0] == len(before) + 4 and torch.equal(after[:len(before)], before)
    for token in ("<|im_end|>", "<tool_call>", "</tool_call>"):
        row = saved.convert_tokens_to_ids(token)
        assert not torch.allclose(after[row], before[templates.text_pieces(saved, token)].mean(0)), token
    # Where a conversation's targets are new tokens, the tuned model's greedy choice is the new token (a frozen row,
    # the mean of its pieces' rows, scores the mean of their scores: never above the best of them).
    tuned = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    row = multiplications(8, seed=1)
    new_rows = set(range(len(before), len(after)))
    won = 0
    for conversation in row:
        ids, mask = templates.conversation_tokens(saved, templates.conversation(conversation["messages"], "r"), "r",
                                                  conversation["tools"])
        with torch.no_grad():
            greedy = tuned(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        won += sum(1 for t in range(1, len(ids)) if mask[t] and ids[t] in new_rows and greedy[t - 1] == ids[t])
    print(f"LoRA + new rows: trainable {summary['memory']['trainable_parameters']}, eval {summary['eval']}, "
          f"new-token targets predicted: {won}")
    assert won > 0
    # LoRA r 8 on GPT-2's c_attn, attention c_proj, c_fc and MLP c_proj (2 layers), and the 4 new rows of 32.
    assert summary["memory"]["trainable_parameters"] == 2 * 8 * (32 + 96 + 32 + 32 + 32 + 128 + 128 + 32) + 4 * 32


@pytest.mark.parametrize("rows,overrides,message", [
    ([{"messages": [user("hi"), said("yo")], "tools": [{"type": "function", "function": {"description": "no name"}}]}],
     [], "sft.tools_column, the row"),
    ([{"messages": [user("hi"), said("yo")], "tools": "multiply(a, b)"}], [], "sft.tools_column, the row"),
    (None, ["sft.tools_column=functions"], "sft.tools_column: column 'functions' is not in"),
    ([{"messages": [user("hi"), calls({"type": "function", "function": {"arguments": {}}})], "tools": [MULTIPLY]}], [],
     "tool call 0"),
    (None, ["data.chat_template=chatml"], "data.chat_template: the chat template ignores the tools of"),
    (None, [f"data.chat_template={SMOLLM2 / 'chat_template.jinja'}"], "data.chat_template: the chat template ignores "
                                                                      "the tools of"),
    ([{"messages": [user("3 x 4"), calls(call("multiply", 3, 4), content=""), result("multiply", "12"), said("12")]}],
     ["data.chat_template=chatml"], "data.chat_template: the chat template ignores the tool calls of"),
    ([{"messages": [user("3 x 4"), calls(call("multiply", 3, 4)), result("multiply", "12"), said("12")]}],
     ["data.chat_template=chatml"], "data.chat_template: the chat template cannot render the tool calls of"),
], ids=["schema without a name", "not JSON", "absent column", "call without a name", "chatml ignores tools",
        "SmolLM2's template ignores tools", "chatml ignores calls", "chatml cannot render calls"])
def test_bad_tools_exit_2_naming_the_key(rows, overrides, message, tool_data, hf_home, tmp_path):
    tokenizer, data = tool_data
    if rows is not None:
        data = tmp_path / "bad.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows * 12))
    proc = run_captured(tool_args((tokenizer, data), tmp_path / "out", *overrides), hf_home)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    print(proc.stderr.strip().splitlines()[-1])
    if message.startswith("data.chat_template"):
        assert "such as the built-in chatml-tools" in proc.stderr, proc.stderr

"""Held-out accuracy of a chat model on multiplications with the calculator tool (issue 46): greedy answers, the
tool run by this script as an RL tools loop would run it, through framework/templates.py's tool helpers.

    .venv/bin/python benchmarks/tool_use.py MODEL [MODEL ...] [--prompts assets/tool_prompts.jsonl] [--limit 100]

Each MODEL is a model folder (the untouched assets/SmolLM2-135M-Instruct, or an sft run's model/). Its tokenizer
gets chatml-tools (the untouched model's embeddings grow for <tool_call> and </tool_call>), and each prompt is
rendered with the multiply tool's schema (recipes/tools/calculator.py, through transformers' get_json_schema) in
the system turn. Then, at most ``--max-calls`` times: the model samples greedily until ``</tool_call>`` (one id,
``templates.tool_call_end_id``) or the end of its turn; a segment ending in ``</tool_call>`` has its call parsed
(``templates.parse_tool_calls``) and run, and ``templates.tool_turn_ids`` of the result appended before sampling
resumes; a segment ending the turn is the answer. A call written as plain text that ends the turn (the untouched
model spells ``<tool_call>`` in pieces, so its calls never end at the one id) is run too: the conversation is
rendered again with the call and its result, and sampling resumes after it.

Reported per model: ``correct`` (the answer, stripped, is the product), ``last_number`` (the last number it
writes is), ``called`` (it made a well-formed call), ``right_call`` (multiply with the prompt's two factors), and,
in its own template without the tool (in its head), ``correct`` and ``last_number`` again.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the framework, from this clone
from framework import templates  # noqa: E402

CALCULATOR = ROOT / "recipes" / "tools" / "calculator.py"
NUMBER = re.compile(r"-?\d[\d,]*")


def calculator():
    """({name: function}, [JSON schema]) of recipes/tools/calculator.py's multiply."""
    from transformers.utils import get_json_schema

    spec = importlib.util.spec_from_file_location("calculator", CALCULATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {"multiply": module.multiply}, [get_json_schema(module.multiply)]


def run_call(call, functions) -> str:
    """What the tool returns for ``call``: its result as text, or the error it met."""
    if isinstance(call, templates.MalformedCall):
        return f"error: {call.reason}"
    if call.name not in functions:
        return f"error: no tool named {call.name}"
    try:
        return str(functions[call.name](**call.arguments))
    except Exception as e:  # the model's arguments: whatever they break is the tool's answer
        return f"error: {e}"


def greedy(model, ids, stop, max_new_tokens, pad_id):
    inputs = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=pad_id)
    return out[0, len(ids):].tolist()


def with_tool(model, tokenizer, prompt, tools, functions, max_calls: int, max_new_tokens: int):
    """(answer text, the calls made) for one prompt, the tool run between the model's turns."""
    messages, where = list(prompt), "prompt"
    ids = templates.encode(tokenizer, templates.render(tokenizer, messages, where, True, tools))[0]
    call_end = templates.tool_call_end_id(tokenizer)
    stop = [call_end] + templates.end_of_turn_ids(tokenizer, "chatml-tools")
    made = []
    while True:
        new = greedy(model, ids, stop, max_new_tokens, tokenizer.pad_token_id)
        text = tokenizer.decode(new, skip_special_tokens=True)
        calls = templates.parse_tool_calls(text)
        if len(made) >= max_calls or not calls:
            return text, made
        if new[-1] == call_end:  # the RL loop's path: the call's tokens, then the tool turn's
            result = run_call(calls[-1], functions)
            name = getattr(calls[-1], "name", "tool")
            made.append(calls[-1])
            ids = ids + new + templates.tool_turn_ids(tokenizer, [{"role": "tool", "name": name, "content": result}])
            continue
        # Calls written as text, then the end of the turn: render the conversation again with them and their results.
        good = [c for c in calls if isinstance(c, templates.ToolCall)]
        made += calls
        if not good:
            return text, made
        messages.append({"role": "assistant", "content": text[:text.index(templates.TOOL_CALL_START)].strip(),
                         "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                        for c in good]})
        messages += [{"role": "tool", "name": c.name, "content": run_call(c, functions)} for c in good]
        ids = templates.encode(tokenizer, templates.render(tokenizer, messages, where, True, tools))[0]


def last_number(text: str):
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def factors(prompt) -> list:
    return sorted(int(n) for n in re.findall(r"\d+", prompt[-1]["content"]))


def evaluate(path: str, rows, args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    own = tokenizer.chat_template
    functions, tools = calculator()
    templates.use_template(tokenizer, "chatml-tools")
    templates.resize_embeddings(model, tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    figures = {"correct": 0, "last_number": 0, "called": 0, "right_call": 0, "in_head_correct": 0,
               "in_head_last_number": 0}
    examples, start = [], time.perf_counter()
    for row in rows:
        answer, made = with_tool(model, tokenizer, row["prompt"], tools, functions, args.max_calls, args.max_new_tokens)
        good = [c for c in made if isinstance(c, templates.ToolCall)]
        figures["correct"] += answer.strip() == row["answer"]
        figures["last_number"] += last_number(answer) == row["answer"]
        figures["called"] += bool(good)
        figures["right_call"] += any(c.name == "multiply" and sorted(map(str, c.arguments.values())) == sorted(
            map(str, factors(row["prompt"]))) for c in good)
        if len(examples) < 3:
            examples.append({"prompt": row["prompt"][-1]["content"], "calls": [str(c) for c in made],
                             "answer": answer, "expected": row["answer"]})
    tool_seconds = time.perf_counter() - start
    if not args.skip_in_head:  # the same model without the tool, in its own template
        tokenizer.chat_template = own
        for row in rows:
            ids = templates.encode(tokenizer, templates.render(tokenizer, row["prompt"], "prompt", True))[0]
            new = greedy(model, ids, templates.end_of_turn_ids(tokenizer, None), args.max_new_tokens,
                         tokenizer.pad_token_id)
            answer = tokenizer.decode(new, skip_special_tokens=True)
            figures["in_head_correct"] += answer.strip() == row["answer"]
            figures["in_head_last_number"] += last_number(answer) == row["answer"]
    n = len(rows)
    return {"model": path, "prompts": n, **{k: round(v / n, 3) for k, v in figures.items()},
            "seconds_with_tool": round(tool_seconds, 1), "examples": examples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--prompts", default=str(ROOT / "assets" / "tool_prompts.jsonl"))
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--max-calls", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--skip-in-head", action="store_true", help="skip the answers without the tool")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()[:args.limit]]
    for path in args.models:
        print(json.dumps(evaluate(path, rows, args)), flush=True)


if __name__ == "__main__":
    main()

"""The chat command (python -m framework.chat): on a tiny Llama trained by SFT (a word-level tokenizer with ChatML's
tokens and template), the replies to a file of prompts equal transformers.pipeline("text-generation")'s greedy ones;
the interactive form, driven through its standard input, answers with the conversation so far, /reset starts it
again and /exit ends with status 0; a checkpoint chats as the model it was then; a GGUF file as transformers reads
it; bad input exits 2 with one line naming the path."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from framework import chat, export
from helpers import LLAMA_CONFIG, ROOT, environment, save_causal_lm, sft_args, tiny_args, write_jsonl
from in_process import run_main

TOKENS = 6  # the replies' length: the tiny model rarely stops on its own
# Plain prompts (user messages over the review words the model trained on), and a conversation with a system prompt.
PROMPTS = ["the movie was good and lovely", "a dull film", "the plot had some boring music"]
CONVERSATION = [{"role": "system", "content": "answer with one word"},
                {"role": "user", "content": "this story was superb"}]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, chat_data, hf_home):
    """A tiny Llama trained for 20 steps on review conversations (chatml), a checkpoint every 10 steps."""
    out = tmp_path_factory.mktemp("chat") / "sft"
    assert run_main(sft_args(chat_data, out, *LLAMA_CONFIG, "train.max_steps=20", "checkpoint.every_steps=10"),
                    hf_home) == 0
    return out


def pipeline_reply(model_dir, messages, gguf_file=None):
    """transformers' own greedy reply to a conversation (the model in ``model_dir``, or its GGUF file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model, tokenizer = str(model_dir), None
    if gguf_file is not None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    generate = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    return generate(messages, max_new_tokens=TOKENS, do_sample=False)[0]["generated_text"][-1]["content"]


def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS[:2] + ["", json.dumps(CONVERSATION), PROMPTS[2]]) + "\n")
    return path


def command(hf_home, *args, stdin=None):
    """``python -m framework.chat ARGS`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "framework.chat", *map(str, args)], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=300, env=environment(hf_home))


def test_replies_to_a_prompt_file_equal_the_pipelines_greedy_ones(sft_run, tmp_path, hf_home):
    done = command(hf_home, sft_run / "model", "--prompts", prompts_file(tmp_path), "--max-new-tokens", TOKENS)
    assert done.returncode == 0, done.stderr[-3000:]
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["prompt"] for r in replies] == PROMPTS[:2] + [CONVERSATION, PROMPTS[2]]
    expected = [pipeline_reply(sft_run / "model", [{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    expected += [pipeline_reply(sft_run / "model", CONVERSATION),
                 pipeline_reply(sft_run / "model", [{"role": "user", "content": PROMPTS[2]}])]
    print("replies:", [r["reply"] for r in replies])
    assert [r["reply"] for r in replies] == expected and all(expected)
    # --system: before every plain prompt, and not over a conversation's own.
    system = command(hf_home, sft_run / "model", "--prompts", prompts_file(tmp_path), "--max-new-tokens", TOKENS,
                     "--system", "answer with one word")
    got = [json.loads(line)["reply"] for line in system.stdout.splitlines()]
    assert got[0] == pipeline_reply(sft_run / "model", [CONVERSATION[0], {"role": "user", "content": PROMPTS[0]}])
    assert got[2] == expected[2]


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    """A tiny random Llama with wide weights (helpers.save_causal_lm: a byte-level BPE tokenizer, ChatML): unlike the
    trained one, whose answer follows its question's last word, every earlier token moves its replies."""
    folder = tmp_path_factory.mktemp("random") / "model"
    save_causal_lm(folder)
    return folder


def test_the_interactive_chat_keeps_the_conversation_resets_and_exits(random_llama, hf_home):
    """Driven through its standard input: the second answer is to the conversation so far, the third (after /reset)
    to its question alone; /exit ends with 0 before the last line is read."""
    first, second = "the movie was good", "What is 26 + 28?"
    done = command(hf_home, random_llama, "--max-new-tokens", TOKENS,
                   stdin=f"{first}\n{second}\n/reset\n{second}\n/exit\nnever read\n")
    assert done.returncode == 0, done.stderr[-3000:]
    turns = done.stdout.split("> ")[1:]
    assert len(turns) == 5 and turns[2] == "(the conversation starts again)\n", turns
    assert all(turn.endswith("\n") for turn in turns[:4]) and turns[4] == ""  # /exit: nothing after its prompt
    replies = [turns[0][:-1], turns[1][:-1], turns[3][:-1]]
    alone = pipeline_reply(random_llama, [{"role": "user", "content": second}])
    so_far = pipeline_reply(random_llama, [{"role": "user", "content": first},
                                           {"role": "assistant", "content": replies[0]},
                                           {"role": "user", "content": second}])
    assert so_far != alone  # the conversation changes the answer: the check below sees the history
    assert replies == [pipeline_reply(random_llama, [{"role": "user", "content": first}]), so_far, alone]
    assert "/reset starts the conversation again" in done.stderr and "never read" not in done.stdout


TOOLS = '''
def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
'''


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_tool_calls_run_between_turns_and_their_results_reach_the_model(random_llama, tmp_path, capsys, source):
    """--tools with chatml-tools, on the model's folder and on its f16 GGUF export: a conversation whose assistant
    message ends in a call (the model's, continued) runs it, gives the result back in a tool turn, and the model
    then answers: the answer equals transformers' greedy generation (on the folder, or on the GGUF file as
    transformers reads it) from the whole conversation with the tool's schema; a call with a missing argument is
    the model's mistake (its result an error), not a crash; a template that cannot show tools is refused by name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import get_json_schema

    from framework import templates

    (tmp_path / "calc.py").write_text(TOOLS)
    user = {"role": "user", "content": "What is 2 + 3?"}
    calls = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>']
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(json.dumps([user, {"role": "assistant", "content": c}]) + "\n" for c in calls))
    path = random_llama if source == "folder" else export.export_gguf(random_llama, "f16", tmp_path / "tiny.gguf")
    args = [str(path), "--prompts", str(prompts), "--max-new-tokens", str(TOKENS), "--tools",
            f"{tmp_path / 'calc.py'}:add", "--chat-template", "chatml-tools"]
    assert chat.main(args) == 0
    first, second = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    assert first["turns"][:2] == [{"role": "assistant", "content": "", "tool_calls": [call]},
                                  {"role": "tool", "name": "add", "content": "5"}]
    assert first["reply"] == first["turns"][2]["content"] and len(first["turns"]) == 3
    assert second["turns"][1]["content"].startswith("{'error': ") and "'b'" in second["turns"][1]["content"]

    # transformers alone: the template's rendering of the conversation so far with the tool's schema, greedy.
    namespace = {}
    exec(TOOLS, namespace)
    where = {} if source == "folder" else {"gguf_file": path.name}
    folder = random_llama if source == "folder" else path.parent
    tokenizer = AutoTokenizer.from_pretrained(folder, **where)
    templates.use_template(tokenizer, "chatml-tools")
    model = AutoModelForCausalLM.from_pretrained(folder, **where)
    templates.resize_embeddings(model, tokenizer)
    ids = tokenizer.apply_chat_template([user, *first["turns"][:2]], tools=[get_json_schema(namespace["add"])],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    stop = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "</tool_call>")]
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=TOKENS, do_sample=False, eos_token_id=stop,
                             pad_token_id=tokenizer.pad_token_id or stop[0])
    assert first["reply"] == tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    # The model's own template shows no tools: refused, naming the option that chooses the template.
    assert chat.main(args[:-2]) == 2
    assert "error: --chat-template: the chat template ignores the tools of --tools: it renders the conversation " \
           "the same without them; set --chat-template to a template that renders tools and tool calls" \
           in capsys.readouterr().err


def test_a_checkpoint_chats_as_the_model_it_was(sft_run, tmp_path, capsys):
    """checkpoints/step_20 (accelerate's state: the weights, rebuilt into the model the run's recipe makes, with the
    run's tokenizer and template) answers as model/, saved at the same step."""
    prompts = prompts_file(tmp_path)
    assert chat.main([str(sft_run / "checkpoints" / "step_20"), "--prompts", str(prompts), "--max-new-tokens",
                      str(TOKENS)]) == 0
    from_checkpoint = capsys.readouterr().out
    assert chat.main([str(sft_run / "model"), "--prompts", str(prompts), "--max-new-tokens", str(TOKENS)]) == 0
    assert from_checkpoint == capsys.readouterr().out and from_checkpoint.count("\n") == 4
    assert chat.main([str(sft_run / "checkpoints" / "step_10"), "--prompts", str(prompts), "--max-new-tokens",
                      str(TOKENS)]) == 0
    assert capsys.readouterr().out.count("\n") == 4  # an earlier model answers too


def test_a_lora_checkpoint_and_adapter_folder_chat_as_the_merged_model(sft_run, chat_data, hf_home, tmp_path, capsys):
    """LoRA on the trained model (model.name_or_path: its model/), model/ holding the adapter only: the checkpoint
    at the last step (the adapter's weights in the model the recipe builds, merged) and the adapter folder (merged
    into its local base) answer alike."""
    out = tmp_path / "lora"
    assert run_main(sft_args(chat_data, out, "model.config=null", f"model.name_or_path={sft_run / 'model'}",
                             "model.tokenizer=null", "peft.r=4", "optim.lr=3e-2", "train.max_steps=4",
                             "checkpoint.every_steps=4"), hf_home) == 0
    assert (out / "model" / "adapter_config.json").is_file() and not (out / "model" / "config.json").exists()
    capsys.readouterr()
    prompts = prompts_file(tmp_path)
    replies = []
    for path in (out / "checkpoints" / "step_4", out / "model"):
        assert chat.main([str(path), "--prompts", str(prompts), "--max-new-tokens", str(TOKENS)]) == 0
        replies.append([json.loads(line)["reply"] for line in capsys.readouterr().out.splitlines()])
    assert replies[0] == replies[1] and len(replies[0]) == 4, replies


def test_a_gguf_file_chats_as_transformers_reads_it(random_llama, tmp_path, capsys):
    """The random Llama exported as GGUF (its tokenizer and ChatML template in the file): its replies are the
    pipeline's on the file."""
    path = export.export_gguf(random_llama, "f16", tmp_path / "tiny.gguf")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the movie was good\nWhat is 26 + 28?\n")
    assert chat.main([str(path), "--prompts", str(prompts), "--max-new-tokens", str(TOKENS)]) == 0
    replies = [json.loads(line)["reply"] for line in capsys.readouterr().out.splitlines()]
    expected = [pipeline_reply(tmp_path, [{"role": "user", "content": p}], gguf_file=path.name)
                for p in ("the movie was good", "What is 26 + 28?")]
    assert replies == expected and all(expected)


def test_sampling_flags_sample_and_a_seed_repeats_them(sft_run, tmp_path, capsys):
    prompts = tmp_path / "one.txt"
    prompts.write_text(PROMPTS[0] + "\n")
    runs = []
    for seed in (1, 1, 2, 3):
        assert chat.main([str(sft_run / "model"), "--prompts", str(prompts), "--max-new-tokens", "12",
                          "--temperature", "5", "--seed", str(seed)]) == 0
        runs.append(json.loads(capsys.readouterr().out)["reply"])
    assert runs[0] == runs[1] and len(set(runs)) > 1  # seeded, and not greedy


def bad_inputs(tmp_path, sft_run, tiny_model, classifier_run, pretrained_lm):
    """(arguments, what the one line must say) for each refusal."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    (tmp_path / "notes.txt").write_text("hello")
    sharded = tmp_path / "sharded_step"
    shutil.copytree(sft_run / "checkpoints" / "step_20", sharded)
    shutil.rmtree(sharded / "states")  # as DeepSpeed's and XLA's own checkpoints are: no DCP states
    bad = write_jsonl(tmp_path / "bad.txt", [[{"role": "robot", "content": "hi"}]])
    model = str(sft_run / "model")
    return [
        ([str(tmp_path / "missing")], f"{tmp_path / 'missing'} does not exist"),
        ([str(tmp_path / "empty")], f"{tmp_path / 'empty'} holds no model"),
        ([str(tmp_path / "notes.txt")], "is a file but not a .gguf one"),
        ([str(tmp_path / "junk.gguf")], f"{tmp_path / 'junk.gguf'}: transformers cannot read this GGUF file"),
        ([str(tiny_model)], "holds a BertForSequenceClassification (model_type bert), not a causal language model"),
        ([str(classifier_run / "checkpoints" / "step_4")], "a checkpoint of task text_classification"),
        ([str(sharded)], "DeepSpeed's or XLA's own checkpoint"),
        ([str(pretrained_lm)], "--chat-template: the tokenizer has no chat template of its own"),
        ([model, "--chat-template", "nothing.jinja"], "--chat-template: 'nothing.jinja' is neither"),
        ([model, "--prompts", str(tmp_path / "none.txt")], f"--prompts: {tmp_path / 'none.txt'} is not a file"),
        ([model, "--prompts", str(bad)], f"--prompts: {bad}:1: message 0 has the unknown role 'robot'"),
        ([model, "--top-p", "1.5"], "--top-p"),
    ]


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory, tiny_model, easy_data, hf_home):
    out = tmp_path_factory.mktemp("classifier") / "run"
    assert run_main(tiny_args(tiny_model, easy_data, out, "train.max_steps=4", "checkpoint.every_steps=4"),
                    hf_home) == 0
    return out


def test_bad_input_exits_2_with_one_line_naming_it(sft_run, tiny_model, classifier_run, pretrained_lm, tmp_path,
                                                   hf_home, capsys):
    for argv, says in bad_inputs(tmp_path, sft_run, tiny_model, classifier_run, pretrained_lm):
        assert chat.main(argv) == 2, argv
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert err.startswith("error: ") and says in err and "\n" not in err, (argv, err)
        assert captured.out == "", argv
    done = command(hf_home, tmp_path / "missing")  # the real boundary: no traceback
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "does not exist" in done.stderr, done.stderr

"""Supervised fine-tuning (task sft): its target masks and loss equal TRL's SFTTrainer's for the same rows and
templates; conversations pack without seeing each other; it trains through the CLI, exports a model whose
pipeline answers a conversation in its template; long conversations and bad rows are counted or refused by key
(1 process = 2 = accumulation and exact resume: tests/test_task_contract.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import datasets
import pytest
import torch

from framework.recipe import load_config
from framework.tasks import get_task
from helpers import ROOT, TINY_LM, review_conversations, run_splits, sft_args
from in_process import run_captured, run_main

GPT2 = ROOT / "assets" / "gpt2-tokenizer"
# The built-in chatml with TRL's {% generation %} markers where TRL's chatml-style training templates put them
# (qwen3_training, nemotron_*_training: after the '<|im_start|>assistant\n' header, through '<|im_end|>\n').
CHATML_TRAINING = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endgeneration %}{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?\n"},
     {"role": "assistant", "content": " 6\n\n"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "user", "content": "Is this review fresh or rotten? A dull, tired film."},
     {"role": "assistant", "content": "rotten"}],
]
PROMPT_COMPLETION = [{"prompt": "The sky is", "completion": " blue."}, {"prompt": "2 + 2 =", "completion": " 4"},
                     {"prompt": "Review: a delight.\nVerdict:", "completion": " fresh"}]


def sft_config(*overrides: str):
    return load_config(TINY_LM, ["task=sft", f"model.tokenizer={GPT2}", "data.train_file=unused.jsonl",
                                 "data.packing=false", "data.block_size=256", "model.config.n_positions=256", *overrides])


def ours(cfg, rows, model=None):
    """(model, features, batch, loss per target) through the task's own load (or ``model``), prepare and collator."""
    task = get_task("sft")
    loaded, tokenizer = task.load(cfg, None, None)
    model = (model or loaded).eval()
    features = task.prepare(datasets.Dataset.from_list(rows), tokenizer, model, cfg)
    batch = task.collator(tokenizer, cfg, None)(list(features))
    run = task.bind(cfg, model, None)
    with torch.no_grad():
        loss = run.loss_sum(model, batch) / run.targets(batch)
    return model, features, batch, loss


def trl_run(model, rows, template, added_tokens=(), **options):
    """TRL's SFTTrainer over the same rows and model: its prepared features and its loss on one batch.
    ``added_tokens``: ordinary tokens the template's tokenizer adds after chatml's (chatml-tools' call tags)."""
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)  # the ids templates.use_template gives
    tokenizer.add_tokens(list(added_tokens))
    tokenizer.chat_template = template
    args = SFTConfig(output_dir="unused", report_to=[], use_cpu=True, max_length=None,
                     dataset_num_proc=None, **options)
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer)
    features = [{k: f[k] for k in ("input_ids", "labels")} for f in trainer.train_dataset]
    with torch.no_grad():
        loss = trainer.compute_loss(model, trainer.data_collator(features))
    return features, loss


# case: (our overrides, the template TRL gets: a chat_templates/ file of TRL's or a text, SFTConfig options, rows)
CASES = {
    # built-in chatml, no markers, against TRL with the same template marked
    "chatml assistant": (["data.chat_template=chatml"], CHATML_TRAINING, {"assistant_only_loss": True}, "messages"),
    # TRL's own Phi-3 and Llama 3 templates (no markers), given to TRL too, which swaps in its phi3_training.jinja
    # and llama3_training.jinja (Phi-3's EOS after a final answer: inside the last turn only)
    "phi3 assistant": (["data.chat_template={trl}/phi3.jinja"], "phi3.jinja", {"assistant_only_loss": True}, "messages"),
    "llama3 assistant": (["data.chat_template={trl}/llama3.jinja"], "llama3.jinja", {"assistant_only_loss": True},
                         "messages"),
    "chatml all": (["data.chat_template=chatml", "sft.train_on=all"], CHATML_TRAINING, {}, "messages"),
    "text completion": (["sft.train_on=completion"], None, {"completion_only_loss": True}, "strings"),
    "chat completion": (["data.chat_template=chatml", "sft.train_on=completion"], CHATML_TRAINING,
                        {"completion_only_loss": True}, "chats"),
}


def case_rows(kind: str):
    if kind == "messages":
        return [{"messages": c} for c in CONVERSATIONS]
    if kind == "strings":
        return PROMPT_COMPLETION
    # conversations split before their last answer, as TRL's conversational prompt-completion rows
    return [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS if c[-1]["role"] == "assistant"]


@pytest.mark.parametrize("case", list(CASES))
def test_targets_and_loss_equal_trl(case):
    overrides, template, options, kind = CASES[case]
    trl = Path(importlib.util.find_spec("trl").origin).parent / "chat_templates"
    overrides = [o.format(trl=trl) for o in overrides]
    if template is not None and template.endswith(".jinja"):
        template = (trl / template).read_text()
    rows = case_rows(kind)
    model, features, _, loss = ours(sft_config(*overrides), rows)
    reference, trl_loss = trl_run(model, rows, template, **options)
    assert [f["input_ids"] for f in features] == [f["input_ids"] for f in reference]
    # TRL's labels are the ids where trained on (its loss shifts them); ours too, with the first token never one.
    assert [f["labels"][1:] for f in features] == [f["labels"][1:] for f in reference]
    targets = sum(sum(label != -100 for label in f["labels"][1:]) for f in features)
    print(f"{case}: {targets} targets equal; loss {loss.item():.7f} vs TRL {trl_loss.item():.7f}, "
          f"|diff| {abs(loss.item() - trl_loss.item()):.1e}")
    assert targets > len(rows)
    torch.testing.assert_close(loss, trl_loss, rtol=0, atol=1e-5)


def test_assistant_mask_spans_only_answers():
    """chatml: the answer and its '<|im_end|>\\n' are targets; headers, system, user and tool messages never."""
    from transformers import AutoTokenizer

    from framework import templates

    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    templates.use_template(tokenizer, "chatml")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A1"}, {"role": "tool", "content": "T"},
                {"role": "assistant", "content": "A2"}]
    ids, mask = templates.conversation_tokens(tokenizer, messages, "row")
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "A1<|im_end|>\nA2<|im_end|>\n"


def test_packed_conversations_equal_one_per_row():
    """Packed blocks (several conversations each, a padded segment at the end) give the loss and the per-target
    outputs of the same conversations one per row."""
    rows = [{"messages": c} for c in CONVERSATIONS * 3]
    model, rows_features, rows_batch, rows_loss = ours(sft_config("data.chat_template=chatml"), rows)
    cfg = sft_config("data.chat_template=chatml", "data.packing=true", "data.block_size=120")
    _, blocks, blocks_batch, packed_loss = ours(cfg, rows, model)
    assert len(blocks) < len(rows_features) and "position_ids" in blocks_batch
    torch.testing.assert_close(packed_loss, rows_loss, rtol=1e-5, atol=1e-6)
    run = get_task("sft").bind(cfg, model, None)
    with torch.no_grad():
        packed = run.eval_outputs(model, blocks_batch)
        alone = run.eval_outputs(model, rows_batch)
    for key in ("targets", "correct", "answers", "answers_correct"):
        assert packed[key].sum() == alone[key].sum(), key
    assert int(alone["answers"].sum()) == sum(m["role"] == "assistant" for c in CONVERSATIONS for m in c) * 3


def test_answer_accuracy_counts_answers_reproduced_exactly():
    from framework.tasks.sft import answer_outputs

    targets = torch.tensor([[-100, 5, 6, -100, 7, -100, 8, 9, -100]])
    logits = torch.zeros(1, 9, 10)
    for position, token in enumerate([0, 5, 6, 0, 1, 0, 8, 9, 0]):  # the second answer (7) is predicted wrong
        logits[0, position, token] = 1.0
    out = answer_outputs((logits.argmax(dim=-1) == targets) & (targets != -100), targets)
    assert out["answers"].tolist() == [3] and out["answers_correct"].tolist() == [2]


# ---------------------------------------------------------------- through the CLI


def test_sft_trains_and_its_pipeline_answers_in_chatml(chat_data, hf_home, tmp_path, capsys):
    """The answers' loss falls from a vocabulary's worth to the two words' (it learns the format: a verdict, then
    <|im_end|>), and model/ answers a conversation through pipeline(), stopping at the end of its turn."""
    out = tmp_path / "sft"
    assert run_main(sft_args(chat_data, out, "train.max_steps=20", "train.batch_size=8", "optim.lr=1e-2",
                             "train.log_every=10"),
                    hf_home) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    e = summary["eval"]
    print(f"sft eval: {e}")
    assert e["answers"] == 24 and e["tokens"] == 48  # each answer: its word and <|im_end|>
    assert e["loss"] < 1.0, e  # from ln(46) = 3.8 at the start; ln(2) / 2 with <|im_end|> learned, the verdict a coin toss
    assert set(summary["sample"]) == {"prompt", "generated", "expected"}
    assert summary["sample"]["prompt"].endswith("<|im_start|> assistant")

    from transformers import pipeline

    generate = pipeline("text-generation", model=str(out / "model"))
    review = [{"role": "user", "content": "the plot was quite dull"}]
    answer = generate(review, max_new_tokens=4, do_sample=False)[0]["generated_text"][-1]
    assert answer["role"] == "assistant" and answer["content"] in ("positive", "negative"), answer
    # answer_accuracy (every answer token the argmax given the conversation) is the share of held-out
    # conversations whose greedy reply through pipeline() is the answer and nothing else: the sft recipe's test
    # (tests/test_post_training_recipes.py) reads its held-out accuracy from it instead of generating again.
    held_out = run_splits(load_config(TINY_LM, sft_args(chat_data, out)[2:])).eval["messages"]
    replies = generate([c[:-1] for c in held_out], max_new_tokens=4, do_sample=False)
    exact = [r[0]["generated_text"][-1]["content"].strip() == c[-1]["content"] for r, c in zip(replies, held_out)]
    assert len(exact) == e["answers"] and e["answer_accuracy"] == sum(exact) / len(exact), (e, exact)

    # model/ is a pretrained chat model now: LoRA on it, its saved template (no data.chat_template), streamed rows.
    tokenizer, data = chat_data
    lora = tmp_path / "lora"
    assert run_main(["--config", str(TINY_LM), "task=sft", "model.config=null", f"model.name_or_path={out / 'model'}",
                     f"data.train_file={data}", "data.streaming=true", "train.max_steps=3", "peft.r=4",
                     f"output_dir={lora}"], hf_home) == 0
    adapted = json.loads((lora / "summary.json").read_text())
    assert adapted["memory"]["trainable_parameters"] < adapted["memory"]["parameters"] / 10
    assert adapted["eval"]["answers"] > 0 and "sample" in adapted


def test_a_bert_checkpoint_trains_as_a_causal_decoder_for_sft_and_dpo(tiny_model, hf_home, tmp_path, capsys):
    """model.config_overrides={is_decoder: true} loads an encoder checkpoint (the tiny BERT classifier) as a
    causal LM (BertLMHeadModel); chatml gives its EOS-less WordPiece tokenizer <|im_end|> as EOS, so dpo takes
    it too; model/ answers through pipeline(). A misspelt override is refused by key."""
    rows = []
    for i in range(48):
        good = i % 2 == 0
        review = [{"role": "user", "content": f"the film was {'superb' if good else 'awful'}"}]
        rows.append({"messages": review + [{"role": "assistant", "content": "good" if good else "bad"}],
                     "prompt": review, "chosen": [{"role": "assistant", "content": "good" if good else "bad"}],
                     "rejected": [{"role": "assistant", "content": "bad" if good else "good"}]})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["--config", str(TINY_LM), "model.config=null", f"model.name_or_path={tiny_model}",
            f"data.train_file={data}", "data.chat_template=chatml", "train.max_steps=4", "train.batch_size=8"]
    out = tmp_path / "sft"
    assert run_main([*base, "task=sft", "model.config_overrides.is_decoder=true", f"output_dir={out}"], hf_home) == 0
    from transformers import pipeline

    generate = pipeline("text-generation", model=str(out / "model"))
    assert type(generate.model).__name__ == "BertLMHeadModel" and generate.model.config.is_decoder
    answer = generate(rows[0]["prompt"], max_new_tokens=3, do_sample=False)[0]["generated_text"][-1]
    assert answer["role"] == "assistant", answer
    assert run_main([*base, "task=dpo", "data.block_size=null", "data.max_length=32",
                     "model.config_overrides.is_decoder=true", f"output_dir={tmp_path / 'dpo'}"], hf_home) == 0
    assert json.loads((tmp_path / "dpo" / "summary.json").read_text())["eval"]["pairs"] > 0
    capsys.readouterr()
    assert run_main([*base, "task=sft", "model.config_overrides.is_decodr=true", f"output_dir={tmp_path / 'x'}"],
                    hf_home) == 2
    assert "model.config_overrides: is_decodr: not an attribute of the bert config" in capsys.readouterr().err


@pytest.mark.parametrize("rows,message", [
    ([{"messages": "hello"}], "is not a conversation"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}], "unknown role 'robot'"),
    ([{"messages": [{"role": "user", "content": "hi"}]}] * 12, "without an assistant turn dropped"),
    ([{"messages": [{"role": "user"}]}], "is not a {role, content} mapping"),
], ids=["not a list", "unknown role", "no assistant turn", "no content"])
def test_bad_conversations_exit_2_naming_the_row(rows, message, chat_data, hf_home, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * (12 // len(rows))))
    proc = run_captured(sft_args(chat_data, tmp_path / "out", f"data.train_file={path}"), hf_home)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_missing_template_and_empty_completion_exit_2(chat_data, hf_home, tmp_path):
    tokenizer, data = chat_data
    base = ["--config", str(TINY_LM), "task=sft", f"model.tokenizer={tokenizer}", f"output_dir={tmp_path / 'o'}"]
    proc = run_captured(base + [f"data.train_file={data}"], hf_home)
    assert proc.returncode == 2 and "data.chat_template: the tokenizer has no chat template" in proc.stderr, proc.stderr
    rows = tmp_path / "pc.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"the film {i}", "completion": "good" if i % 5 else " "}) + "\n"
                            for i in range(20)))
    proc = run_captured(base + [f"data.train_file={rows}", "sft.train_on=completion"], hf_home)
    assert proc.returncode == 2 and "the completion is empty" in proc.stderr and "the film" in proc.stderr, proc.stderr


def test_long_conversations_are_counted_in_the_plan(chat_data, hf_home, tmp_path, capsys):
    """Conversations longer than data.block_size: truncated (or dropped), counted in the plan, never silently."""
    tokenizer, _ = chat_data
    rows = review_conversations(40, seed=1)
    for row in rows[:6]:  # a long review: its answer lies past 16 tokens
        row["messages"][-2]["content"] = " ".join(["the movie"] * 10 + ["good"])
    for row in rows[6:9]:
        del row["messages"][-1]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for policy, expected in (("truncate", "dropped with no token left to train on"),
                             ("drop", "longer than data.block_size dropped (sft.overflow=drop)")):
        code = run_main(sft_args((tokenizer, path), tmp_path / policy, "data.block_size=16", "data.eval_fraction=0.5",
                                 f"sft.overflow={policy}", "--dry-run"), hf_home)
        plan = capsys.readouterr().out
        assert code == 0
        notes = [line for line in plan.splitlines() if "note: sft:" in line]
        assert any(expected in n for n in notes) and any("without an assistant turn dropped" in n for n in notes), plan

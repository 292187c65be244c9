"""Reward models (task reward_model): the loss, rewards, accuracy and margin equal TRL 1.16's RewardTrainer on the
same pairs (text with a margin column and the centering term; conversations through SmolLM2's chat template), on
its own batch and tokenization; training through the real CLI scores held-out pairs the right way round, and
model/ loads in pipeline("text-classification"); a pretrained causal LM's backbone gets a new score head (LoRA);
bad rows and lengths are refused naming their key (tests/test_task_contract.py: 1 process = 2 = accumulation,
the sharding strategies, exact resume, a chosen answer equal to the rejected one)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import ROOT, preferences, reward_model_args, summary, write_jsonl
from in_process import run_captured, run_main

GPT2 = ROOT / "assets" / "gpt2-tokenizer"
SMOLLM2 = ROOT / "assets" / "SmolLM2-135M-Instruct"
# Uneven prompts and completions, a prompt ending mid-word, and a margin per pair (one negative).
ROWS = [
    {"prompt": "Review: the movie was good.\nSentiment:", "chosen": " fresh", "rejected": " rotten", "margin": 0.5},
    {"prompt": "Review: a dull film with some music.\nSentiment:", "chosen": " rotten", "rejected": " fresh, fresh",
     "margin": 0.0},
    {"prompt": "Review: lovely sto", "chosen": "ry and a great ending. Fresh", "rejected": "p it. Rotten",
     "margin": 1.5},
    {"prompt": "Review: boring", "chosen": " and rotten", "rejected": " but very fine, superb acting", "margin": -0.25},
]
CHATS = [{"prompt": [{"role": "user", "content": row["prompt"]}],
          "chosen": [{"role": "assistant", "content": row["chosen"].strip()}],
          "rejected": [{"role": "assistant", "content": row["rejected"].strip()}]} for row in ROWS]


def classifier(model_type: str, vocab: int, pad_id: int, seed: int = 2):
    """A tiny sequence classifier with one output (no dropout), from ``seed`` (2: random weights that score some of
    ROWS the right way round and some not, for both architectures)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    sizes = {"gpt2": dict(n_layer=2, n_head=2, n_embd=32, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0),
             "llama": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                           intermediate_size=64, max_position_embeddings=256)}[model_type]
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, vocab_size=vocab, num_labels=1, pad_token_id=pad_id, **sizes)
    return AutoModelForSequenceClassification.from_config(config)


def ours(tokenizer, model, rows, **settings):
    """Our per-pair outputs and metrics on ``rows``, prepared and collated by the task."""
    import datasets

    from framework.config import DataConfig
    from framework.recipe import schema
    from framework.tasks import get_task
    from framework.tasks.reward_model import RewardModelConfig, RewardRun

    cfg = schema()(task="reward_model", data=DataConfig(max_length=1024),
                   reward_model=RewardModelConfig(**settings))
    task = get_task("reward_model")
    features = task.prepare(datasets.Dataset.from_list(rows), tokenizer, model, cfg)
    batch = task.collator(tokenizer, cfg, None)(list(features))
    with torch.no_grad():
        outputs = RewardRun(task, cfg).eval_outputs(model, batch)
    return batch, RewardRun(task, cfg).metrics({k: v.numpy() for k, v in outputs.items()})


def trl_loss(tokenizer, model, rows, tmp_path, **config):
    """RewardTrainer on ``rows``: (its batch, its loss on it, its logged accuracy and margin)."""
    import datasets
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(rows), report_to=[], use_cpu=True,
                        bf16=False, max_length=1024, **config)
    trainer = RewardTrainer(model=copy.deepcopy(model), args=args, train_dataset=datasets.Dataset.from_list(rows),
                            processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        loss = float(trainer.compute_loss(trainer.model, dict(batch)))
    logged = {k: v[-1] for k, v in trainer._metrics["train" if trainer.model.training else "eval"].items()}
    return batch, loss, logged


def sequences(input_ids, attention_mask):
    """The batch's (chosen, rejected) token sequences, in a comparable order."""
    rows = [tuple(i[m.bool()].tolist()) for i, m in zip(input_ids, attention_mask)]
    half = len(rows) // 2
    return sorted(zip(rows[:half], rows[half:]))


def assert_equal_trl(mine, loss, logged, batch, trl_batch):
    assert sequences(batch["input_ids"], batch["attention_mask"]) == \
        sequences(trl_batch["input_ids"], trl_batch["attention_mask"])
    differences = {"loss": mine["loss"] - loss, "accuracy": mine["accuracy"] - logged["accuracy"],
                   "margin": mine["margin"] - logged["margin"]}
    print("TRL differences:", differences)
    assert all(abs(d) <= 1e-6 for d in differences.values()), differences
    assert 0 < mine["accuracy"] < 1 and abs(mine["margin"]) > 1e-3  # a batch that tells apart


def test_text_pairs_with_margins_and_centering_equal_trl_reward_trainer(tmp_path):
    """GPT-2's tokenizer (EOS after each completion, EOS as padding: the reward is read at the token before it) and a
    tiny GPT-2 classifier: the same sequences, and loss, accuracy and margin within 1e-6, with the margin column and
    the centering term, then without either."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    tokenizer.pad_token = tokenizer.eos_token
    model = classifier("gpt2", len(tokenizer), tokenizer.pad_token_id).eval()
    trl_batch, loss, logged = trl_loss(tokenizer, model, ROWS, tmp_path, center_rewards_coefficient=0.01)
    assert "margin" in trl_batch
    batch, mine = ours(tokenizer, model, ROWS, margin_column="margin", center_rewards_coefficient=0.01)
    assert_equal_trl(mine, loss, logged, batch, trl_batch)
    plain = [{k: v for k, v in row.items() if k != "margin"} for row in ROWS]
    trl_batch, loss, logged = trl_loss(tokenizer, model, plain, tmp_path)
    batch, mine = ours(tokenizer, model, plain)
    assert_equal_trl(mine, loss, logged, batch, trl_batch)


def test_conversations_through_the_chat_template_equal_trl_reward_trainer(tmp_path):
    """SmolLM2's tokenizer and ChatML template (its default system prompt included) and a tiny Llama classifier of
    its vocabulary: conversations are rendered as RewardTrainer renders them, and the figures agree within 1e-6."""
    from transformers import AutoTokenizer

    if not (SMOLLM2 / "tokenizer.json").is_file():
        pytest.fail(f"{SMOLLM2} is missing: run `make install` (or `python tools/assets.py assets`)")
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    model = classifier("llama", len(tokenizer), tokenizer.pad_token_id).eval()
    trl_batch, loss, logged = trl_loss(tokenizer, model, CHATS, tmp_path)
    batch, mine = ours(tokenizer, model, CHATS)
    assert_equal_trl(mine, loss, logged, batch, trl_batch)


# ---------------------------------------------------------------- runs


def test_a_reward_model_learns_held_out_preferences_and_loads_in_a_pipeline(hf_home, pair_tokenizer,
                                                                            preference_data, tmp_path, capsys):
    from huggingface_hub import ModelCard
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    from framework.tasks.reward_model import rewards

    out = tmp_path / "out"
    assert run_main(reward_model_args(pair_tokenizer, preference_data, out, "eval.every_steps=12"), hf_home) == 0
    s = summary(out)
    assert s["eval"]["accuracy"] >= 0.95 and s["eval"]["margin"] > 1.0 and s["eval"]["pairs"] == 20, s["eval"]
    assert s["eval"]["rewards_chosen"] > s["eval"]["rewards_rejected"] and s["memory_plan"]["frozen_model_bytes"] == 0
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["architectures"] == ["GPT2ForSequenceClassification"] and config["id2label"] == {"0": "reward"}
    model = AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    score = pipeline("text-classification", model=str(out / "model"), device="cpu", function_to_apply="none")
    texts = [row["prompt"] + row[side] + tokenizer.eos_token for row in preferences(3, seed=7)
             for side in ("chosen", "rejected")]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = rewards(model, batch).tolist()
    got = [result["score"] for result in score(texts)]
    assert got == pytest.approx(expected, abs=1e-5)
    assert all(a > b for a, b in zip(expected[::2], expected[1::2]))  # chosen over rejected, unseen pairs
    assert ModelCard.load(out / "model" / "README.md").data.pipeline_tag == "text-classification"


def test_a_pretrained_causal_lm_gets_a_new_score_head_under_lora(hf_home, pair_tokenizer, preference_data, tmp_path):
    """A causal LM's folder (a tiny GPT-2, random) trained as a reward model with LoRA: its backbone is the LM's,
    the score head is new and trained in full beside the adapters (peft's SEQ_CLS), model/ holds the merged
    classifier."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(pair_tokenizer)
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_head=2, n_embd=32, n_positions=64,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    lm.save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    out = tmp_path / "out"
    assert run_main(reward_model_args(pair_tokenizer, preference_data, out, "model.config=null",
                                      f"model.name_or_path={tmp_path / 'lm'}", "model.tokenizer=null", "peft.r=4",
                                      "peft.target_modules=[c_attn]", "peft.merge=true", "train.max_steps=40"),
                    hf_home) == 0
    adapter = json.loads((out / "model" / "adapter" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and "score" in adapter["modules_to_save"]
    merged = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert merged.config.num_labels == 1 and summary(out)["eval"]["accuracy"] >= 0.9
    # LoRA on c_attn only: the rest of the backbone is the LM's, untouched.
    assert torch.equal(merged.transformer.h[0].mlp.c_fc.weight, lm.transformer.h[0].mlp.c_fc.weight)


def test_bad_margins_and_lengths_are_refused_naming_their_key(hf_home, pair_tokenizer, tmp_path):
    rows = [dict(row, margin=0.5) for row in preferences(40, seed=3)]
    rows[9]["margin"] = "wide"
    data = write_jsonl(tmp_path / "margins.jsonl", rows)
    proc = run_captured(reward_model_args(pair_tokenizer, data, tmp_path / "bad", "reward_model.margin_column=margin"),
                        hf_home)
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1, proc.stderr[-2000:]
    assert "reward_model.margin_column: the row with prompt 'review : " in proc.stderr and "'wide'" in proc.stderr
    long = write_jsonl(tmp_path / "long.jsonl", [dict(row, prompt=row["prompt"] + " and the plot" * 3)
                                                  for row in preferences(40, seed=3)])
    proc = run_captured(reward_model_args(pair_tokenizer, long, tmp_path / "short", "data.max_length=8"), hf_home)
    assert proc.returncode == 2 and "data.max_length=8: every pair is longer" in proc.stderr, proc.stderr[-2000:]
    data = write_jsonl(tmp_path / "pairs.jsonl", preferences(40, seed=3))
    proc = run_captured(reward_model_args(pair_tokenizer, data, tmp_path / "some", "data.max_length=12", "--dry-run"),
                        hf_home)
    assert proc.returncode == 0 and "pairs longer than data.max_length=12 tokens dropped" in proc.stdout, \
        proc.stderr[-2000:]


# ---------------------------------------------------------------- scoring online RL


@pytest.fixture(scope="module")
def trained_reward_model(tmp_path_factory, hf_home, pair_tokenizer, preference_data):
    """A tiny reward model trained for 10 steps."""
    out = tmp_path_factory.mktemp("rm") / "rm"
    assert run_main(reward_model_args(pair_tokenizer, preference_data, out, "train.max_steps=10"), hf_home) == 0
    return out / "model"


def test_grpo_rewards_are_the_reward_models_scores(hf_home, pair_tokenizer, pair_data, trained_reward_model,
                                                   tmp_path):
    """grpo.reward_functions: [model:PATH]: the rewards logged with the examples of each step equal the reward
    model's scores computed here, with transformers alone, of the prompt followed by the completion and its EOS
    (as the reward model was trained); the plan counts the reward model as a frozen model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from helpers import grpo_args, read_metrics

    out = tmp_path / "grpo"
    assert run_main(grpo_args(pair_tokenizer, pair_data, out, f"grpo.reward_functions=[model:{trained_reward_model}]",
                              "train.max_steps=3"), hf_home) == 0
    model = AutoModelForSequenceClassification.from_pretrained(trained_reward_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_reward_model)
    examples = [e for record in read_metrics(out) for e in record.get("examples", [])]
    assert len(examples) == 12
    for example in examples:
        ids = tokenizer(example["prompt"] + example["completion"] + tokenizer.eos_token, return_tensors="pt")
        with torch.no_grad():
            expected = model(**ids).logits[0, 0].item()
        assert example["rewards"] == {"model:rm": pytest.approx(expected, rel=1e-6, abs=1e-6)}, example
        assert example["reward"] == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert len({round(e["reward"], 4) for e in examples}) > 1  # completions told apart
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = summary(out)["memory_plan"]
    assert plan["frozen_model_bytes"] == weights and "rewards/model:rm" in summary(out)["eval"]


def test_a_reward_function_path_that_is_no_reward_model_is_refused(hf_home, pair_tokenizer, pair_data, tiny_model,
                                                                   pretrained_lm, tmp_path):
    from helpers import grpo_args

    cases = [(tmp_path / "nowhere", "does not exist"), (tmp_path, "holds no model (no config.json)"),
             (pretrained_lm, "holds a GPT2LMHeadModel, not a sequence classifier"),
             (tiny_model, "holds a BertForSequenceClassification with 2 outputs; a reward model has one")]
    for path, says in cases:
        proc = run_captured(grpo_args(pair_tokenizer, pair_data, tmp_path / "out",
                                      f"grpo.reward_functions=[model:{path}]"), hf_home)
        assert proc.returncode == 2 and f"grpo.reward_functions: 'model:{path}': " in proc.stderr, proc.stderr
        assert says in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr

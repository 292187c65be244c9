"""What the tests share that is not a fixture (fixtures are in conftest.py): the tiny recipes and their
arguments, synthetic data, reading a run's outputs, comparing saved models, running the CLI in a subprocess
(plain, under ``accelerate launch``, as two machines), and a run killed mid-training then resumed.
tests/in_process.py runs the CLI inside the test process; framework/testing.py builds the tiny models that
benchmarks use too."""

from __future__ import annotations

import csv
import functools
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F

from framework.data import load_splits
from framework.losses import IGNORE
from framework.tasks import get_task, registered
from in_process import run_captured

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
RUN = ROOT / "recipes" / "run.py"
REFERENCES = TESTS / "references"
KILL_SCRIPT = TESTS / "scripts" / "kill_at.py"
TINY_RECIPE = TESTS / "tiny.yaml"
TINY_LM = TESTS / "tiny_lm.yaml"
TINY_MLM = TESTS / "tiny_mlm.yaml"
TINY_DPO = TESTS / "tiny_dpo.yaml"
TINY_REWARD_MODEL = TESTS / "tiny_reward_model.yaml"
TINY_GRPO = TESTS / "tiny_grpo.yaml"
TINY_RLOO = TESTS / "tiny_rloo.yaml"
GRPO_REWARDS = TESTS / "grpo_rewards.py"


def task_names() -> List[str]:
    """Every task the framework has: the tests that hold for all of them are parametrized over these."""
    return list(registered())


# ---------------------------------------------------------------- synthetic data

POSITIVE = ["good", "great", "superb", "fine", "lovely"]
NEGATIVE = ["bad", "awful", "poor", "dull", "boring"]
NEUTRAL = ["the", "movie", "was", "a", "plot", "actor", "scene", "film", "story", "and", "with", "very",
           "quite", "this", "that", "it", "had", "some", "music", "ending"]


def run_splits(cfg):
    """The (train, eval) rows a run of the loaded recipe ``cfg`` trains and evaluates on, split as the run splits
    them (``framework.data.load_splits`` with its task's columns and row filter)."""
    task = get_task(cfg.task)
    return load_splits(cfg.data, cfg.seed, task.columns(cfg), task.keep_row(cfg))


def synthetic_rows(n: int, seed: int) -> List[dict]:
    """An easy sentiment task: one positive or negative word among neutral filler."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["pos", "neg"])
        words = [rng.choice(NEUTRAL) for _ in range(rng.randint(4, 14))]
        words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if label == "pos" else NEGATIVE))
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_csv(path: Path, rows: List[dict]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SUBJECTS = ["the cat", "a dog", "the king", "my friend", "the ghost", "a sailor"]
VERBS = ["sees", "likes", "follows", "finds", "calls", "leaves"]
OBJECTS = ["the castle", "a ship", "the queen", "the sea", "a letter", "the garden"]
WORDS = " ".join(SUBJECTS + VERBS + OBJECTS).split() + [".", "and", "then"]


def documents(n: int, seed: int) -> List[dict]:
    """Language models' data: documents of 1 to 12 short sentences: very uneven lengths, and structure a tiny model can learn."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} ."
                     for _ in range(rng.choice([1, 1, 2, 3, 12]))]
        docs.append({"text": " and then ".join(sentences)})
    return docs


def review_conversations(n: int, seed: int):
    """An easy sentiment task as conversations: the verdict follows from the last word of the review."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        positive = rng.random() < 0.5
        words = [rng.choice(NEUTRAL) for _ in range(rng.randint(3, 8))]
        words.append(rng.choice(POSITIVE if positive else NEGATIVE))
        messages = [{"role": "user", "content": " ".join(words)},
                    {"role": "assistant", "content": "positive" if positive else "negative"}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "answer with one word"})
        rows.append({"messages": messages})
    return rows


ANSWERS = {"pos": ("fresh", "rotten"), "neg": ("rotten", "fresh")}


def pairs(n: int, seed: int):
    """An easy preference task: neutral words, then a positive or negative one that ends the prompt (what follows
    it is a bigram a tiny model learns in a few steps); chosen is its right verdict."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["pos", "neg"])
        words = [rng.choice(NEUTRAL) for _ in range(rng.randint(3, 10))]
        word = rng.choice(POSITIVE if label == "pos" else NEGATIVE)
        chosen, rejected = ANSWERS[label]
        rows.append({"prompt": f"review : {' '.join(words)} . sentiment : {word}", "chosen": f" {chosen}",
                     "rejected": f" {rejected}"})
    return rows


def preferences(n: int, seed: int):
    """A reward model's easy preference task: after a review's opening, the continuation that ends on a positive
    word is preferred to the same continuation ending on a negative one (a tiny classifier learns it in a few
    dozen steps)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        opening = " ".join(rng.choice(NEUTRAL) for _ in range(rng.randint(2, 6)))
        middle = " ".join(rng.choice(NEUTRAL) for _ in range(rng.randint(1, 4)))
        rows.append({"prompt": f"review : {opening}", "chosen": f" {middle} {rng.choice(POSITIVE)}",
                     "rejected": f" {middle} {rng.choice(NEGATIVE)}"})
    return rows


# ---------------------------------------------------------------- arguments of the tiny recipes


TOY = "task=tests/toy_task.py:ToyTask"  # tests/toy_task.py, a task from outside framework/ (docs/adding-a-task.md)


@contextmanager
def toy_task_registered() -> Iterator[None]:
    """Runs may name ``TOY``: the toy registers itself into a copy of the registry, so that later tests' schema
    (config.yaml, keys.md) has no toy section; the recipe names its file relative to the repository."""
    import framework.tasks.base

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(framework.tasks.base, "_REGISTRY", dict(framework.tasks.base._REGISTRY))
        patch.chdir(ROOT)
        yield


def toy_scores(count: int, seed: int = 5) -> List[dict]:
    """Texts holding 0 to 3 positive words among filler; the number to predict (``score``) is their count."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        positives = rng.randint(0, 3)
        words = [rng.choice(NEUTRAL) for _ in range(rng.randint(4, 10))] + rng.sample(POSITIVE, positives)
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "score": positives})
    return rows


# The launcher tests' run (several machines, Slurm): 8 steps of the tiny model, a checkpoint every 4; one thread
# per process (4 processes share 2 cores here).
LAUNCHERS_RUN = ["train.max_steps=8", "train.log_every=2", "checkpoint.every_steps=4", "train.cpu_threads=1",
                 "train.batch_size=4", "optim.lr=3e-3"]


def tiny_args(model: Path, data: Path, out: Path, *extra: str) -> List[str]:
    """Arguments that train the tiny model on the easy data with the tests' own recipe."""
    return ["--config", str(TINY_RECIPE), f"model.name_or_path={model}", f"data.train_file={data}",
            f"output_dir={out}", *extra]


def lm_args(tokenizer: Path, data: Path, out: Path, *extra: str) -> List[str]:
    """A tiny GPT-2 from scratch (tests/tiny_lm.yaml) over ``tokenizer`` on the documents in ``data``."""
    return ["--config", str(TINY_LM), f"model.tokenizer={tokenizer}", f"data.train_file={data}", f"output_dir={out}",
            *extra]


def finite_checkpoints(out: Path) -> Dict[int, bool]:
    """The step of each checkpoint, and whether every weight it holds is finite (its states/; on XLA, the
    pytorch_model.bin that xm.save writes)."""
    found = {}
    for folder in sorted((out / "checkpoints").glob("step_*")):
        if (folder / "states").is_dir():
            weights = list(checkpoint_states(folder)["model"].values())
        else:
            weights = [t for f in folder.rglob("pytorch_model*.bin") for t in torch.load(f, weights_only=True).values()]
        found[int(folder.name.split("_")[1])] = bool(weights) and all(torch.isfinite(t).all() for t in weights)
    return found


def mlm_args(tokenizer: Path, data: Path, out: Path, *extra: str) -> List[str]:
    """A tiny BERT masked LM from scratch (tests/tiny_mlm.yaml)."""
    return ["--config", str(TINY_MLM), f"model.tokenizer={tokenizer}", f"data.train_file={data}", f"output_dir={out}",
            *extra]


def sft_args(chat_data, out: Path, *extra: str) -> List[str]:
    """tests/tiny_lm.yaml as task sft on ``chat_data`` (the fixture's (tokenizer, conversations)), chatml."""
    tokenizer, data = chat_data
    return ["--config", str(TINY_LM), "task=sft", f"model.tokenizer={tokenizer}", f"data.train_file={data}",
            "data.chat_template=chatml", f"output_dir={out}", *extra]


def dpo_args(tokenizer: Path, data: Path, out: Path, *extra: str) -> List[str]:
    """A tiny GPT-2 from scratch tuned on preference pairs (tests/tiny_dpo.yaml)."""
    return ["--config", str(TINY_DPO), f"model.tokenizer={tokenizer}", f"data.train_file={data}",
            f"output_dir={out}", *extra]


# tests/tiny_llama.yaml's Llama as overrides of a tiny recipe's model.config (its GPT-2 keys are left unread):
# grouped key/value heads, rotary positions, RMSNorm, an untied head; a tensor-parallel plan in transformers.
LLAMA_CONFIG = ["model.config.model_type=llama", "model.config.num_hidden_layers=2",
                "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
                "model.config.hidden_size=32", "model.config.intermediate_size=64",
                "model.config.max_position_embeddings=64", "model.config.tie_word_embeddings=false"]


def reward_model_args(tokenizer: Path, data: Path, out: Path, *extra: str) -> List[str]:
    """A tiny GPT-2 sequence classifier from scratch trained as a reward model on preference pairs
    (tests/tiny_reward_model.yaml)."""
    return ["--config", str(TINY_REWARD_MODEL), f"model.tokenizer={tokenizer}", f"data.train_file={data}",
            f"output_dir={out}", *extra]


def grpo_args(tokenizer: Path, data: Path, out: Path, *extra: str) -> List[str]:
    """A tiny GPT-2 from scratch trained by GRPO (tests/tiny_grpo.yaml) on the preference pairs' prompts, rewarded
    for answering their chosen word and by tests/grpo_rewards.py's ``characters`` (rewards that vary from the start)."""
    return ["--config", str(TINY_GRPO), f"model.tokenizer={tokenizer}", f"data.train_file={data}", f"output_dir={out}",
            f"grpo.reward_functions=[exact_match,{GRPO_REWARDS}:characters]", *extra]


def rloo_args(tokenizer: Path, data: Path, out: Path, *extra: str) -> List[str]:
    """The same as ``grpo_args``, trained by RLOO (tests/tiny_rloo.yaml)."""
    return ["--config", str(TINY_RLOO), f"model.tokenizer={tokenizer}", f"data.train_file={data}", f"output_dir={out}",
            f"rloo.reward_functions=[exact_match,{GRPO_REWARDS}:characters]", *extra]


def lora_lm_args(model: Path, data: Path, out: Path, *extra: str) -> List[str]:
    """LoRA (r 4, alpha 8) on a pretrained tiny causal LM (the ``pretrained_lm`` fixture)."""
    return ["--config", str(TINY_LM), "model.config=null", f"model.name_or_path={model}", f"data.train_file={data}",
            f"output_dir={out}", "peft.r=4", "peft.alpha=8", *extra]


# ---------------------------------------------------------------- a tiny Llama in a GGUF file

@functools.lru_cache(maxsize=None)
def tools_assets():
    """tools/assets.py (what `make install` runs to write assets/), as a module."""
    spec = importlib.util.spec_from_file_location("assets", ROOT / "tools" / "assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smollm2_gguf() -> Path:
    """The chat LLM's GGUF file inside the PyPI package `make install` adds."""
    assets = tools_assets()
    _, package, inner = assets.CHAT_MODEL
    return assets.source(package, inner)


def tiny_gguf(target: Path, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128,
              seed: int = 0) -> Path:
    """A tiny random Llama as a float32 GGUF file, written with the gguf library: SmolLM2's own metadata (its
    tokenizer of 49,152 tokens, ChatML template, special ids, tied output) with the sizes made small."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(smollm2_gguf())
    sizes = {"llama.block_count": layers, "llama.embedding_length": hidden, "llama.feed_forward_length": ffn,
             "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
             "llama.rope.dimension_count": hidden // heads, "llama.context_length": 256}
    writer = gguf.GGUFWriter(target, "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, sizes.get(name, field.contents()), field.types[0], sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    kv = kv_heads * (hidden // heads)
    writer.add_tensor("token_embd.weight", weight(reader.fields["llama.vocab_size"].contents(), hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


# ---------------------------------------------------------------- tiny causal LMs with a byte-level BPE tokenizer
# (tests/test_export.py's: GGUF export writes only such tokenizers; the chat command reads its files)

TEXTS = ["the movie was good and the plot was great", "a boring film with a dull ending, sadly.",
         "What is 26 + 28? It is 54!", "User: hello there\nAssistant: hi, how can I help?"] * 4
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

def save_bpe_tokenizer(folder, split: str = "gpt2", add_bos: bool = False):
    """A byte-level BPE tokenizer trained on TEXTS (vocabulary 300) with ChatML's tokens and template. ``split``:
    GPT-2's (a plain ByteLevel pre-tokenizer), Qwen2's (its regex, NFC) or SmolLM's (digits one by one first);
    ``add_bos``: the tokenizer puts <|endoftext|> first, as its BOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from framework import export

    backend = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split != "qwen2")
    backend.pre_tokenizer = {
        "gpt2": byte_level,
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
        "qwen2": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(export.QWEN2_SPLIT), behavior="isolated"),
                                          byte_level]),
    }[split]
    if split == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                               special_tokens=[("<|endoftext|>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=SPECIAL[0 if add_bos else 1],
                                        eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_causal_lm(folder, model_type: str = "llama", tied: bool = True, split: str = "gpt2", add_bos: bool = False):
    """A 2-layer random causal LM (4 query heads over 2 key/value heads, head size 16) with save_bpe_tokenizer's
    tokenizer. Weights drawn wide (std 0.1, biases too) so that attention is sharp: a query or key in the wrong
    rotary layout then moves the logits by units, not by rounding."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = save_bpe_tokenizer(folder, split, add_bos)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, tie_word_embeddings=tied, initializer_range=0.1,
                                  rope_parameters={"rope_type": "default", "rope_theta": 30000.0},
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    return model


# ---------------------------------------------------------------- a run's outputs


def read_metrics(out: Path) -> List[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_losses(out: Path) -> List[float]:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


def losses_by_step(out: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}


# An XLA run checked for graphs compiled late: 10 steps evaluated every 4 and logged every 2. By step 6 every kind
# of graph has run (the steps, the evaluation at step 4); steps 7 to 10 and the evaluation at step 8 compile none.
STEADY_XLA = ["train.max_steps=10", "eval.every_steps=4", "train.log_every=2"]


def assert_no_graph_after_the_first_evaluation(out: Path) -> None:
    """The compiled graphs counted with each logged step's figures (``xla/compiles``) stop growing at step 6 of a
    ``STEADY_XLA`` run: a longer run would compile no more."""
    compiles = {r["step"]: r["xla/compiles"] for r in read_metrics(out) if "xla/compiles" in r}
    assert sorted(compiles) == [2, 4, 6, 8, 10] and compiles[6] == compiles[10], compiles


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def weights(out: Path) -> dict:
    """A run's saved model (``model/model.safetensors``)."""
    from safetensors.torch import load_file

    return load_file(out / "model" / "model.safetensors")


def checkpoint_states(folder: Path) -> Dict[str, dict]:
    """A checkpoint's training state (framework/backend/states.py's DCP folder), read whole into this process:
    ``{"model": {name: tensor}, "optimizer": {"state.<name>.<key>": tensor, "param_groups.<name>.<key>": value}}``."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder / "states", Path(tmp) / "states.pt")
        return torch.load(Path(tmp) / "states.pt", weights_only=False)


def assert_same_weights(a: Path, b: Path, rtol: float, atol: float) -> None:
    """Two runs' saved models: the same names, each tensor within rtol/atol."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_bitwise_equal_models(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


# ---------------------------------------------------------------- processes


def cores() -> int:
    """The cores this process may run on, computed the way framework/backend/cpu.py does."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def environment(hf_home: Path, **extra: str) -> Dict[str, str]:
    """A run's environment: this process's, the session's HF cache, no accelerate config of the user's."""
    env = {**os.environ, "HF_HOME": str(hf_home), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           **extra}
    env.pop("ACCELERATE_CONFIG_FILE", None)
    return env


# accelerate's launcher as a module: the same parser and launch_command as the ``accelerate launch`` command, without
# the CLI's other subcommands, whose imports (transformers among them) cost 1.1 s of each launch (1.4 s against 2.5 s
# for --help, 3 runs each). The tests of the command as users type it (test_launch.py, test_end_to_end.py) run
# ACCELERATE_COMMAND, the ``accelerate`` command itself.
ACCELERATE_LAUNCH = (sys.executable, "-m", "accelerate.commands.launch")
ACCELERATE_COMMAND = (str(Path(sys.executable).with_name("accelerate")), "launch")


def launch_cmd(script: Path, launch: Optional[str], launch_args: Sequence[str] = (),
               launcher: Sequence[str] = ACCELERATE_LAUNCH) -> List[str]:
    """``script`` under plain python (``launch`` None) or accelerate's ``launcher`` with
    accelerate_configs/LAUNCH."""
    if launch is None:
        return [sys.executable, str(script)]
    return [*launcher, "--config_file", str(ROOT / "accelerate_configs" / launch), *launch_args, str(script)]


def cli_runner(hf_home: Path):
    """Run the real CLI (or another ``script``) in a subprocess: ``run(args, launch=None)``; ``launch`` is an
    accelerate config file name (under accelerate_configs/) to go through ``accelerate launch``, else plain python. Its environment
    is this process's at the time of the call (a test's monkeypatched variables too)."""

    def run(args: List[str], launch: Optional[str] = None, check: bool = True, timeout: int = 600,
            launch_args: Sequence[str] = (), script: Path = RUN, launcher: Sequence[str] = ACCELERATE_LAUNCH):
        cmd = launch_cmd(script, launch, launch_args, launcher) + list(args)
        proc = subprocess.run(cmd, cwd=ROOT, env=environment(hf_home), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return proc

    return run


ONE_LAUNCH = TESTS / "scripts" / "one_launch.py"


def runs_in_one_launch(hf_home: Path, runs: Dict[str, List[str]], launch: str, folder: Path,
                       processes: int = 2) -> Dict[str, subprocess.CompletedProcess]:
    """The runs (name: arguments), one after another in the processes of one ``accelerate launch`` with
    accelerate_configs/LAUNCH (tests/scripts/one_launch.py): each run's result as its own launch's would be (the
    worst status of its processes; their stdout, and their stderr with torchrun's ``[rankR]:`` prefixes)."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "runs.json"
    spec.write_text(json.dumps([{"args": args, "log": str(folder / name)} for name, args in runs.items()]))
    launch_args = ["--num_processes", str(processes), "--main_process_port", str(free_port())]
    cli_runner(hf_home)([str(spec)], launch=launch, launch_args=launch_args, script=ONE_LAUNCH,
                        timeout=300 + 120 * len(runs))  # a launch that fails fails here, with its output
    results = {}
    for name, args in runs.items():
        ranks = [json.loads((folder / f"{name}.rank{r}.json").read_text()) for r in range(processes)]
        results[name] = subprocess.CompletedProcess(
            args, max((r["status"] for r in ranks), key=abs), "".join(r["stdout"] for r in ranks),
            "".join(f"[rank{i}]: {line}\n" for i, r in enumerate(ranks) for line in r["stderr"].splitlines()))
    return results


def crash_then_resume(hf_home, args, kill_at_micro, launch=None, in_process=True, launch_args=()):
    """Run until SIGKILL at the chosen micro-batch, then run the same command again to the end. The second run
    is launched as the first was (with the same ``launch_args``) when ``launch`` names a config or ``in_process``
    is False (the XLA tier's runs need a process each: its runtime's devices are fixed at first use), else it
    runs in this process."""
    proc = subprocess.run(launch_cmd(KILL_SCRIPT, launch, launch_args) + args, cwd=ROOT, capture_output=True,
                          text=True, env=environment(hf_home, KILL_AT_MICRO=str(kill_at_micro)), timeout=600)
    assert proc.returncode != 0, "the run should have been killed"
    if launch is None and in_process:
        resumed = run_captured(args, hf_home)
    else:
        resumed = subprocess.run(launch_cmd(RUN, launch, launch_args) + args, cwd=ROOT, capture_output=True,
                                 text=True, env=environment(hf_home), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return resumed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machines(args: Sequence[str], processes: int, hf_home: Path, port: int, script: Path = RUN,
             launch: Sequence[str] = (), envs: Sequence[Dict[str, str]] = ({}, {}),
             machine_launch: Sequence[Sequence[str]] = ((), ())) -> List[subprocess.Popen]:
    """Start two machines' launchers on this host: ``processes`` in all, half on each. ``envs``/``machine_launch``:
    each machine's own environment and launch arguments."""
    started = []
    for rank in (0, 1):
        cmd = [*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "accelerate_configs" / "multi_node.yaml"),
               "--num_machines", "2", "--num_processes", str(processes), "--machine_rank", str(rank),
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *launch, *machine_launch[rank],
               str(script), *args]
        started.append(subprocess.Popen(cmd, cwd=ROOT, env=environment(hf_home, **envs[rank]), text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
    return started


def finish(launchers: List[subprocess.Popen], timeout: float = 600) -> List[tuple]:
    """(exit status, output, seconds when it exited) of each launcher; kills any left at the end."""
    results = []
    try:
        for proc in launchers:
            out, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, time.time()))
    finally:
        for proc in launchers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def run_ok(launchers: List[subprocess.Popen]) -> List[str]:
    results = finish(launchers)
    for status, out, _ in results:
        assert status == 0, out[-4000:]
    return [out for _, out, _ in results]


# ---------------------------------------------------------------- tiny models and batches outside a run


def tiny_causal_lm(kind: str):
    """A 2-layer GPT-2 or Llama (4 heads over 2 key/value heads) from seed 0, vocabulary 50, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"gpt2": dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0),
             "llama": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                           intermediate_size=64, max_position_embeddings=64)}[kind]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=50, bos_token_id=0, eos_token_id=0, **sizes)).eval()


def packed_batch(block: int = 32):
    from framework.tasks.causal_lm import PackedCollator, pack

    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (5, 17, 3, 30, 9, 12, 21, 2)]
    blocks = pack(docs, block)
    rows = [dict(zip(blocks, values)) for values in zip(*blocks.values())]
    return PackedCollator()(rows)


def segments(batch):
    """(row, start, end) of every segment: where the positions restart at 0."""
    for row, positions in enumerate(batch["position_ids"]):
        starts = [i for i, p in enumerate(positions.tolist()) if p == 0] + [len(positions)]
        yield from ((row, a, b) for a, b in zip(starts, starts[1:]))



VOCAB, CHUNK = 97, 7  # chunks of 7 tokens: several per batch and a short last one

SIZES = {
    "gpt2": dict(n_layer=2, n_head=2, n_embd=16, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                  intermediate_size=32, max_position_embeddings=64, tie_word_embeddings=False),
    "mistral": dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                    intermediate_size=32, max_position_embeddings=64),
    "qwen2": dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                  intermediate_size=32, max_position_embeddings=64),
    "qwen3": dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16, head_dim=8,
                  intermediate_size=32, max_position_embeddings=64),
    "phi3": dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                 intermediate_size=32, max_position_embeddings=64, pad_token_id=0),
    "gpt_neox": dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32,
                     max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0),
    "bert": dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32,
                 max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "roberta": dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32,
                    max_position_embeddings=70, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    pad_token_id=1),
    "distilbert": dict(n_layers=1, n_heads=2, dim=16, hidden_dim=32, max_position_embeddings=64, dropout=0.0,
                       attention_dropout=0.0),
}
MASKED = ("bert", "roberta", "distilbert")


def build(kind: str, dtype=torch.float32):
    """A tiny model of architecture ``kind`` (SIZES) from seed 0, in training mode: the chunked loss's tests."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, vocab_size=VOCAB, **SIZES[kind])
    model = (AutoModelForMaskedLM if kind in MASKED else AutoModelForCausalLM).from_config(config)
    return model.to(dtype).train()


def batch(kind: str, rows: int = 3, length: int = 20):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # a padded row
    labels = ids.masked_fill(mask == 0, IGNORE)
    if kind in MASKED:
        labels = labels.masked_fill(torch.rand(ids.shape, generator=g) > 0.3, IGNORE)
    else:
        labels[0, :6] = IGNORE  # a prompt that is not a target
    return {"input_ids": ids, "attention_mask": mask}, labels


def targets_of(kind: str, labels):
    """The targets of the outputs at each position: the next token for causal LMs, as the tasks align them."""
    return labels if kind in MASKED else F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def worst_gradient(got: dict, expected: dict) -> float:
    """The largest relative error of a parameter's gradient (its norm's); a gradient that is zero in exact
    arithmetic (attention keys' bias: the softmax ignores it) is measured against the whole gradient's norm."""
    assert got.keys() == expected.keys()
    total = torch.cat([g.double().flatten() for g in expected.values()]).norm()
    return max(((got[n].double() - e.double()).norm() / torch.maximum(e.double().norm(), 1e-3 * total)).item()
               for n, e in expected.items())

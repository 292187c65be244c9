"""Shared fixtures: a tiny random BERT saved as a local model folder, easy synthetic data, and a CLI runner."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "recipes" / "run.py"
REFERENCES = Path(__file__).resolve().parent / "references"
TINY_RECIPE = Path(__file__).resolve().parent / "tiny.yaml"

POSITIVE = ["good", "great", "superb", "fine", "lovely"]
NEGATIVE = ["bad", "awful", "poor", "dull", "boring"]
NEUTRAL = ["the", "movie", "was", "a", "plot", "actor", "scene", "film", "story", "and", "with", "very",
           "quite", "this", "that", "it", "had", "some", "music", "ending"]


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer BERT from a config (random init, seeded), with a WordPiece tokenizer over the task's words."""
    from framework.testing import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), POSITIVE + NEGATIVE + NEUTRAL)


@pytest.fixture(scope="session")
def easy_data(tmp_path_factory) -> Path:
    return write_csv(tmp_path_factory.mktemp("data") / "easy.csv", synthetic_rows(400, seed=1))


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


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """240 documents of very uneven lengths, as jsonl."""
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in documents(240, seed=3)))
    return path


@pytest.fixture(scope="session")
def word_tokenizer(tmp_path_factory) -> Path:
    """A word-level tokenizer over the documents' words: a vocabulary of 34."""
    from framework.testing import save_word_tokenizer

    return save_word_tokenizer(tmp_path_factory.mktemp("word_tokenizer"), WORDS)


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory) -> Path:
    """One datasets/hub cache for the whole session, away from the user's own."""
    return tmp_path_factory.mktemp("hf_home")


def cli_runner(hf_home: Path):
    """Run the real CLI (or another ``script``) in a subprocess: ``run(args, launch=None)``; ``launch`` is an
    accelerate config file name (under accelerate_configs/) to go through ``accelerate launch``, else plain python. Its environment
    is this process's at the time of the call (a test's monkeypatched variables too)."""

    def run(args: List[str], launch: Optional[str] = None, check: bool = True, timeout: int = 600,
            launch_args: Sequence[str] = (), script: Path = RUN):
        env = {**os.environ, "HF_HOME": str(hf_home), "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1"}
        env.pop("ACCELERATE_CONFIG_FILE", None)
        if launch:
            cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
                   str(ROOT / "accelerate_configs" / launch), *launch_args, str(script), *args]
        else:
            cmd = [sys.executable, str(script), *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return proc

    return run


@pytest.fixture
def cli(hf_home):
    """``cli_runner`` for a test."""
    return cli_runner(hf_home)


def assert_same_weights(a: Path, b: Path, rtol: float, atol: float) -> None:
    """Two runs' saved models (``model/model.safetensors``): the same names, each tensor within rtol/atol."""
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def tiny_args(model: Path, data: Path, out: Path, *extra: str) -> List[str]:
    """Arguments that train the tiny model on the easy data with the tests' own recipe."""
    return ["--config", str(TINY_RECIPE), f"model.name_or_path={model}", f"data.train_file={data}",
            f"output_dir={out}", *extra]


def read_metrics(out: Path) -> List[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_losses(out: Path) -> List[float]:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]

"""Shared fixtures: a tiny random BERT saved as a local model folder, easy synthetic data for each task, and a
CLI runner. What the tests share that is not a fixture is in tests/helpers.py."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from helpers import (LAUNCHERS_RUN, NEGATIVE, NEUTRAL, POSITIVE, WORDS, cli_runner, documents, free_port, lm_args, pairs,
                     preferences, review_conversations, synthetic_rows, tiny_args, toy_task_registered, write_csv,
                     write_jsonl)
from in_process import run_main


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test (its fixtures torn down), what is still alive is frozen (``gc.freeze``), so that the cyclic
    garbage collector's full collections walk only what later tests make. A test process runs hundreds of runs,
    each ending with a full collection (accelerate's ``free_memory``) that walked everything the session had
    accumulated (the modules the runs imported, the session's fixtures): the collector took 8.7 s of the 49 s of
    test_sft.py and test_report.py in one process, 3.7 s with this. After a module's last test everything is
    unfrozen first, so that what its fixtures held in cycles is collected with them."""
    yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        gc.unfreeze()
    gc.collect()
    gc.freeze()


@pytest.fixture
def toy_registry():
    """tests/toy_task.py registers itself for its test only (helpers.toy_task_registered)."""
    with toy_task_registered():
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer BERT from a config (random init, seeded), with a WordPiece tokenizer over the task's words."""
    from framework.testing import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), POSITIVE + NEGATIVE + NEUTRAL)


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory) -> Path:
    """The tiny BERT without its classifier head, as a pretrained encoder is: a run's classifier draws a new one."""
    from framework.testing import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny_encoder"), POSITIVE + NEGATIVE + NEUTRAL, head=False)


@pytest.fixture(scope="session")
def easy_data(tmp_path_factory) -> Path:
    return write_csv(tmp_path_factory.mktemp("data") / "easy.csv", synthetic_rows(400, seed=1))


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
def chat_data(tmp_path_factory):
    """(tokenizer, conversations jsonl): a word-level tokenizer (chatml's tokens are added by the run)."""
    from framework.testing import save_word_tokenizer

    folder = tmp_path_factory.mktemp("sft")
    words = POSITIVE + NEGATIVE + NEUTRAL + ["system", "user", "assistant", "tool", "positive", "negative",
                                             "answer", "with", "one", "word"]
    path = folder / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in review_conversations(240, seed=0)))
    return save_word_tokenizer(folder / "tokenizer", words), path


@pytest.fixture(scope="session")
def pair_tokenizer(tmp_path_factory) -> Path:
    from framework.testing import save_word_tokenizer

    words = POSITIVE + NEGATIVE + NEUTRAL + ["review", "sentiment", "fresh", "rotten", ":", "."]
    return save_word_tokenizer(tmp_path_factory.mktemp("pair_tokenizer"), words)


@pytest.fixture(scope="session")
def pair_data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", pairs(200, seed=1))


@pytest.fixture(scope="session")
def preference_data(tmp_path_factory) -> Path:
    """Reward models' pairs (helpers.preferences): over ``pair_tokenizer``'s words."""
    return write_jsonl(tmp_path_factory.mktemp("preferences") / "preferences.jsonl", preferences(200, seed=1))


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory) -> Path:
    """One datasets/hub cache for the whole session, away from the user's own."""
    return tmp_path_factory.mktemp("hf_home")


@pytest.fixture(scope="session")
def pretrained_lm(tmp_path_factory, hf_home, word_tokenizer, corpus):
    """A tiny GPT-2 trained from scratch for a few steps: the pretrained model adapters start from."""
    out = tmp_path_factory.mktemp("pretrained") / "lm"
    assert run_main(lm_args(word_tokenizer, corpus, out, "train.max_steps=20"), hf_home) == 0
    return out / "model"


@pytest.fixture
def cli(hf_home):
    """``cli_runner`` for a test."""
    return cli_runner(hf_home)


@pytest.fixture(scope="module")
def cli_module(hf_home):
    """``cli_runner`` for a module's shared runs (module-scoped fixtures)."""
    return cli_runner(hf_home)


@pytest.fixture(scope="session")
def ddp_lm_run(tmp_path_factory, corpus, word_tokenizer, hf_home) -> Path:
    """The language model's common run (tests/sharding.py's COMMON) under plain data parallelism on 2 processes:
    the reference tests/test_fsdp.py's and tests/test_deepspeed.py's strategies train against."""
    from sharding import COMMON, DDP_LAUNCH, launch

    out = tmp_path_factory.mktemp("ddp_lm") / "out"
    cli_runner(hf_home)(lm_args(word_tokenizer, corpus, out, *COMMON, "distributed.strategy=ddp"), launch=DDP_LAUNCH,
                        launch_args=launch())
    return out


@pytest.fixture(scope="session")
def fsdp_lm_run(tmp_path_factory, corpus, word_tokenizer, hf_home):
    """(output folder, arguments, process) of the language model's common run on 2 processes under
    accelerate_configs/fsdp.yaml with the default strategy (auto): FSDP2, sharded checkpoints every 4 steps."""
    from sharding import COMMON, launch

    out = tmp_path_factory.mktemp("fsdp_lm") / "out"
    args = lm_args(word_tokenizer, corpus, out, *COMMON)
    return out, args, cli_runner(hf_home)(args, launch="fsdp.yaml", launch_args=launch())


@pytest.fixture(scope="session")
def llama_one_process(tmp_path_factory, hf_home, word_tokenizer, corpus) -> Path:
    """The tiny Llama trained 12 steps by one process: tensor parallelism's reference, and QLoRA's base."""
    from sharding import llama_args

    out = tmp_path_factory.mktemp("llama") / "one"
    assert run_main(llama_args(word_tokenizer, corpus, out), hf_home) == 0
    return out


@pytest.fixture(scope="session")
def tp_llama_run(tmp_path_factory, hf_home, word_tokenizer, corpus):
    """(output folder, arguments, process) of the tiny Llama on 2 processes of tensor parallelism (both on the same
    batches: the effective batch one process's), a checkpoint every 4 steps."""
    from sharding import DDP_LAUNCH, launch, llama_args

    out = tmp_path_factory.mktemp("tp_llama") / "out"
    args = llama_args(word_tokenizer, corpus, out, "distributed.tensor_parallel=2", "checkpoint.every_steps=4",
                      "checkpoint.keep_last=3")
    return out, args, cli_runner(hf_home)(args, launch=DDP_LAUNCH, launch_args=launch())


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory, tiny_model, easy_data, hf_home) -> Path:
    """LAUNCHERS_RUN under `accelerate launch` with 2 processes on this machine, uninterrupted: what the launcher
    tests' runs (2 machines, Slurm jobs) must end with."""
    out = tmp_path_factory.mktemp("two_processes") / "out"
    cli_runner(hf_home)(tiny_args(tiny_model, easy_data, out, *LAUNCHERS_RUN), launch="cpu_ddp.yaml",
                        launch_args=["--num_processes", "2", "--main_process_port", str(free_port())])
    return out

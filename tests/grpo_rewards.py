"""Reward functions for tests/test_grpo.py and the task contract, written as a user would (TRL's signature), and
broken ones, each wrong in one way a user's can be."""

import os


def characters(prompts, completions, completion_ids, **columns):
    """A reward every completion gets, varying with its length in characters: a random model's completions
    differ in it, so every group has advantages that are not zero."""
    return [len(c if isinstance(c, str) else c[0]["content"]) / 20 for c in completions]


def only_rotten(prompts, completions, completion_ids, **columns):
    """1.0 where the completion (text, or TRL's [{"role": "assistant", "content": ...}]) is the word 'rotten', None
    (not scored) where the answer column is 'fresh'."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [None if a.strip() == "fresh" else float(t.strip() == "rotten") for t, a in zip(texts, columns["chosen"])]


def too_few(prompts, completions, completion_ids, **columns):
    return [1.0] * (len(completions) - 1)


def not_a_number(prompts, completions, completion_ids, **columns):
    return ["high" if i == 3 else 1.0 for i in range(len(completions))]


def raises(prompts, completions, completion_ids, **columns):
    """Divides by zero on the rows whose answer is 'rotten'."""
    return [1.0 / (answer.strip() == "fresh") for answer in columns["chosen"]]


def no_kwargs(prompts, completions):
    return [0.0] * len(completions)


def fails_on_the_second_process(prompts, completions, completion_ids, **columns):
    """A reward that raises on the launch's second process only (its RANK), as a user's can on some rows."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("no answer key on this process")
    return [0.0] * len(completions)


def recorded(prompts, completions, completion_ids, **columns):
    """``characters``, recording each prompt with its completion's token ids (one JSON line each) in the file
    $GRPO_RECORD.RANK; it reads the ``rejected`` column, which no built-in reward asks for."""
    import json

    with open(f"{os.environ['GRPO_RECORD']}.{os.environ.get('RANK', '0')}", "a") as f:
        for prompt, ids, rejected in zip(prompts, completion_ids, columns["rejected"]):
            f.write(json.dumps([prompt, rejected, list(ids)]) + "\n")
    return characters(prompts, completions, completion_ids)


def characters_when_fresh(prompts, completions, completion_ids, **columns):
    """``characters`` where the answer column is 'fresh', 0 where it is 'rotten': the completions of a 'rotten'
    prompt all get one reward (a flat group, which dynamic sampling replaces). With $GRPO_RECORD set, each call
    appends one JSON line to $GRPO_RECORD.RANK: per completion, its prompt and reward."""
    import json

    rewards = [r if a.strip() == "fresh" else 0.0
               for r, a in zip(characters(prompts, completions, completion_ids), columns["chosen"])]
    if os.environ.get("GRPO_RECORD"):
        with open(f"{os.environ['GRPO_RECORD']}.{os.environ.get('RANK', '0')}", "a") as f:
            f.write(json.dumps([[p, r] for p, r in zip(prompts, rewards)]) + "\n")
    return rewards

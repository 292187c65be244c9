"""Reward functions for online RL: the built-in ones, the user's own, and calling them safely.

A reward function has TRL's signature, so TRL reward functions work unchanged::

    def f(prompts, completions, completion_ids, **columns) -> list[float | None]

one value per completion (None: the function does not apply to that row, which is then left out of its mean),
``prompts`` and ``completions`` strings (or conversations: a prompt's messages and ``[{"role": "assistant",
"content": ...}]``), ``completion_ids`` token id lists, and every other column of the data by name, one value
per completion. ``SECTION.reward_functions`` names them (``grpo.reward_functions``, ``rloo.reward_functions``):

- ``exact_match``: 1.0 where the completion's text, stripped, equals the ``SECTION.answer_column`` value (as text,
  stripped), else 0.0;
- ``numeric``: 1.0 where the last number in the completion equals the ``SECTION.answer_column`` number, else 0.0;
- ``regex``: 1.0 where the completion's text, stripped, matches ``SECTION.regex`` as a whole, else 0.0;
- ``model:PATH``: a trained reward model's score (a sequence classifier with one output, such as a ``reward_model``
  run's ``model/``; framework/tasks/online_rl/reward_models.py);
- ``path/to/file.py:function`` or ``package.module:function``: the user's own.

Everything the user can get wrong ends as a UserError naming the function (and the row where there is one):
a missing file or function, a failing import, arguments it does not take, a result of the wrong length, a value
that is not a finite number, an exception raised inside it (the row found by calling it on each row alone).
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from framework import templates
from framework.errors import UserError
from framework.tasks.online_rl import reward_models
from framework.user_code import module_of

BUILTIN = ("exact_match", "numeric", "regex")
NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def text(completion: Any) -> str:
    """A completion's text: itself, or a conversation's message contents (its assistant turns': a tool's result
    is not what the model wrote)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict) and m.get("role") != "tool")


def last_number(value: str) -> Optional[float]:
    """The last number written in ``value`` (thousands separators dropped), or None."""
    found = NUMBER.findall(value.replace(",", ""))
    return float(found[-1]) if found else None


def exact_match(answer_column: str) -> Callable:
    def exact_match(prompts, completions, completion_ids, **columns):
        return [float(text(c).strip() == str(a).strip()) for c, a in zip(completions, columns[answer_column])]

    return exact_match


def numeric(answer_column: str, key: str) -> Callable:
    def numeric(prompts, completions, completion_ids, **columns):
        rewards = []
        for i, (completion, answer) in enumerate(zip(completions, columns[answer_column])):
            expected = answer if isinstance(answer, numbers.Real) else last_number(str(answer))
            if expected is None:
                raise UserError(f"{key}: numeric: completion {i} (prompt {_short(prompts[i])}) has the answer "
                                f"{_short(answer)} in column '{answer_column}', which is not a number; fix the row "
                                "or use exact_match")
            got = last_number(text(completion))
            rewards.append(float(got is not None and math.isclose(got, float(expected), rel_tol=1e-9, abs_tol=1e-9)))
        return rewards

    return numeric


def regex(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def regex(prompts, completions, completion_ids, **columns):
        return [float(compiled.fullmatch(text(c).strip()) is not None) for c in completions]

    return regex


class RewardFunction:
    """One entry of the recipe's reward functions (``key``): its name in metrics, the recipe's spelling, and the
    callable."""

    def __init__(self, spec: str, function: Callable, key: str):
        self.spec, self.function, self.key = spec, function, key
        self.name = spec if spec in BUILTIN else getattr(function, "__name__", spec)

    def __call__(self, prompts: List, completions: List, completion_ids: List[List[int]],
                 columns: Dict[str, List]) -> np.ndarray:
        """The rewards of every completion (float64, NaN where the function returned None), checked."""
        arguments = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        try:
            inspect.signature(self.function).bind(**arguments)
        except TypeError as e:
            raise UserError(f"{self.key}: {self.spec!r} does not take TRL's arguments (prompts, completions, "
                            f"completion_ids, **columns; the columns here: {', '.join(columns) or 'none'}): {e}; "
                            "give it a **kwargs parameter") from None
        except ValueError:  # no signature to read (a builtin): call it and see
            pass
        rewards = self._call(arguments, len(completions))
        if not isinstance(rewards, (list, tuple, np.ndarray)) or len(rewards) != len(completions):
            size = f"{len(rewards)} values" if isinstance(rewards, (list, tuple, np.ndarray)) else _short(rewards)
            raise UserError(f"{self.key}: {self.spec!r} returned {size} for {len(completions)} completions; it must return "
                            "a list with one number (or None) per completion")
        values = np.full(len(rewards), np.nan)
        for i, value in enumerate(rewards):
            if value is None:
                continue
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise UserError(f"{self.key}: {self.spec!r} returned {_short(value)} for completion {i} (prompt "
                                f"{_short(prompts[i])}, completion {_short(text(completions[i]))}); each value must "
                                "be a finite number, or None where the function does not apply")
            values[i] = float(value)
        return values

    def _call(self, arguments: Dict[str, List], rows: int):
        """The function's result; an exception inside it becomes a UserError naming the first row that raises
        on its own (or the whole call, where every row alone passes)."""
        try:
            return self.function(**arguments)
        except UserError:
            raise
        except Exception as e:  # the user's code: whatever it raises is theirs to fix
            error = e
        for i in range(rows):
            try:
                self.function(**{k: v[i:i + 1] for k, v in arguments.items()})
            except Exception as e:
                prompt, completion = arguments["prompts"][i], arguments["completions"][i]
                raise UserError(f"{self.key}: {self.spec!r} raised {type(e).__name__}: {e} on completion {i} (prompt "
                                f"{_short(prompt)}, completion {_short(text(completion))})") from None
        raise UserError(f"{self.key}: {self.spec!r} raised {type(error).__name__}: {error} on a batch of {rows} "
                        "completions (no single row raises it alone)") from None


def load(specs: Sequence[str], answer_column: Optional[str], pattern: Optional[str], key: str,
         accelerator=None) -> List[RewardFunction]:
    """The reward functions the recipe names under ``key``, built, loaded (reward models, on ``accelerator``'s
    device) or imported (a missing one is a UserError naming it)."""
    functions = []
    for spec in specs:
        if spec == "exact_match":
            function = exact_match(answer_column)
        elif spec == "numeric":
            function = numeric(answer_column, key)
        elif spec == "regex":
            function = regex(pattern)
        elif reward_models.is_model(spec):
            function = reward_models.ModelReward(spec, key, accelerator)
        else:
            function = _import(spec, key)
        functions.append(RewardFunction(spec, function, key))
    return functions


def _import(spec: str, key: str) -> Callable:
    fix = (f"name a built-in ({', '.join(BUILTIN)}), model:PATH (a reward model), path/to/file.py:function or "
           "package.module:function")
    if not spec.rpartition(":")[0] or not spec.rpartition(":")[2]:
        raise UserError(f"{key}: {spec!r} is not a reward function; {fix}")
    module, name = module_of(spec, key, fix, "framework_user_reward_")
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"{key}: {spec!r}: {spec.rpartition(':')[0]} has no function named {name!r}; {fix}")
    return function


def weighted_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per completion, the weighted sum of its rewards over the functions that scored it (NaN where none did)."""
    total = (per_function * weights).nansum(dim=1)
    return torch.where(torch.isnan(per_function).all(dim=1), torch.nan, total)


class Rewards:
    """A run's reward functions (its section's ``reward_functions``, imported now: a missing one stops the run before
    training) with their weights, scoring the completions of the data's rows."""

    def __init__(self, settings, section: str, tokenizer, accelerator):
        self.key = f"{section}.reward_functions"
        self.functions = load(settings.reward_functions, settings.answer_column, settings.regex, self.key, accelerator)
        w = settings.reward_weights
        self.weights = torch.tensor(w if w is not None else [1.0] * len(self.functions), dtype=torch.float32)
        self.prompt_column, self.tokenizer, self.accelerator = settings.prompt_column, tokenizer, accelerator

    def models(self) -> List[torch.nn.Module]:
        """The reward models among them (``model:PATH``), frozen beside the trained model."""
        return reward_models.models(f.function for f in self.functions)

    def add_environment_reward(self, environment: type, key: str) -> None:
        """An environment's ``get_reward()``, scored once per rollout: a reward named after its class, weight 1
        (TRL's), reading each rollout's environment (the rows' ``environments``)."""
        def get_reward(prompts, completions, completion_ids, environments, **columns):
            return [e.get_reward() for e in environments]

        get_reward.__name__ = environment.__name__
        self.functions.append(RewardFunction(environment.__name__, get_reward, key))
        self.weights = torch.cat([self.weights, torch.ones(1)])

    def total(self, per_function: torch.Tensor) -> torch.Tensor:
        """Each completion's weighted reward."""
        return weighted_rewards(per_function, self.weights)

    def score(self, rows: List[Dict], completion_ids: List[List[int]],
              messages: Optional[List[List[Dict]]] = None) -> torch.Tensor:
        """The rewards (completions x functions, float32, NaN where a function returned None) of each completion
        of the prompt in the same place of ``rows`` (the data's rows, as collated); ``messages``: each completion as
        messages (a tool rollout's assistant turns and tool results, for conversation prompts), else its text."""
        column = self.prompt_column
        prompts = [templates.maybe_conversation(row[column], f"{self.key.split('.')[0]}.prompt_column") or row[column]
                   for row in rows]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [(messages[i] if messages is not None else [{"role": "assistant", "content": t}])
                       if isinstance(p, list) else t for i, (p, t) in enumerate(zip(prompts, texts))]
        # Streamed sources mixed may hold other columns: a row without one gives None (its functions may skip it).
        keys = dict.fromkeys(key for row in rows for key in row if key != column)
        columns = {key: [row.get(key) for row in rows] for key in keys}
        scores = [function(prompts, completions, completion_ids, columns) for function in self.functions]
        return torch.tensor(np.stack(scores, axis=1), dtype=torch.float32)

    def score_together(self, rows: List[Dict], completion_ids: List[List[int]],
                       messages: Optional[List[List[Dict]]] = None) -> torch.Tensor:
        """``score`` on every process at once: where a reward function fails on any process, every process ends with
        that process's message (a UserError), instead of the others waiting for it in the next collective."""
        try:
            scores, message = self.score(rows, completion_ids, messages), None
        except UserError as error:
            scores, message = None, str(error)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object  # not at import: the backend is chosen before accelerate loads

            messages = [m for m in gather_object([message]) if m]
            message = messages[0] if messages else None
        if message:
            raise UserError(message)
        return scores


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."

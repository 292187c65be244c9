"""Reward functions for online RL: the built-in ones, the user's own, and calling them safely.

A reward function has TRL's signature, so TRL reward functions work unchanged::

    def f(prompts, completions, completion_ids, **columns) -> list[float | None]

one value per completion (None: the function does not apply to that row, which is then left out of its mean),
``prompts`` and ``completions`` strings (or conversations: a prompt's messages and ``[{"role": "assistant",
"content": ...}]``), ``completion_ids`` token id lists, and every other column of the data by name, one value
per completion. ``grpo.reward_functions`` names them:

- ``exact_match``: 1.0 where the completion's text, stripped, equals the ``grpo.answer_column`` value (as text,
  stripped), else 0.0;
- ``numeric``: 1.0 where the last number in the completion equals the ``grpo.answer_column`` number, else 0.0;
- ``regex``: 1.0 where the completion's text, stripped, matches ``grpo.regex`` as a whole, else 0.0;
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

from framework.errors import UserError
from framework.user_code import module_of

KEY = "grpo.reward_functions"
BUILTIN = ("exact_match", "numeric", "regex")
NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def text(completion: Any) -> str:
    """A completion's text: itself, or a conversation's message contents."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))


def last_number(value: str) -> Optional[float]:
    """The last number written in ``value`` (thousands separators dropped), or None."""
    found = NUMBER.findall(value.replace(",", ""))
    return float(found[-1]) if found else None


def exact_match(answer_column: str) -> Callable:
    def exact_match(prompts, completions, completion_ids, **columns):
        return [float(text(c).strip() == str(a).strip()) for c, a in zip(completions, columns[answer_column])]

    return exact_match


def numeric(answer_column: str) -> Callable:
    def numeric(prompts, completions, completion_ids, **columns):
        rewards = []
        for i, (completion, answer) in enumerate(zip(completions, columns[answer_column])):
            expected = answer if isinstance(answer, numbers.Real) else last_number(str(answer))
            if expected is None:
                raise UserError(f"{KEY}: numeric: completion {i} (prompt {_short(prompts[i])}) has the answer "
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
    """One entry of ``grpo.reward_functions``: its name in metrics, the recipe's spelling, and the callable."""

    def __init__(self, spec: str, function: Callable):
        self.spec, self.function = spec, function
        self.name = spec if spec in BUILTIN else getattr(function, "__name__", spec)

    def __call__(self, prompts: List, completions: List, completion_ids: List[List[int]],
                 columns: Dict[str, List]) -> np.ndarray:
        """The rewards of every completion (float64, NaN where the function returned None), checked."""
        arguments = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        try:
            inspect.signature(self.function).bind(**arguments)
        except TypeError as e:
            raise UserError(f"{KEY}: {self.spec!r} does not take TRL's arguments (prompts, completions, "
                            f"completion_ids, **columns; the columns here: {', '.join(columns) or 'none'}): {e}; "
                            "give it a **kwargs parameter") from None
        except ValueError:  # no signature to read (a builtin): call it and see
            pass
        rewards = self._call(arguments, len(completions))
        if not isinstance(rewards, (list, tuple, np.ndarray)) or len(rewards) != len(completions):
            size = f"{len(rewards)} values" if isinstance(rewards, (list, tuple, np.ndarray)) else _short(rewards)
            raise UserError(f"{KEY}: {self.spec!r} returned {size} for {len(completions)} completions; it must return "
                            "a list with one number (or None) per completion")
        values = np.full(len(rewards), np.nan)
        for i, value in enumerate(rewards):
            if value is None:
                continue
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise UserError(f"{KEY}: {self.spec!r} returned {_short(value)} for completion {i} (prompt "
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
                raise UserError(f"{KEY}: {self.spec!r} raised {type(e).__name__}: {e} on completion {i} (prompt "
                                f"{_short(prompt)}, completion {_short(text(completion))})") from None
        raise UserError(f"{KEY}: {self.spec!r} raised {type(error).__name__}: {error} on a batch of {rows} "
                        "completions (no single row raises it alone)") from None


def load(specs: Sequence[str], answer_column: Optional[str], pattern: Optional[str]) -> List[RewardFunction]:
    """The reward functions the recipe names, built or imported (a missing one is a UserError naming it)."""
    functions = []
    for spec in specs:
        if spec == "exact_match":
            function = exact_match(answer_column)
        elif spec == "numeric":
            function = numeric(answer_column)
        elif spec == "regex":
            function = regex(pattern)
        else:
            function = _import(spec)
        functions.append(RewardFunction(spec, function))
    return functions


def _import(spec: str) -> Callable:
    fix = f"name a built-in ({', '.join(BUILTIN)}), path/to/file.py:function or package.module:function"
    if not spec.rpartition(":")[0] or not spec.rpartition(":")[2]:
        raise UserError(f"{KEY}: {spec!r} is not a reward function; {fix}")
    module, name = module_of(spec, KEY, fix, "framework_user_reward_")
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"{KEY}: {spec!r}: {spec.rpartition(':')[0]} has no function named {name!r}; {fix}")
    return function


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."

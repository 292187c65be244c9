"""Keys that moved: a task's keys once spelt ``data.KEY`` now live in the task's own section (``Task.moved_from_data``).
A recipe that uses the old name is still read, with a note on stderr; a checkpoint saved before the move resumes."""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, List, Tuple

from framework.config.loading import show

Moves = Iterable[Tuple[str, Iterable[str]]]  # (section, its keys once under data), one per task


def move(data: Dict[str, Any], section: str, keys: Iterable[str]) -> List[str]:
    """Move the recipe's ``data.KEY`` for each of ``keys`` to ``SECTION.KEY`` (in place, with a note); giving both
    names different values is a problem."""
    old, problems = data.get("data"), []
    if not isinstance(old, dict):
        return []
    for key in [key for key in keys if key in old]:
        new = data.setdefault(section, {})
        if not isinstance(new, dict):
            continue  # the section is not a mapping: the schema check says so
        value = old.pop(key)
        if key in new and new[key] != value:
            problems.append(f"data.{key} is now {section}.{key}, and the recipe sets both ({show(value)} and "
                            f"{show(new[key])}); keep {section}.{key} only")
            continue
        new[key] = value
        print(f"note: data.{key} is now {section}.{key}; write it there", file=sys.stderr)
    return problems


def saved(flat: Dict[str, Any], own: Moves, every: Moves) -> Dict[str, Any]:
    """A flattened recipe saved before the keys moved, as it reads now: its own task's moved keys (``own``) under
    their new names, every task's old ``data.*`` names (``every``) dropped."""
    moved = {f"{section}.{key}": flat[f"data.{key}"] for section, keys in own for key in keys if f"data.{key}" in flat}
    old = {f"data.{key}" for _, keys in every for key in keys}
    return {**{k: v for k, v in flat.items() if k not in old}, **moved}

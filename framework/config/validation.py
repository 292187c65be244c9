"""Checking plain recipe data against the schema's type hints: every problem collected (none raised) with its
dotted key, an unknown key with a "did you mean" suggestion, values coerced where the type allows (an int where a
float goes), and field bounds (``gt``, ``ge``, ``lt``, ``le`` in the field's metadata) enforced."""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from framework.config.loading import show
from framework.config.schema import schema_fields

# The words YAML 1.1 reads as booleans, which a boolean key still takes as they were meant (YAML 1.2 reads them as
# text: framework/config/loading.py).
YAML_11_BOOLEANS = {"yes": True, "on": True, "true": True, "no": False, "off": False, "false": False}

def _all_keys(cls: type, prefix: str = "") -> List[str]:
    keys = []
    for f in schema_fields(cls):
        section = _section(typing.get_type_hints(cls)[f.name])
        if section is not None:
            keys += _all_keys(section, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _suggest(key: str, prefix: str, cls: type, root: type) -> str:
    siblings = [f.name for f in schema_fields(cls)]
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    # The key may belong to another section: lr at the top level means optim.lr.
    everywhere = _all_keys(root)
    same_name = [k for k in everywhere if k.rsplit(".", 1)[-1] == key]
    close = same_name or difflib.get_close_matches(key, [k.rsplit(".", 1)[-1] for k in everywhere], n=1)
    if close:
        full = same_name[0] if same_name else next(k for k in everywhere if k.endswith("." + close[0]) or k == close[0])
        return f"; did you mean '{full}'?"
    return f"; valid keys here: {', '.join(siblings)}"


def _section(kind: Any) -> Optional[type]:
    """The dataclass of a section key (``Section`` or ``Optional[Section]``), else None."""
    if dataclasses.is_dataclass(kind):
        return kind
    inner = [a for a in typing.get_args(kind) if a is not type(None)]
    optional = typing.get_origin(kind) is Union and len(inner) == 1 and dataclasses.is_dataclass(inner[0])
    return inner[0] if optional else None


def build(cls: type, data: Any, prefix: str = "", root: Optional[type] = None) -> Tuple[Any, List[str]]:
    """``data`` (plain, as read) turned into the dataclass ``cls``, and every problem found on the way (none raised),
    each naming its dotted key (``prefix``: the section's); an unknown key gets a "did you mean" suggestion from the
    keys of ``root`` (the whole schema; default ``cls``)."""
    root = root or cls
    where = prefix.rstrip(".") or "the recipe"
    if not isinstance(data, dict):
        return cls(), [f"{where} must be a mapping, got {show(data)}"]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in schema_fields(cls)}
    problems, values = [], {}
    for key, value in data.items():
        if key not in fields:
            problems.append(f"unknown key '{prefix}{key}'{_suggest(str(key), prefix, cls, root)}")
            continue
        kind = hints[key]
        item = (typing.get_args(kind) or [None])[0]
        if typing.get_origin(kind) in (list, List) and dataclasses.is_dataclass(item):
            if not isinstance(value, list):
                problems.append(f"{prefix}{key}: {show(value)} is not allowed; expected a list of mappings")
                continue
            built = [build(item, v, f"{prefix}{key}[{i}].", root) for i, v in enumerate(value)]
            values[key] = [b[0] for b in built]
            problems += [p for b in built for p in b[1]]
            continue
        section = _section(kind)
        if section is not None:
            if value is None and section is not kind:  # an optional section (peft), off
                values[key] = None
                continue
            values[key], sub = build(section, value if value is not None else {}, f"{prefix}{key}.", root)
            problems += sub
            continue
        ok, value, allowed = _coerce(value, kind)
        if not ok:
            problems.append(f"{prefix}{key}: {show(value)} is not allowed; expected {allowed}")
            continue
        bound = _check_bounds(value, fields[key].metadata)
        if bound:
            problems.append(f"{prefix}{key}: {show(value)} is out of range; it must be {bound}")
            continue
        values[key] = value
    return cls(**values), problems


def _coerce(value: Any, kind: Any) -> tuple[bool, Any, str]:
    """Return (ok, value, description of what is allowed) for ``value`` against the type hint ``kind``."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        if value is None and type(None) in args:
            return True, None, ""
        results = [_coerce(value, a) for a in inner]
        for ok, coerced, _ in results:
            if ok:
                return True, coerced, ""
        nullable = " or null" if type(None) in args else ""
        return False, value, " or ".join(r[2] for r in results) + nullable
    if origin is Literal:
        return value in args, value, "one of " + ", ".join(str(a) for a in args)
    if origin in (dict, Dict):
        return isinstance(value, dict), value, "a mapping"
    if origin in (list, List):
        (item,) = args
        if not isinstance(value, list):
            return False, value, f"a list of {item.__name__}"
        coerced = [_coerce(v, item) for v in value]
        return all(c[0] for c in coerced), [c[1] for c in coerced], f"a list of {item.__name__}"
    if kind is bool:
        if isinstance(value, str) and value.lower() in YAML_11_BOOLEANS:  # read as text by YAML 1.2 (loading.py)
            return True, YAML_11_BOOLEANS[value.lower()], ""
        return isinstance(value, bool), value, "true or false"
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool), value, "an integer"
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value, "a number"
    if kind is str:
        ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
        return ok, str(value) if ok else value, "a string"
    raise TypeError(f"unsupported schema type {kind}")


def _check_bounds(value: Any, bounds: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""  # None, or the word of a word-or-number key (cpu_threads: auto)
    if isinstance(value, float) and not math.isfinite(value):
        return "a finite number"
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        return "a 64-bit integer"
    if not bounds:
        return ""
    rules = {"gt": (lambda v, b: v > b, "> {}"), "ge": (lambda v, b: v >= b, ">= {}"),
             "lt": (lambda v, b: v < b, "< {}"), "le": (lambda v, b: v <= b, "<= {}")}
    failed = any(not rules[k][0](value, b) for k, b in bounds.items())
    return " and ".join(rules[k][1].format(b) for k, b in bounds.items()) if failed else ""


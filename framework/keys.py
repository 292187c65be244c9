"""The recipe key reference, generated from the schema: every key with its type, default and docstring.

The docstrings are the string literals under each dataclass field (read from the source with ``ast``, a base
section's included). The reference walks sections generically: nested dataclasses (``distributed.fsdp``), optional ones (``peft``), lists
of them (``data.sources``); a section defined outside ``framework/config/schema.py`` (a task's own) is given as one
more ``(name, dataclass)`` pair. ``python recipes/run.py --help-keys [SECTION]`` prints it; docs/keys.md is
``python -m framework.keys``, which tests/test_docs.py keeps current.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

from framework.config import RunConfig
from framework.errors import UserError
from framework.tasks import sections as task_sections

TOP = "top"  # how --help-keys names the keys outside any section (task, seed, output_dir, ...)
WIDTH = 110
BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


@dataclasses.dataclass
class Section:
    name: str  # dotted path; "" for the top level; a list of sections ends with "[]" (data.sources[])
    cls: type
    doc: str  # the field's docstring, then the class's


def field_docs(cls: type) -> Dict[str, str]:
    """Field name -> the string literal under it in the class body, or in the body of the base class that defines it
    (a section that extends another: grpo's and rloo's of online RL's; a field defined again: the subclass's)."""
    docs = {}
    for klass in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (built interactively): no docstrings
            continue
        body = tree.body[0].body
        for stmt, after in zip(body, body[1:]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[stmt.target.id] = _one_paragraph(after.value.value)
    return docs


def _one_paragraph(text: str) -> str:
    return " ".join(text.split())


def _fields(cls: type) -> list:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def _nested(kind: Any) -> Tuple[Optional[type], str]:
    """(the dataclass of a section-typed field, "" or "optional" or "list"), or (None, "")."""
    if dataclasses.is_dataclass(kind):
        return kind, ""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is Union and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0], "optional"
    if typing.get_origin(kind) in (list, List) and args and dataclasses.is_dataclass(args[0]):
        return args[0], "list"
    return None, ""


def sections(root: type, extra: Sequence[Tuple[str, type]] = ()) -> List[Section]:
    """Every section under ``root`` (its own keys first, as the section ""), depth first in field order, then
    each ``(name, dataclass)`` of ``extra`` with the sections under it."""
    found: List[Section] = []

    def walk(name: str, cls: type, doc: str) -> None:
        found.append(Section(name, cls, " ".join(d for d in (doc, _one_paragraph(cls.__doc__ or "")) if d
                                                  and not d.startswith(cls.__name__ + "("))))
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in _fields(cls):
            inner, how = _nested(hints[f.name])
            if inner is not None:
                path = f"{name}.{f.name}" if name else f.name
                walk(path + ("[]" if how == "list" else ""), inner,
                     docs.get(f.name, "") + (" An optional section: absent or null turns it off." if how == "optional"
                                            else ""))

    walk("", root, "")
    for name, cls in extra:
        walk(name, cls, "")
    return found


def describe(kind: Any) -> str:
    """A type hint in words: ``str or list of str or null``, ``one of auto, cpu``."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Union:
        words = [describe(a) for a in args if a is not type(None)]
        return " or ".join(words + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (list, List):
        return f"list of {describe(args[0])}" if args else "list"
    if origin in (dict, Dict):
        return "mapping"
    if kind is Any:
        return "any"
    return getattr(kind, "__name__", str(kind))


def _default(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return _yaml(value)


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def keys(section: Section) -> List[Tuple[str, str, str, str]]:
    """(dotted key, type, default, docstring) of each key of the section itself (not of its subsections)."""
    hints, docs = typing.get_type_hints(section.cls), field_docs(section.cls)
    rows = []
    for f in _fields(section.cls):
        if _nested(hints[f.name])[0] is not None:
            continue
        kind = describe(hints[f.name])
        bounds = " and ".join(f"{BOUNDS[k]} {v}" for k, v in f.metadata.items() if k in BOUNDS)
        rows.append((f"{section.name}.{f.name}" if section.name else f.name, kind + (f", {bounds}" if bounds else ""),
                     _default(f), docs.get(f.name, "")))
    return rows


def known(found: Sequence[Section]) -> List[str]:
    return [s.name.removesuffix("[]") or TOP for s in found]


def select(found: Sequence[Section], wanted: Optional[str]) -> List[Section]:
    """The sections asked for: all (None or ""), the top-level keys (``top``), or a section with those under it."""
    if not wanted:
        return list(found)
    if wanted == TOP:
        return [s for s in found if not s.name]
    chosen = [s for s in found if s.name.removesuffix("[]") == wanted or s.name.startswith(wanted + ".")
              or s.name.startswith(wanted + "[].")]
    if not chosen:
        raise UserError(f"--help-keys: {wanted!r} is not a section; use one of {', '.join(known(found))}")
    return chosen


def render(found: Sequence[Section]) -> str:
    """Markdown, plain enough to read in a terminal: a header per section, one list item per key."""
    lines = []
    for section in found:
        lines += ["", f"## {section.name or 'top level'}" + (f" (`--help-keys {TOP}`)" if not section.name else "")]
        if section.doc:
            lines += ["", *_wrap(section.doc, "")]
        rows = keys(section)
        if rows:
            lines.append("")
        for key, kind, default, doc in rows:
            lines += _wrap(f"- `{key}` ({kind}; default `{default}`)" + (f": {doc}" if doc else ""), "  ")
    return "\n".join(lines) + "\n"


def _wrap(text: str, indent: str) -> List[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def recipe_sections() -> List[Section]:
    """The sections of a recipe: RunConfig's, then each registered task's own (``Task.options``)."""
    return sections(RunConfig, tuple(task_sections().items()))


def page() -> str:
    """docs/keys.md."""
    return ("# Recipe keys\n\nEvery recipe key with its type, default and meaning, generated from the docstrings in "
            "the schema\n(`framework/config/schema.py` and each task's section). Regenerate with `python -m framework.keys > docs/keys.md`; print "
            "one section with\n`python recipes/run.py --help-keys SECTION`.\n" + render(recipe_sections()))


if __name__ == "__main__":
    print(page(), end="")

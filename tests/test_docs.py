"""The documentation stays true: the key reference is the schema's, and what README.md and docs/ name exists."""

import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List, Literal, Optional, Union

import pytest

from helpers import ROOT
from framework import keys
from framework.cli import main

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REGENERATE = "regenerate it: .venv/bin/python -m framework.keys > docs/keys.md"


def test_the_key_reference_is_generated_from_the_schema():
    assert (ROOT / "docs" / "keys.md").read_text() == keys.page(), f"docs/keys.md is out of date; {REGENERATE}"


def test_every_recipe_key_has_a_docstring():
    undocumented = [key for section in keys.recipe_sections() for key, _, _, doc in keys.keys(section) if not doc]
    assert not undocumented, f"write a docstring under each of these fields, then {REGENERATE}: {undocumented}"


def test_help_keys_prints_one_section(capsys):
    assert main(["--help-keys", "distributed"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## distributed\n")
    assert "- `distributed.fsdp.replicas` (int, >= 1; default `1`): FSDP2: HSDP" in out
    assert "optim.lr" not in out


def test_help_keys_with_an_unknown_section_exits_2_naming_the_sections():
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "run.py"), "--help-keys", "BADSECTION"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: --help-keys: 'BADSECTION' is not a section; use one of top, report, model, "
                                  "data, data.sources, train,"), proc.stderr


@dataclass
class Inner:
    weight: float = field(default=1.0, metadata={"gt": 0.0})
    """Its share."""


@dataclass
class Toy:
    """A section defined outside the schema, as a task's own."""

    mode: Literal["a", "b"] = "a"
    """Which one."""
    files: Optional[Union[str, List[str]]] = None
    """A path or several."""
    parts: List[Inner] = field(default_factory=list)
    """The parts."""
    extra: Optional[Inner] = None
    """An extra part."""


def test_a_section_from_outside_the_schema_is_walked_like_the_schema_s():
    found = keys.sections(Inner, extra=[("toy", Toy)])
    assert [s.name for s in found] == ["", "toy", "toy.parts[]", "toy.extra"]
    assert keys.known(found) == ["top", "toy", "toy.parts", "toy.extra"]
    text = keys.render(keys.select(found, "toy"))
    assert "## toy\n\nA section defined outside the schema, as a task's own.\n" in text
    assert "- `toy.mode` (one of a, b; default `a`): Which one." in text
    assert "- `toy.files` (str or list of str or null; default `null`): A path or several." in text
    assert "## toy.parts[]\n\nThe parts.\n\n- `toy.parts[].weight` (float, > 0.0; default `1.0`): Its share." in text
    assert "## toy.extra\n\nAn extra part. An optional section: absent or null turns it off." in text


def named(pattern: str) -> List[tuple]:
    """(page, match) for every match of ``pattern`` in README.md and docs/*.md."""
    return [(page.name, m) for page in PAGES for m in re.findall(pattern, page.read_text())]


def test_every_make_target_named_exists():
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    missing = [(page, t) for page, t in named(r"\bmake ([a-z][\w-]*)") if t not in targets]
    assert not missing, missing


def test_every_recipe_and_launch_config_named_exists():
    paths = named(r"\b((?:recipes|accelerate_configs|launch|tests|benchmarks|tools|framework)/[\w./-]*\w)")
    assert len(paths) > 50
    missing = [(page, p) for page, p in paths if not (ROOT / p).exists() and "*" not in p]
    assert not missing, missing


def test_every_test_file_named_exists():
    missing = [(page, name) for page, name in named(r"\b(test_\w+\.py)") if not (ROOT / "tests" / name).is_file()]
    assert not missing, missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    links = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    broken = [link for link in links if not re.match(r"[a-z]+:", link)
              and not (page.parent / link.split("#")[0]).exists()]
    assert not broken, broken

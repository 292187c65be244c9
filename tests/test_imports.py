"""The framework's imports: module-level only, without cycles, and clean by ruff's rules (pyproject.toml's
[tool.ruff]: unused imports, redefinitions, duplicate class fields).

A framework import inside a function hides a dependency (and usually a cycle): none, but in the entry point
(``framework.cli``), which stages its imports so that its signal handlers are installed before torch loads."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

from helpers import ROOT

PACKAGE = ROOT / "framework"
ENTRY_POINT = "framework.cli"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, current: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(node: ast.AST, current: str, is_package: bool, modules: Set[str]) -> List[str]:
    """The framework modules an import statement imports (``from framework import backend``: framework.backend)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        module = _resolve(node, current, is_package)
        names = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module for alias in node.names]
    return [n for n in names if n in modules]


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def import_graph() -> Tuple[Dict[str, Set[str]], Set[Tuple[str, str]]]:
    """(module -> the framework modules it imports at module level, the (module, imported) pairs inside
    functions). Imports under ``if TYPE_CHECKING:`` are annotations only and count for neither."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    in_functions: Set[Tuple[str, str]] = set()
    for name, path in files.items():
        package = path.name == "__init__.py"

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _type_checking(child):
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _imported(child, name, package, modules):
                        if target == name:
                            continue
                        if in_function:
                            in_functions.add((name, target))
                        else:
                            graph[name].add(target)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text()), False)
    # Importing a submodule runs its packages' __init__ first.
    for name in modules:
        for target in list(graph[name]):
            parent = target.rsplit(".", 1)[0]
            while parent in modules and parent != name and not name.startswith(parent + "."):
                graph[name].add(parent)
                parent = parent.rsplit(".", 1)[0]
    return graph, in_functions


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_framework_imports_have_no_cycles():
    graph, _ = import_graph()
    assert cycles(graph) == []


def test_no_framework_import_inside_a_function_but_the_entry_points():
    _, in_functions = import_graph()
    assert {(a, b) for a, b in in_functions if a != ENTRY_POINT} == set()


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    proc = subprocess.run([ruff, "check", "framework", "tests", "recipes", "benchmarks", "tools"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_reading_every_recipe_imports_no_accelerate():
    """backend.select_backend must run before accelerate is imported (accelerate decides the device kind when it
    loads: an XLA venv's `backend=cpu` run got XLA once grpo.py imported accelerate.utils at module level). Reading
    a recipe imports every task module; none may bring accelerate in."""
    script = ("import sys\nfrom pathlib import Path\nfrom framework.recipe import load_config\n"
              "for recipe in sorted(Path('recipes').rglob('*.yaml')):\n"
              "    try:\n        load_config(recipe, [])\n    except Exception:\n        pass\n"
              "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] == 'accelerate'}))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout

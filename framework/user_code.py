"""Importing what a recipe names in the user's own code: ``path/to/file.py:NAME`` or ``package.module:NAME`` (a
task class, a reward function). Whatever goes wrong is a UserError naming the recipe key and the spelling."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Tuple

from framework.errors import UserError


def module_of(spec: str, key: str, fix: str, prefix: str) -> Tuple[ModuleType, str]:
    """(the module ``spec`` names before its last colon, the name after it), imported: a file once per resolved
    path (as ``PREFIX`` + the path), a dotted module by Python's import. ``key``: the recipe key that named it;
    ``fix``: how to name one correctly, ending each message."""
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise UserError(f"{key}: {spec!r}: {path} does not exist (relative paths start at {Path.cwd()}); {fix}")
            module_name = prefix + re.sub(r"\W", "_", str(path.resolve()))
            module = sys.modules.get(module_name)  # the file under another spelling of its path: loaded once
            if module is None:
                found = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(found)
                sys.modules[module_name] = module  # dataclasses look their module up while the file runs
                try:
                    found.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]
                    raise
        else:
            module = importlib.import_module(where)
    except UserError:
        raise
    except Exception as e:  # the user's code: any error it raises on import is theirs to fix
        raise UserError(f"{key}: {spec!r}: importing {where} failed ({type(e).__name__}: {e}); {fix}") from None
    return module, name

"""Reading a recipe: YAML files (``extends`` first, then the file, then ``KEY=VALUE`` overrides) merged with
OmegaConf, interpolations resolved, into plain data; and a resolved recipe written back out (``to_dict``,
``to_yaml``), with values that came from the environment kept as their templates.

YAML is read with YAML 1.2's booleans: only ``true`` and ``false`` (any case) are booleans. YAML 1.1, which
PyYAML and OmegaConf follow, also reads ``yes``, ``no``, ``on`` and ``off`` as booleans, so ``precision: no`` (a
documented value) arrived as ``false`` and was refused. A key whose type is a boolean still accepts those words
(framework/config/validation.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.errors import UserError


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans (true/false only), numbers as OmegaConf reads them (``1e-5``
    is a float, as in YAML 1.2; YAML 1.1 wanted ``1.0e-5``), no timestamps (a date stays text), and a key given
    twice in one mapping refused (the later value would silently win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Any:
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"found duplicate key {key_node.value}",
                                                            key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


_REPLACED = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")
RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _REPLACED]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))
RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"""^(?:
     [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
    |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))


def read(path: Optional[str | Path], overrides: List[str]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the recipe as plain data, interpolations resolved and ``extends`` dropped; the keys whose values came from
    the environment, with their templates) of a recipe file (with its ``extends`` chain; None: no file) and
    ``KEY=VALUE`` overrides."""
    raw = _load_recipe(Path(path), ()) if path is not None else OmegaConf.create({})
    raw = _merge(raw, _parse_overrides(overrides), f"overrides {' '.join(overrides)}")
    try:
        data = OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise UserError(f"{key or 'recipe'}: cannot resolve its interpolation ({reason}); write ${{other.key}} or "
                        "${oc.env:VARIABLE} with a key or variable that exists") from None
    data.pop("extends", None)
    return data, _env_templates(flatten(OmegaConf.to_container(raw, resolve=False)), flatten(data))


def to_dict(cfg) -> Dict[str, Any]:
    """The resolved recipe (a schema instance) as plain data, with values from the environment as their templates."""
    data = dataclasses.asdict(cfg)
    data.pop("env_templates")
    for key, template in cfg.env_templates.items():
        *parents, last = key.split(".")
        node = data
        for name in parents:
            node = node[name]
        node[last] = template
    return data


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)), sort_keys=False)


def flatten(data: Any, prefix: str = "") -> Dict[str, Any]:
    """Nested mappings as {dotted key: value}; lists stay whole values."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data}
    flat = {}
    for key, value in data.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat


def show(value: Any) -> str:
    """A value as messages quote it: text in quotes, the rest as JSON."""
    return repr(value) if isinstance(value, str) else json.dumps(value, default=str)


def _env_templates(unresolved: Dict[str, Any], resolved: Dict[str, Any]) -> Dict[str, Any]:
    """The keys whose value comes from the environment (``${oc.env:VAR}``, or an interpolation of such a
    value), with their unresolved text."""
    def text(value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value, default=str)

    from_env = {key: value for key, value in unresolved.items() if re.search(r"\$\{\s*(oc\.)?env:", text(value))}
    secrets = [text(resolved[key]) for key in from_env if key in resolved and text(resolved[key]).strip()]
    for key, value in unresolved.items():
        if "${" in text(value) and any(secret in text(resolved.get(key)) for secret in secrets):
            from_env[key] = value
    return {key: value for key, value in from_env.items() if key != "extends"}


def _load_recipe(path: Path, chain: tuple) -> Any:
    if not path.is_file():
        raise UserError(f"recipe file {path} does not exist; pass an existing file to --config (see recipes/)")
    if path.resolve() in chain:
        raise UserError(f"recipe {path}: 'extends' forms a cycle")
    try:
        conf = OmegaConf.create(yaml.load(path.read_text(encoding="utf-8"), Loader=RecipeLoader))
    except Exception as e:  # yaml errors come in several types; all mean the same to the user
        raise UserError(f"recipe {path} is not valid YAML: {e}") from None
    if not OmegaConf.is_dict(conf):
        raise UserError(f"recipe {path} must be a mapping of keys to values, not {type(conf).__name__}")
    parents = conf.get("extends") or []
    if isinstance(parents, str):
        parents = [parents]
    if not OmegaConf.is_list(parents) and not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise UserError(f"recipe {path}: extends must be a recipe path or a list of them, not {show(parents)}")
    merged = OmegaConf.create({})
    for parent in parents:
        parent_path = path.parent / str(parent)
        if not parent_path.is_file():
            raise UserError(f"recipe {path}: extends '{parent}', but {parent_path} does not exist")
        merged = _merge(merged, _load_recipe(parent_path, chain + (path.resolve(),)), f"recipe {path}")
    return _merge(merged, conf, f"recipe {path}")


def _merge(base: Any, over: Any, what: str) -> Any:
    """``over`` merged onto ``base``; a key that is a section in one and a list in the other is refused."""
    try:
        return OmegaConf.merge(base, over)
    except (OmegaConfBaseException, TypeError, ValueError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        key = getattr(e, "full_key", None)
        raise UserError(f"{what}: cannot merge {'key ' + key if key else 'it'} onto the recipe ({reason}); a section "
                        "(a mapping) can only be replaced by a mapping, a list by a list") from None


_KEY_PATH = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


def _parse_overrides(overrides: List[str]) -> Any:
    """``KEY=VALUE`` pairs, each value read as YAML (``RecipeLoader``), as one config; a malformed one is refused by
    name."""
    merged = OmegaConf.create({})
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not _KEY_PATH.fullmatch(key):
            raise UserError(f"override '{item}' must look like KEY=VALUE with KEY a dotted key path, for example "
                            "train.batch_size=16")
        try:
            parsed = OmegaConf.create()
            OmegaConf.update(parsed, key, yaml.load(value, Loader=RecipeLoader))
        except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
            reason = (str(e).splitlines() or [type(e).__name__])[0]
            raise UserError(f"override '{item}': the value of {key} is not valid YAML ({reason}); write a "
                            f"complete value (a list as [1, 2]) or quote it as text ({key}='{value}')") from None
        merged = _merge(merged, parsed, f"override '{item}'")
    return merged

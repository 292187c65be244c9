"""Tools and environments for online RL, TRL 1.16's contract, so that the same files work unchanged:

- ``SECTION.tools``: plain functions named ``path/to/file.py:function`` or ``package.module:function``, each with
  type hints and a Google-style docstring, from which transformers' ``get_json_schema`` makes the JSON schema listed
  to the model (the chat template renders the schemas in the prompt: ``data.chat_template: chatml-tools``);
- ``SECTION.environment``: a class (named the same way), instantiated once per rollout: ``reset(**row)`` (the data's
  row; a returned string is appended to the prompt's last user message), its public methods its tools (besides the
  functions), and an optional ``get_reward()`` scored once per rollout, a reward named after the class, weight 1.

The model's mistakes are part of training, never a crash: a call to an unknown tool, malformed JSON, arguments the
tool does not take, a tool that raises or runs past ``SECTION.tool_timeout`` seconds each give the model the result
``{'error': ...}`` (TRL's, as text) and are counted as failures. The user's mistakes stop the run before it trains,
a UserError naming the key: a file that does not import, a function without a schema (no type hints or docstring),
an environment without ``reset``.

Tools are the user's own code: they run in the training process, with the run's rights. A call that times out is
given up on, not stopped (Python cannot stop a thread): it runs on in a daemon thread until it returns or the run
ends."""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from framework import templates
from framework.errors import UserError
from framework.user_code import module_of

FIX = "name path/to/file.py:NAME or package.module:NAME"


def _imported(spec: str, key: str) -> Any:
    if not spec.rpartition(":")[0] or not spec.rpartition(":")[2]:
        raise UserError(f"{key}: {spec!r} is not a tool or environment; {FIX}")
    module, name = module_of(spec, key, FIX, "framework_user_tool_")
    found = getattr(module, name, None)
    if found is None:
        raise UserError(f"{key}: {spec!r}: {spec.rpartition(':')[0]} has no {name!r}; {FIX}")
    return found


def schema(function: Callable, key: str, spec: str) -> Dict[str, Any]:
    """``function``'s JSON schema (transformers' ``get_json_schema``); a function it cannot describe is the user's
    error, named by ``key``."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as e:  # transformers' TypeError / DocstringParsingException: no hints or no docstring
        raise UserError(f"{key}: {spec!r}: no JSON schema can be made of {getattr(function, '__name__', spec)!r} "
                        f"({e}); give it type hints and a Google-style docstring with an Args section") from None


def public_methods(cls: type) -> List[str]:
    """An environment class's tool methods: its public functions but ``reset`` and ``get_reward`` (listed on the
    class, as TRL does: properties are not evaluated)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")]


class Toolbox:
    """A run's tools (``SECTION.tools``) and environment class (``SECTION.environment``), imported and checked now:
    a mistake stops the run before it trains. ``schemas``: the functions' and the environment's methods' JSON
    schemas, as the prompts list them."""

    def __init__(self, settings, section: str, tools_key: Optional[str] = None):
        """``tools_key``: what the functions' mistakes name (default ``SECTION.tools``; the chat's ``--tools``)."""
        self.section, self.timeout = section, settings.tool_timeout
        tools_key = key = tools_key or f"{section}.tools"
        self.functions: Dict[str, Callable] = {}
        self.schemas: List[Dict[str, Any]] = []
        for spec in settings.tools:
            function = _imported(spec, key)
            if not callable(function) or inspect.isclass(function):
                raise UserError(f"{key}: {spec!r} is not a function; {FIX}")
            self.schemas.append(schema(function, key, spec))
            self.functions[self.schemas[-1]["function"]["name"]] = function
        self.environment: Optional[type] = None
        self.methods: List[str] = []
        if settings.environment:
            key = f"{section}.environment"
            cls = _imported(settings.environment, key)
            if not inspect.isclass(cls):
                raise UserError(f"{key}: {settings.environment!r} is not a class; {FIX}")
            if not callable(getattr(cls, "reset", None)):
                raise UserError(f"{key}: {settings.environment!r} has no reset method; an environment defines "
                                "reset(**row) (TRL's environment_factory contract)")
            try:
                probe = cls()  # TRL probes one instance for its bound methods' schemas
            except Exception as e:  # the user's class
                raise UserError(f"{key}: {settings.environment!r}() raised {type(e).__name__}: {e}") from None
            self.environment, self.methods = cls, public_methods(cls)
            self.schemas += [schema(getattr(probe, name), key, f"{settings.environment}.{name}")
                             for name in self.methods]
        names = [s["function"]["name"] for s in self.schemas]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise UserError(f"{tools_key}: more than one tool is named {', '.join(twice)}; rename one")

    def __bool__(self) -> bool:
        """Whether rollouts run the tool loop: there are tools, or an environment."""
        return bool(self.schemas) or self.environment is not None

    @property
    def has_reward(self) -> bool:
        return self.environment is not None and callable(getattr(self.environment, "get_reward", None))

    def environments(self, count: int) -> List[Optional[Any]]:
        """A fresh environment for each of ``count`` rollouts (None each without an environment)."""
        return [self.environment() if self.environment is not None else None for _ in range(count)]

    def tools_of(self, environment: Optional[Any]) -> Dict[str, Callable]:
        """The callables a rollout's calls reach: the functions, and its environment's bound methods."""
        tools = dict(self.functions)
        if environment is not None:
            tools.update({name: getattr(environment, name) for name in self.methods})
        return tools

    def run(self, call: Union[templates.ToolCall, templates.MalformedCall],
            tools: Dict[str, Callable]) -> Tuple[str, str, bool]:
        """(the tool's name, its result as text, whether the call failed): a failure's result is
        ``{'error': ...}`` as TRL writes it (``str`` of the dict)."""
        if isinstance(call, templates.MalformedCall):
            return "tool", str({"error": f"malformed tool call: {call.reason}"}), True
        function = tools.get(call.name)
        if function is None:
            return call.name, str({"error": f"Tool {call.name} not found."}), True
        outcome: Dict[str, Any] = {}

        def target():
            try:
                outcome["result"] = function(**call.arguments)
            except Exception as e:  # the model's arguments, the user's tool: the error is the model's result
                outcome["error"] = str(e) or type(e).__name__

        worker = threading.Thread(target=target, daemon=True, name=f"tool {call.name}")
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            return call.name, str({"error": f"Tool {call.name} timed out after {self.timeout:g} s."}), True
        if "error" in outcome:
            return call.name, str({"error": outcome["error"]}), True
        return call.name, str(outcome.get("result")), False


def reset(environment: Optional[Any], row: Dict, key: str) -> Optional[str]:
    """``environment.reset(**row)``: the text to append to the prompt's last user message, or None; a result
    that is neither is the user's error."""
    if environment is None:
        return None
    try:
        text = environment.reset(**row)
    except Exception as e:  # the user's environment
        raise UserError(f"{key}: {type(environment).__name__}.reset raised {type(e).__name__}: {e} on the row "
                        f"{templates.snippet(row)}") from None
    if text is not None and not isinstance(text, str):
        raise UserError(f"{key}: {type(environment).__name__}.reset returned {templates.snippet(text)}; it must "
                        "return a string (appended to the last user message) or None")
    return text

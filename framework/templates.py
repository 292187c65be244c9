"""Chat templates and conversations for post-training (``sft``, ``dpo``, online RL): which template renders a conversation,
checked conversations, and their tokens with the mask of what is trained on.

A conversation is a list of ``{role, content}`` messages (roles ``system``, ``user``, ``assistant``, ``tool``;
extra keys such as ``tool_calls`` go to the template as they are). The template is the tokenizer's own, or
``data.chat_template``: a jinja file, or a built-in name (``chatml``), whose special tokens are added to the
tokenizer (the model's embeddings then grow to match: ``resize_embeddings``); a tokenizer without an EOS token
(an encoder's, such as BERT's WordPiece) takes the template's end of turn as its EOS.

Assistant masks come from the rendered conversation itself, so a template needs no ``{% generation %}``
markers: assistant message i is trained on from the end of the conversation before it rendered with the
generation prompt (``messages[:i]`` + the assistant header) to the end of the conversation rendered through it
(``messages[:i+1]``: its content and end-of-turn text), each measured where the full rendering agrees with it.
Tokens are marked with transformers' own rule for generation spans (every token overlapping a span), over the
same tokenization ``apply_chat_template`` makes, so the mask equals TRL's ``assistant_only_loss`` mask under a
training template that puts ``{% generation %}`` right after the assistant header (TRL's chatml-style, Llama 3
and Phi-3 training templates do; Qwen2.5's also trains the newline that ends the header). A template that has
the markers is taken at its word (transformers' ``return_assistant_tokens_mask``, as TRL does). A template
that renders earlier turns differently once later ones follow (not prefix-preserving) is refused.

Prompt/completion rows follow TRL's ``completion_only_loss``: strings are tokenized as ``prompt + completion +
EOS`` (no template); conversations as the prompt with the generation prompt, then prompt + completion; the
completion is what follows their common token prefix.

Tool calling (TRL's and OpenAI's format): an assistant message may hold ``tool_calls`` (``[{"type": "function",
"function": {"name", "arguments"}}]``, the arguments a mapping or its JSON text), a ``tool`` message a call's result,
and a conversation may come with ``tools`` (JSON schemas, as transformers' ``get_json_schema`` writes them). The
built-in ``chatml-tools`` renders them (Qwen2.5/Hermes style): the schemas in the system turn, each call on a line
of its own as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` after the message's content, each result
in a ``tool`` turn of its own as ``<tool_response>...</tool_response>``. A template that renders a conversation's
tools or calls as if they were not there is refused (``check_tool_support``). ``tool_turn_ids`` and
``parse_tool_calls`` are what an RL loop sampling tool calls needs: the tokens it inserts after a sampled
``</tool_call>``, and the calls in sampled text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from jinja2 import TemplateError

from framework.errors import UserError

ROLES = ("system", "user", "assistant", "tool")

# The ChatML layout (OpenAI's, used by Qwen and many others), without a default system prompt.
CHATML = ("{%- for message in messages %}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
          "{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# The system turn's tool list and instructions (Qwen2.5's and Hermes' words), each call on one line.
TOOLS_INTRO = ("# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
               "provided with function signatures within <tools></tools> XML tags:\\n<tools>")
TOOLS_OUTRO = ("\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\\n<tool_call>{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}</tool_call>")
# ChatML with tools: without tools and tool messages it renders exactly as CHATML. Each tool message is a turn
# of its own, so that every earlier turn renders the same whatever follows it (prefix-preserving at every cut).
CHATML_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' and messages[0]['content'] %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '" + TOOLS_INTRO + "' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '" + TOOLS_OUTRO + "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>' + ({'name': function['name'], 'arguments': function['arguments']} | tojson) + '</tool_call>' }}"
    "{%- if not loop.last %}{{- '\\n' }}{%- endif %}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@dataclass(frozen=True)
class Builtin:
    template: str
    special_tokens: Tuple[str, ...]  # added to a tokenizer that lacks them
    end_of_turn: str  # generation stops there
    # Added to a tokenizer that lacks them as ordinary (not special) tokens: one id each, kept by decoding.
    added_tokens: Tuple[str, ...] = ()


# chatml-tools adds <tool_call> and </tool_call> as tokens: a call then starts and ends with one id each, so an
# RL loop stops sampling exactly at the end of a call (one id, no partial-string matching across token merges).
BUILTIN = {"chatml": Builtin(CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
           "chatml-tools": Builtin(CHATML_TOOLS, ("<|im_start|>", "<|im_end|>"), "<|im_end|>",
                                   (TOOL_CALL_START, TOOL_CALL_END))}
KEY = "data.chat_template"
# On a model whose embeddings ``resize_embeddings`` grew: the new rows' ids, which adapters train (an attribute of
# the loaded model, read by framework/adapters.py before peft wraps it; never saved).
NEW_ROWS = "_framework_new_token_rows"
RENDER_ERRORS = (TemplateError, TypeError, ValueError, KeyError, IndexError)  # a template that cannot render a row
def tools_hint(key: str = KEY) -> str:
    """How to fix a template that cannot show tools, ``key`` being where the template is chosen."""
    return f"set {key} to a template that renders tools and tool calls, such as the built-in chatml-tools"


TOOLS_HINT = tools_hint()


def use_template(tokenizer, name: Optional[str], needed: bool = True, key: str = KEY) -> List[str]:
    """Give ``tokenizer`` the chat template ``name`` (a built-in name or a jinja file; None: keep its own) and,
    for a built-in one, its special (and added) tokens. Returns the tokens added (the model's embeddings must grow
    for them: ``resize_embeddings``). ``needed``: a template is required (conversations are to be rendered); ``key``:
    the recipe key or option that names the template, in errors."""
    if name is None:
        if needed and not tokenizer.chat_template:
            raise UserError(f"{key}: the tokenizer has no chat template of its own; set {key} to a built-in one "
                            f"({', '.join(BUILTIN)}) or to a jinja file")
        return []
    if name in BUILTIN:
        builtin = BUILTIN[name]
        vocab = tokenizer.get_vocab()
        added = [t for t in builtin.special_tokens if t not in vocab]
        if added:
            tokenizer.add_tokens(added, special_tokens=True)
        plain = [t for t in builtin.added_tokens if t not in vocab]
        if plain:
            tokenizer.add_tokens(plain)
            added += plain
        if tokenizer.eos_token is None:  # an encoder's tokenizer (BERT's): a turn's end is where text ends
            tokenizer.eos_token = builtin.end_of_turn
        tokenizer.chat_template = builtin.template
        return added
    path = Path(name)
    if not path.is_file():
        raise UserError(f"{key}: '{name}' is neither a built-in template ({', '.join(BUILTIN)}) nor a file "
                        f"(relative paths start at {Path.cwd()})")
    tokenizer.chat_template = path.read_text()
    return []


def end_of_turn_ids(tokenizer, name: Optional[str]) -> List[int]:
    """The token ids a generated answer stops at: the built-in template's end-of-turn token, and EOS."""
    ids = [tokenizer.convert_tokens_to_ids(BUILTIN[name].end_of_turn)] if name in BUILTIN else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def resize_embeddings(model, tokenizer) -> None:
    """Grow the model's token embeddings (and output layer, tied or not) to the tokenizer's vocabulary, if smaller.
    Each new row starts as the mean of the rows of the pieces its token's text is made of without it
    (``</tool_call>``: ``</``, ``tool``, ``_``, ``call``, ``>`` in SmolLM2's vocabulary), or of every old row where
    it has none: deterministic, and distinct from the other new rows, where transformers' default (the old rows'
    mean, plus noise scaled by 1e-9) makes them all one vector, so that a model whose rows stay frozen (an adapter)
    can never tell ``<tool_call>`` from ``</tool_call>``. The new rows' ids are marked on the model (``NEW_ROWS``):
    adapters train those rows (framework/adapters.py)."""
    old = model.get_input_embeddings().weight.shape[0]
    if old >= len(tokenizer):
        return
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    weights = [model.get_input_embeddings().weight]
    out = model.get_output_embeddings()
    if out is not None and out.weight is not weights[0] and out.weight.shape[0] == len(tokenizer):
        weights.append(out.weight)
    for row in range(old, len(tokenizer)):
        pieces = [i for i in text_pieces(tokenizer, tokenizer.convert_ids_to_tokens(row)) if i < old]
        for weight in weights:
            weight.data[row] = weight.data[pieces].mean(0) if pieces else weight.data[:old].mean(0)
    setattr(model, NEW_ROWS, list(range(old, len(tokenizer))))


def text_pieces(tokenizer, text: str) -> List[int]:
    """The ids ``text`` is tokenized into as if it were not one of the tokenizer's added tokens: its normalizer,
    pre-tokenizer and model alone (a fast tokenizer's; none for a slow one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    words = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
    return [token.id for word, _ in words for token in backend.model.tokenize(word)]


def conversation(value: Any, where: str) -> List[Dict[str, Any]]:
    """``value`` checked as a conversation: a list (or its JSON text, as a csv holds it) of ``{role, content}``
    mappings with known roles; an assistant message with ``tool_calls`` may have no content (its calls checked and
    normalised: ``tool_calls``). Keys whose value is None (absent in that row of a typed column) are dropped."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise UserError(f"{where}: {snippet(value)} is not a conversation (a JSON list of {{role, content}}); "
                            "fix the row or the column") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise UserError(f"{where}: {snippet(value)} is not a conversation: expected a non-empty list of "
                        "{role, content} messages")
    messages = []
    for i, message in enumerate(value):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or (
                "content" not in message and not calls):
            raise UserError(f"{where}: message {i} ({snippet(message)}) is not a {{role, content}} mapping")
        if message["role"] not in ROLES:
            raise UserError(f"{where}: message {i} has the unknown role {message['role']!r}; roles are "
                            f"{', '.join(ROLES)}")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise UserError(f"{where}: message {i} has content {snippet(content)}; content must be text")
        message = {k: v for k, v in message.items() if v is not None or k == "content"}
        if calls:
            if message["role"] != "assistant":
                raise UserError(f"{where}: message {i} ({message['role']}) has tool_calls; only an assistant "
                                "message calls tools")
            message["tool_calls"] = tool_calls(calls, f"{where}: message {i}")
        else:
            message.pop("tool_calls", None)
        messages.append(message)
    return messages


def tool_calls(value: Any, where: str) -> List[Dict[str, Any]]:
    """An assistant message's ``tool_calls`` checked and normalised to ``[{"type": "function", "function": {"name",
    "arguments": a mapping}}]``: each call a ``{"function": {name, arguments}}`` (TRL's and OpenAI's format) or a
    bare ``{name, arguments}``, its arguments a mapping or its JSON text. Arguments whose value is None are
    dropped: a typed (Arrow) column fills in, as None, the arguments other rows' calls have."""
    if not isinstance(value, (list, tuple)):
        raise UserError(f"{where}: tool_calls {snippet(value)} is not a list of calls")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                arguments = None
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            raise UserError(f"{where}: tool call {j} ({snippet(call)}) is not a {{\"type\": \"function\", "
                            "\"function\": {\"name\": ..., \"arguments\": {...}}} (arguments a mapping or its JSON "
                            "text)")
        arguments = {k: v for k, v in arguments.items() if v is not None}
        extra = {k: v for k, v in call.items() if k not in ("function", "name", "arguments", "type")}
        calls.append({**extra, "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def tool_schemas(value: Any, where: str) -> Optional[List[Dict[str, Any]]]:
    """A conversation's tools (TRL's ``tools`` column) checked: a list (or its JSON text) of JSON schemas
    ``{"type": "function", "function": {"name", "description", "parameters": {"type": "object", "properties":
    {...}}}}``, as transformers' ``get_json_schema`` writes them; None when there are none. Keys whose value is
    None are dropped at every depth (a typed column fills in what other rows' schemas have)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise UserError(f"{where}: {snippet(value)} is not a list of tool schemas (JSON)") from None
    if not isinstance(value, (list, tuple)):
        raise UserError(f"{where}: {snippet(value)} is not a list of tool schemas")
    tools = []
    for j, tool in enumerate(_without_none(list(value))):
        function = tool.get("function") if isinstance(tool, dict) else None
        parameters = function.get("parameters", {"type": "object", "properties": {}}) if isinstance(
            function, dict) else None
        if (not isinstance(function, dict) or tool.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not function["name"]
                or not isinstance(parameters, dict) or parameters.get("type") != "object"
                or not isinstance(parameters.get("properties", {}), dict)):
            raise UserError(f"{where}: tool {j} ({snippet(tool)}) is not a JSON schema {{\"type\": \"function\", "
                            "\"function\": {\"name\": ..., \"parameters\": {\"type\": \"object\", \"properties\": "
                            "{...}}}} (transformers.utils.get_json_schema(function) writes one)")
        tools.append(tool)
    return tools or None


def _without_none(value: Any) -> Any:
    """``value`` with the None values of its mappings dropped, at every depth."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def maybe_conversation(value: Any, where: str) -> Optional[List[Dict[str, Any]]]:
    """A prompt or completion value as TRL reads it: a conversation (a list of messages, or its JSON text), or
    None for plain text."""
    if isinstance(value, str):
        text = value.lstrip()
        if not text.startswith("["):
            return None
        try:
            parsed = json.loads(text)
        except ValueError:
            return None
        if not (isinstance(parsed, list) and parsed and isinstance(parsed[0], dict) and "role" in parsed[0]):
            return None
        value = parsed
    return conversation(value, where) if isinstance(value, (list, tuple)) else None


def render(tokenizer, messages: Sequence[Dict], where: str, add_generation_prompt: bool = False,
           tools: Optional[List[Dict]] = None) -> str:
    """The conversation (with its ``tools``' schemas) as the tokenizer's chat template writes it; a template error
    names the row."""
    if not tokenizer.chat_template:
        raise UserError(f"{where}: the tokenizer has no chat template to render the conversation; set {KEY} to a "
                        f"built-in one ({', '.join(BUILTIN)}) or to a jinja file")
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools or None)
    except RENDER_ERRORS as e:
        raise _cannot_render(where, e, messages, tools) from None


def _cannot_render(where: str, error: Exception, messages: Sequence[Dict], tools) -> UserError:
    hint = TOOLS_HINT if tools or any(m.get("tool_calls") for m in messages) else (
        f"set {KEY} to a template that takes its roles")
    return UserError(f"{where}: the chat template cannot render this conversation: {str(error).splitlines()[0]} "
                     f"({hint})")


def check_tool_support(tokenizer, messages: Sequence[Dict], tools: Optional[List[Dict]], where: str,
                       key: str = KEY) -> None:
    """Refuse a template that renders a conversation's ``tools``, or its assistant messages' tool calls, as if
    they were not there, or cannot render the calls (SmolLM2's and the plain chatml template do not take
    either): the model would be trained on answers to tools it was never shown, or on calls not in its tokens.
    ``key``: where the template is chosen (the recipe's ``data.chat_template``, the chat's ``--chat-template``)."""
    has_calls = any(m.get("tool_calls") for m in messages)
    bare = [{k: v for k, v in m.items() if k != "tool_calls"} | {"content": m.get("content") or ""}
            if m.get("tool_calls") else m for m in messages]
    if tools and render(tokenizer, bare, where, tools=tools) == render(tokenizer, bare, where):
        raise UserError(f"{key}: the chat template ignores the tools of {where}: it renders the conversation the "
                        f"same without them; {tools_hint(key)}")
    if has_calls:
        try:
            rendered = tokenizer.apply_chat_template(list(messages), tokenize=False, tools=tools or None)
        except RENDER_ERRORS as e:
            raise UserError(f"{key}: the chat template cannot render the tool calls of {where}: "
                            f"{str(e).splitlines()[0]}; {tools_hint(key)}") from None
        if rendered == render(tokenizer, bare, where, tools=tools):
            raise UserError(f"{key}: the chat template ignores the tool calls of {where}: it renders the "
                            f"conversation the same without them; {tools_hint(key)}")


def check_tools_shown(tokenizer, schemas: List[Dict], where: str, key: str = KEY) -> None:
    """``check_tool_support`` on a probe where a model would call tools: a question, then a call of the first of
    ``schemas`` (the tools ``where`` names)."""
    call = {"type": "function", "function": {"name": schemas[0]["function"]["name"], "arguments": {}}}
    check_tool_support(tokenizer, [{"role": "user", "content": "?"},
                                   {"role": "assistant", "content": "", "tool_calls": [call]}], schemas, where, key)


def encode(tokenizer, text: str, add_special_tokens: bool = False) -> Tuple[List[int], List[Tuple[int, int]]]:
    """(token ids, character offsets): the tokenization ``apply_chat_template`` makes of a rendered text."""
    try:
        out = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True, verbose=False)
    except NotImplementedError:
        raise UserError("model.tokenizer: conversations need a fast tokenizer (character offsets); use one with a "
                        "tokenizer.json") from None
    return out["input_ids"], out["offset_mapping"]


def assistant_spans(tokenizer, messages: Sequence[Dict], text: str, ids: Sequence[int],
                    offsets: Sequence[Tuple[int, int]], where: str,
                    tools: Optional[List[Dict]] = None) -> List[Tuple[int, int]]:
    """Character spans of ``text`` (the rendered conversation, tokenized as ``ids``/``offsets``) that each
    assistant message generates: from after its header to the end of its turn (its tool calls included), found by
    rendering the conversation prefix by prefix. Where the prefix through the message ends with text the full
    rendering does not have there (an EOS after a final turn), the turn ends at the last token both tokenizations
    share."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], where, add_generation_prompt=True, tools=tools) if i else (
            _opening(tokenizer, text, where, tools))
        through = render(tokenizer, messages[:i + 1], where, tools=tools)
        if not text.startswith(before):
            raise _not_prefix_preserving(where, i)
        if text.startswith(through):
            end = len(through)
        else:
            shared = common_prefix_length(list(zip(*encode(tokenizer, through))), list(zip(ids, offsets)))
            end = offsets[shared - 1][1] if shared else 0
        if end <= len(before):
            raise _not_prefix_preserving(where, i)
        spans.append((len(before), end))
    return spans


def _opening(tokenizer, text: str, where: str, tools: Optional[List[Dict]]) -> str:
    """What comes before a conversation's first message when that is the assistant's: the template's rendering of
    no message with the generation prompt (chatml-tools: the system turn listing the tools, then the header) where
    the conversation starts with it, else nothing."""
    if not tools:
        return ""
    try:
        opening = render(tokenizer, [], where, add_generation_prompt=True, tools=tools)
    except UserError:  # a template that reads messages[0]
        return ""
    return opening if text.startswith(opening) else ""


def _not_prefix_preserving(where: str, i: int) -> UserError:
    return UserError(f"{where}: the chat template renders message {i} (assistant) differently once later messages "
                     "follow (it is not prefix-preserving, e.g. it drops reasoning from earlier turns), so its "
                     f"tokens cannot be found; set {KEY} to a prefix-preserving template (such as TRL's "
                     "*_training.jinja for the model)")


def conversation_tokens(tokenizer, messages: Sequence[Dict], where: str,
                        tools: Optional[List[Dict]] = None) -> Tuple[List[int], List[int]]:
    """(token ids of the rendered conversation with its ``tools``, assistant mask: 1 on the tokens its assistant
    messages generate, tool calls included, 0 on headers and on system (its tool list), user and tool messages)."""
    if has_generation_markers(tokenizer.chat_template):  # the template marks them itself: TRL's own path
        try:
            out = tokenizer.apply_chat_template(list(messages), return_dict=True, return_assistant_tokens_mask=True,
                                                tools=tools or None)
        except RENDER_ERRORS as e:
            raise _cannot_render(where, e, messages, tools) from None
        return list(out["input_ids"]), list(out["assistant_masks"])
    text = render(tokenizer, messages, where, tools=tools)
    ids, offsets = encode(tokenizer, text)
    return ids, span_mask(offsets, assistant_spans(tokenizer, messages, text, ids, offsets, where, tools))


def has_generation_markers(template: Optional[str]) -> bool:
    """Whether a template marks what assistant messages generate (``{% generation %}``, as TRL's training ones)."""
    return bool(template) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def span_mask(offsets: Sequence[Tuple[int, int]], spans: Sequence[Tuple[int, int]]) -> List[int]:
    """1 on every token overlapping a span (transformers' rule for ``{% generation %}`` spans)."""
    mask = [0] * len(offsets)
    for start, end in spans:
        for t, (a, b) in enumerate(offsets):
            if b > start and a < end and b > a:
                mask[t] = 1
    return mask


def prompt_completion_tokens(tokenizer, prompt: Any, completion: Any, where: str,
                             tools: Optional[List[Dict]] = None) -> Tuple[List[int], List[int]]:
    """(token ids of prompt + completion, completion mask), as TRL's ``completion_only_loss`` makes them: plain
    text gets EOS after the completion (unless it ends with one) and no template; conversations are rendered
    (with their ``tools``), the prompt with the generation prompt. The completion is what follows the common token
    prefix."""
    prompt_chat = maybe_conversation(prompt, f"{where} prompt")
    completion_chat = maybe_conversation(completion, f"{where} completion")
    if (prompt_chat is None) != (completion_chat is None):
        raise UserError(f"{where}: the prompt and the completion must both be text or both conversations")
    if prompt_chat is None:
        prompt, completion = "" if prompt is None else str(prompt), "" if completion is None else str(completion)
        if not completion.strip():
            raise UserError(f"{where}: the completion is empty; every row needs one (remove the row)")
        eos = tokenizer.eos_token or ""
        if not completion.endswith(eos):
            completion += eos
        head = tokenizer(prompt, verbose=False)["input_ids"]
        ids = tokenizer(prompt + completion, verbose=False)["input_ids"]
    else:
        if not any((m.get("content") or "").strip() or m.get("tool_calls") for m in completion_chat):
            raise UserError(f"{where}: the completion is empty; every row needs one (remove the row)")
        check_tool_support(tokenizer, prompt_chat + completion_chat, tools, where)
        head = encode(tokenizer, render(tokenizer, prompt_chat, where, add_generation_prompt=True, tools=tools))[0]
        ids = encode(tokenizer, render(tokenizer, prompt_chat + completion_chat, where, tools=tools))[0]
    n = common_prefix_length(head, ids)
    return ids, [0] * n + [1] * (len(ids) - n)


class ToolCall(NamedTuple):
    """A well-formed call in generated text."""

    name: str
    arguments: Dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A ``<tool_call>`` in generated text that is not one: what it holds, and why (an RL reward may count it)."""

    text: str
    reason: str


CALL = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(" + re.escape(TOOL_CALL_END) + r"|\Z)", re.S)


def parse_tool_calls(text: str) -> List[Union[ToolCall, MalformedCall]]:
    """The calls in generated ``text``, in order: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    as a ``ToolCall`` (arguments a JSON object, or its JSON text; absent: none), anything else between the tags
    (not JSON, not such an object, no closing tag) as a ``MalformedCall``."""
    calls: List[Union[ToolCall, MalformedCall]] = []
    for match in CALL.finditer(text):
        body = match.group(1)
        if not match.group(2):
            calls.append(MalformedCall(body, f"no {TOOL_CALL_END} after it"))
            continue
        try:
            value = json.loads(body)
        except ValueError as e:
            calls.append(MalformedCall(body, f"not JSON ({e})"))
            continue
        arguments = value.get("arguments", {}) if isinstance(value, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            calls.append(MalformedCall(body, 'not a {"name": ..., "arguments": {...}} object'))
        elif not isinstance(arguments, dict):
            calls.append(MalformedCall(body, "its arguments are not a JSON object"))
        else:
            calls.append(ToolCall(value["name"], arguments))
    return calls


def tool_call_end_id(tokenizer) -> Optional[int]:
    """The id of ``</tool_call>`` where it is one token (chatml-tools adds it): an RL loop stops sampling at it,
    and at the end of the turn (``end_of_turn_ids``); None where the tokenizer splits it."""
    ids = tokenizer(TOOL_CALL_END, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def tool_turn_ids(tokenizer, results: Sequence[Dict], where: str = "the tool results") -> List[int]:
    """The token ids an RL loop appends after a sampled ``</tool_call>`` before sampling again: the rest of the
    assistant turn (chatml-tools: ``<|im_end|>\\n``), a tool turn for each of ``results`` (tool messages ``{"role":
    "tool", "name", "content"}``), and the next assistant header. Found from the template itself, as TRL's
    GRPO finds its tool suffix: a conversation ending in a call, rendered without and with the results. The ids
    are those the whole conversation's rendering has there (chatml-tools' tokens start and end at special
    tokens and a header's newline; tests/test_sft_tools.py checks it on GPT-2's and SmolLM2's tokenizers)."""
    results = conversation(list(results), where)
    if any(m["role"] != "tool" for m in results):
        raise UserError(f"{where}: {snippet(results)}: every message must have the role tool")
    call = {"type": "function", "function": {"name": results[0].get("name") or "tool", "arguments": {}}}
    head = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    through = render(tokenizer, head, where)
    end = through.rfind(TOOL_CALL_END)
    if end < 0:
        raise UserError(f"{KEY}: the chat template does not write tool calls as {TOOL_CALL_START}...{TOOL_CALL_END}; "
                        f"{TOOLS_HINT}")
    full = render(tokenizer, head + results, where, add_generation_prompt=True)
    if not full.startswith(through):
        raise _not_prefix_preserving(where, 1)
    return encode(tokenizer, through[end + len(TOOL_CALL_END):] + full[len(through):])[0]


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def snippet(value: Any, limit: int = 80) -> str:
    """A value as JSON, cut to ``limit`` characters: a row named in a message."""
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."

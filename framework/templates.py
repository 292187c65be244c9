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
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from jinja2 import TemplateError

from framework.errors import UserError

ROLES = ("system", "user", "assistant", "tool")

# The ChatML layout (OpenAI's, used by Qwen and many others), without a default system prompt.
CHATML = ("{%- for message in messages %}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
          "{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@dataclass(frozen=True)
class Builtin:
    template: str
    special_tokens: Tuple[str, ...]  # added to a tokenizer that lacks them
    end_of_turn: str  # generation stops there


BUILTIN = {"chatml": Builtin(CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>")}
KEY = "data.chat_template"


def use_template(tokenizer, name: Optional[str], needed: bool = True, key: str = KEY) -> List[str]:
    """Give ``tokenizer`` the chat template ``name`` (a built-in name or a jinja file; None: keep its own) and,
    for a built-in one, its special tokens. Returns the tokens added (the model's embeddings must grow for
    them: ``resize_embeddings``). ``needed``: a template is required (conversations are to be rendered); ``key``:
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
    """Grow the model's token embeddings (and tied output layer) to the tokenizer's vocabulary, if smaller."""
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))


def conversation(value: Any, where: str) -> List[Dict[str, Any]]:
    """``value`` checked as a conversation: a list (or its JSON text, as a csv holds it) of ``{role, content}``
    mappings with known roles. Keys whose value is None (absent in that row of a typed column) are dropped."""
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
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise UserError(f"{where}: message {i} ({snippet(message)}) is not a {{role, content}} mapping")
        if message["role"] not in ROLES:
            raise UserError(f"{where}: message {i} has the unknown role {message['role']!r}; roles are "
                            f"{', '.join(ROLES)}")
        content = message["content"]
        if content is not None and not isinstance(content, str):
            raise UserError(f"{where}: message {i} has content {snippet(content)}; content must be text")
        messages.append({k: v for k, v in message.items() if v is not None or k == "content"})
    return messages


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


def render(tokenizer, messages: Sequence[Dict], where: str, add_generation_prompt: bool = False) -> str:
    """The conversation as the tokenizer's chat template writes it; a template error names the row."""
    if not tokenizer.chat_template:
        raise UserError(f"{where}: the tokenizer has no chat template to render the conversation; set {KEY} to a "
                        f"built-in one ({', '.join(BUILTIN)}) or to a jinja file")
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    except (TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
        raise UserError(f"{where}: the chat template cannot render this conversation: {str(e).splitlines()[0]} "
                        f"(set {KEY} to a template that takes its roles)") from None


def encode(tokenizer, text: str, add_special_tokens: bool = False) -> Tuple[List[int], List[Tuple[int, int]]]:
    """(token ids, character offsets): the tokenization ``apply_chat_template`` makes of a rendered text."""
    try:
        out = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True, verbose=False)
    except NotImplementedError:
        raise UserError("model.tokenizer: conversations need a fast tokenizer (character offsets); use one with a "
                        "tokenizer.json") from None
    return out["input_ids"], out["offset_mapping"]


def assistant_spans(tokenizer, messages: Sequence[Dict], text: str, ids: Sequence[int],
                    offsets: Sequence[Tuple[int, int]], where: str) -> List[Tuple[int, int]]:
    """Character spans of ``text`` (the rendered conversation, tokenized as ``ids``/``offsets``) that each
    assistant message generates: from after its header to the end of its turn, found by rendering the
    conversation prefix by prefix. Where the prefix through the message ends with text the full rendering does
    not have there (an EOS after a final turn), the turn ends at the last token both tokenizations share."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], where, add_generation_prompt=True) if i else ""
        through = render(tokenizer, messages[:i + 1], where)
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


def _not_prefix_preserving(where: str, i: int) -> UserError:
    return UserError(f"{where}: the chat template renders message {i} (assistant) differently once later messages "
                     "follow (it is not prefix-preserving, e.g. it drops reasoning from earlier turns), so its "
                     f"tokens cannot be found; set {KEY} to a prefix-preserving template (such as TRL's "
                     "*_training.jinja for the model)")


def conversation_tokens(tokenizer, messages: Sequence[Dict], where: str) -> Tuple[List[int], List[int]]:
    """(token ids of the rendered conversation, assistant mask: 1 on the tokens its assistant messages
    generate, 0 on headers and on system, user and tool messages)."""
    if has_generation_markers(tokenizer.chat_template):  # the template marks them itself: TRL's own path
        try:
            out = tokenizer.apply_chat_template(list(messages), return_dict=True, return_assistant_tokens_mask=True)
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise UserError(f"{where}: the chat template cannot render this conversation: "
                            f"{str(e).splitlines()[0]} (set {KEY} to a template that takes its roles)") from None
        return list(out["input_ids"]), list(out["assistant_masks"])
    text = render(tokenizer, messages, where)
    ids, offsets = encode(tokenizer, text)
    return ids, span_mask(offsets, assistant_spans(tokenizer, messages, text, ids, offsets, where))


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


def prompt_completion_tokens(tokenizer, prompt: Any, completion: Any, where: str) -> Tuple[List[int], List[int]]:
    """(token ids of prompt + completion, completion mask), as TRL's ``completion_only_loss`` makes them: plain
    text gets EOS after the completion (unless it ends with one) and no template; conversations are rendered,
    the prompt with the generation prompt. The completion is what follows the common token prefix."""
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
        head = encode(tokenizer, render(tokenizer, prompt_chat, where, add_generation_prompt=True))[0]
        ids = encode(tokenizer, render(tokenizer, prompt_chat + completion_chat, where))[0]
    n = common_prefix_length(head, ids)
    return ids, [0] * n + [1] * (len(ids) - n)


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

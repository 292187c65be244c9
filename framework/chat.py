"""Chat with a trained model in the terminal, or answer a file of prompts::

    python -m framework.chat PATH [--system TEXT] [--chat-template chatml|FILE.jinja] [--max-new-tokens N]
                                  [--temperature T] [--top-p P] [--top-k K] [--seed S] [--device auto|cpu|cuda]
                                  [--tools FILE.py:FUNCTION ...] [--max-tool-calls N] [--tool-timeout SECONDS]
    python -m framework.chat PATH --prompts FILE > replies.jsonl

PATH: a run's ``model/`` (or its ``output_dir``), a checkpoint folder (``checkpoints/step_N``: its weights with the
run's tokenizer), or a ``.gguf`` file (framework/saved.py loads each). Conversations are rendered with the model's
chat template, or ``--chat-template`` (a built-in name or a jinja file, as ``data.chat_template`` takes them).
Replies are greedy unless a sampling flag (``--temperature`` above 0, ``--top-p``, ``--top-k``) asks for sampling;
they stop at the model's end of turn (its generation config's EOS, and a built-in template's end-of-turn token) or
after ``--max-new-tokens``.

Interactively each reply is printed token by token as it is generated (transformers' ``TextStreamer``) and the
conversation goes on; ``/reset`` starts it again (from the ``--system`` prompt), ``/exit`` or end of input (Ctrl-D)
ends with status 0. With ``--prompts FILE`` each non-empty line is a prompt on its own: plain text (one user
message, after the ``--system`` prompt) or a JSON conversation (a list of {role, content}; one ending with an
assistant message is continued, as ``pipeline("text-generation")`` does); one JSON line per reply goes to stdout,
``{"prompt": ..., "reply": ...}``, the reply as the pipeline's greedy output is.

Bad input (a path that does not exist or holds no model, a model that is not a causal LM, a GGUF file transformers
cannot read, a checkpoint only the training setup reads, a prompt file that is missing or holds a bad conversation)
exits 2 with one ``error:`` line naming it.

With ``--tools path/to/file.py:function`` (or ``package.module:function``; several after one ``--tools``) the
functions' JSON schemas go to the chat template with each turn (a template that shows tools: ``--chat-template
chatml-tools``, the format the tools SFT and GRPO train), and the calls the model writes
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, also in an assistant message a conversation ends
with) are run between its turns, as the GRPO tools loop runs them (framework/tasks/online_rl/tools.py: a malformed
call, an unknown tool, arguments it does not take, a tool that raises or runs past ``--tool-timeout`` seconds give
the model ``{'error': ...}``), their results given back in tool turns, up to ``--max-tool-calls`` rounds; then the
model answers. Interactively each call and result is printed as ``[tool NAME(ARGUMENTS) -> RESULT]``; with
``--prompts`` the reply's line also holds ``"turns"``, the messages the model's turn added (its calls, their
results, its answer).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, TextIO

import torch
from jinja2 import TemplateError
from transformers import TextStreamer
from transformers.utils import logging as transformers_logging

from framework import saved, templates
from framework.errors import UserError
from framework.tasks.online_rl.multi_turn import assistant_message
from framework.tasks.online_rl.tools import Toolbox

RESET, EXIT = "/reset", "/exit"
TEMPLATE_OPTION = "--chat-template"


@dataclass(frozen=True)
class Sampling:
    """How replies are generated: greedy unless ``temperature`` (> 0), ``top_p`` or ``top_k`` is given."""

    max_new_tokens: int = 256
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return (self.temperature is None or self.temperature == 0) and self.top_p is None and self.top_k is None

    def config(self, model, stop: List[int], pad_id: Optional[int]):
        """The model's own generation config with this sampling, the stop tokens and padding set (a copy)."""
        config = copy.deepcopy(model.generation_config)
        config.max_new_tokens, config.eos_token_id = self.max_new_tokens, stop or None
        config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else pad_id
        if self.greedy:  # the model's sampling defaults would only be warned about
            config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
        else:
            config.do_sample = True
            config.temperature = self.temperature if self.temperature is not None else 1.0
            config.top_p = self.top_p if self.top_p is not None else 1.0
            config.top_k = self.top_k if self.top_k is not None else 0
        return config


class Chat:
    """A model, its tokenizer and template, and how it replies."""

    def __init__(self, model, tokenizer, sampling: Sampling, system: Optional[str] = None,
                 template: Optional[str] = None, toolbox: Optional[Toolbox] = None, max_tool_calls: int = 4):
        templates.use_template(tokenizer, template, needed=True, key=TEMPLATE_OPTION)
        templates.resize_embeddings(model, tokenizer)  # a built-in template's tokens the tokenizer lacked
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.toolbox, self.max_tool_calls = toolbox, max_tool_calls
        self.schemas = toolbox.schemas if toolbox else None
        stop = list(_ids(model.generation_config.eos_token_id))
        stop += [i for i in templates.end_of_turn_ids(tokenizer, template) if i not in stop] if template else []
        if not stop and tokenizer.eos_token_id is not None:
            stop = [tokenizer.eos_token_id]
        if toolbox:
            templates.check_tools_shown(tokenizer, self.schemas, "--tools", key=TEMPLATE_OPTION)
            end = templates.tool_call_end_id(tokenizer)  # a call ends the turn: its result comes next
            stop += [end] if end is not None and end not in stop else []
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.generation = sampling.config(model, stop, pad)

    def start(self) -> List[Dict]:
        """A new conversation: the system prompt, if any."""
        return [{"role": "system", "content": self.system}] if self.system else []

    def inputs(self, messages: List[Dict]) -> Dict[str, torch.Tensor]:
        """The conversation rendered as the template renders it for generation, with the tools' schemas (as the
        pipeline does: a conversation ending with an assistant message is continued)."""
        prefill = messages[-1]["role"] == "assistant"
        try:
            inputs = self.tokenizer.apply_chat_template(messages, add_generation_prompt=not prefill,
                                                        continue_final_message=prefill, tools=self.schemas,
                                                        return_dict=True, return_tensors="pt")
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as e:  # the template's, on this one
            raise UserError(f"{TEMPLATE_OPTION}: the chat template cannot render this conversation: "
                            f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
        device = next(self.model.parameters()).device
        return {key: value.to(device) for key, value in inputs.items()}

    def reply(self, messages: List[Dict], stream: Optional[TextIO] = None) -> str:
        """The model's reply to the conversation (special tokens left out, as the pipeline decodes it); with
        ``stream``, printed there token by token as it is generated."""
        inputs = self.inputs(messages)
        streamer = _Streamer(self.tokenizer, stream) if stream is not None else None
        with torch.no_grad():
            out = self.model.generate(**inputs, generation_config=self.generation, streamer=streamer)
        return self.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    def turn(self, messages: List[Dict], stream: Optional[TextIO] = None) -> List[Dict]:
        """The messages the model's turn adds to ``messages``: its reply, or with tools each round of calls (an
        assistant message with its ``tool_calls``, then a tool message per call) before its answer, the last
        message. A conversation ending with an assistant message is continued: its calls count as the model's.
        ``stream`` also shows each call and its result."""
        head, added = list(messages), []
        prefill = head.pop()["content"] if head[-1]["role"] == "assistant" else None
        for rounds in range(self.max_tool_calls + 1):
            conversation = head + added + ([{"role": "assistant", "content": prefill}] if prefill is not None else [])
            text = (prefill or "") + self.reply(conversation, stream)
            calls = templates.parse_tool_calls(text) if self.toolbox and rounds < self.max_tool_calls else []
            if not calls:
                return added + [{"role": "assistant", "content": text}]
            added.append(assistant_message(text, calls))
            for call in calls:
                name, result, _ = self.toolbox.run(call, self.toolbox.functions)
                added.append({"role": "tool", "name": name, "content": result})
                if stream is not None:
                    arguments = json.dumps(call.arguments) if isinstance(call, templates.ToolCall) else call.text
                    stream.write(f"[tool {name}({arguments}) -> {result}]\n")
            prefill = None
        raise AssertionError("unreachable: the last round runs no call")


class _Streamer(TextStreamer):
    """transformers' TextStreamer (text printed as soon as it is whole words), onto ``stream``."""

    def __init__(self, tokenizer, stream: TextIO):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.stream = stream

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.stream.write(text + ("\n" if stream_end else ""))
        self.stream.flush()


def _ids(value) -> List[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def interact(chat: Chat, stdin: TextIO, stdout: TextIO) -> int:
    """The interactive loop: a line from ``stdin`` is the next user message; its reply streams to ``stdout``."""
    messages = chat.start()
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line:  # end of input
            stdout.write("\n")
            return 0
        text = line.strip()
        if text == EXIT:
            return 0
        if text == RESET:
            messages = chat.start()
            stdout.write("(the conversation starts again)\n")
            continue
        if not text:
            continue
        if text.startswith("/") and " " not in text:
            stdout.write(f"unknown command {text}: {RESET} starts the conversation again, {EXIT} ends\n")
            continue
        messages.append({"role": "user", "content": text})
        messages += chat.turn(messages, stream=stdout)


def read_prompts(path: Path, system: Optional[str]) -> List[tuple]:
    """(what the line holds: its text or its conversation, the conversation to reply to) for each non-empty line."""
    if not path.is_file():
        raise UserError(f"--prompts: {path} is not a file (relative paths start at {Path.cwd()})")
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--prompts: cannot read {path}: {e}") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        conversation = templates.maybe_conversation(line, f"--prompts: {path}:{number}")
        if conversation is None:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": line}]
            prompts.append((line, messages))
        else:
            has_system = conversation[0]["role"] == "system"
            head = [{"role": "system", "content": system}] if system and not has_system else []
            prompts.append((conversation, head + conversation))
    if not prompts:
        raise UserError(f"--prompts: {path} holds no prompt (every line is empty)")
    return prompts


def answer(chat: Chat, prompts: List[tuple], stdout: TextIO) -> None:
    """One JSON line per prompt: ``{"prompt": ..., "reply": ...}``, and ``"turns"`` (the messages the model's
    turn added) where it called tools. A continued assistant message's reply is what the model added to it."""
    for prompt, messages in prompts:
        turns = chat.turn(messages)
        reply = turns[-1]["content"]
        if len(turns) == 1 and messages[-1]["role"] == "assistant":
            reply = reply[len(messages[-1]["content"]):]
        line = {"prompt": prompt, "reply": reply, **({"turns": turns} if len(turns) > 1 else {})}
        stdout.write(json.dumps(line, ensure_ascii=False) + "\n")
        stdout.flush()


# ---------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints its usage and exits 2; one line here, as the other commands
        raise UserError(f"{message}; usage: {' '.join(self.format_usage().split()).removeprefix('usage: ')}")


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m framework.chat", description="Chat with a trained model, or answer prompts.")
    parser.add_argument("path", type=Path, metavar="PATH",
                        help="a run's model/ (or output_dir), a checkpoint folder (checkpoints/step_N), or a .gguf file")
    parser.add_argument("--system", help="the system prompt every conversation starts with")
    parser.add_argument(TEMPLATE_OPTION, dest="chat_template", metavar="NAME_OR_FILE",
                        help=f"the chat template: a built-in one ({', '.join(templates.BUILTIN)}) or a jinja file; "
                             "default the model's own")
    parser.add_argument("--prompts", type=Path, metavar="FILE",
                        help="answer each line (a prompt, or a JSON conversation) and print one JSON line per reply")
    parser.add_argument("--max-new-tokens", type=_positive(int), default=256, help="the longest reply, in tokens")
    parser.add_argument("--temperature", type=_at_least_zero(float),
                        help="sample at this temperature (0: greedy, the default)")
    parser.add_argument("--top-p", type=_probability, help="sample from the most likely tokens of this total "
                                                           "probability")
    parser.add_argument("--top-k", type=_positive(int), help="sample from the k most likely tokens")
    parser.add_argument("--seed", type=int, help="seeds the sampling (default: a different draw each time)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the model runs (auto: a GPU when there is one)")
    parser.add_argument("--tools", nargs="+", default=[], metavar="FILE:FUNCTION",
                        help="functions the model may call (path/to/file.py:name or package.module:name, each with "
                             "type hints and a Google-style docstring); with --chat-template chatml-tools")
    parser.add_argument("--max-tool-calls", type=_positive(int), default=4,
                        help="rounds of tool calls in one turn before the model must answer (4)")
    parser.add_argument("--tool-timeout", type=_positive(float), default=10.0,
                        help="seconds a tool call may run (10)")
    return parser.parse_args(argv)


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not above 0")
        return value
    parse.__name__ = kind.__name__
    return parse


def _at_least_zero(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text} is below 0")
        return value
    parse.__name__ = kind.__name__
    return parse


def _probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def main(argv: Optional[List[str]] = None) -> int:
    """Returns the exit status: 0 done, 2 bad input (one ``error:`` line), 130 interrupted."""
    transformers_logging.disable_progress_bar()  # loading a model's weights: no bar above the chat or the one error
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        prompts = read_prompts(args.prompts, args.system) if args.prompts is not None else None
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: no GPU is visible to torch here; use --device cpu")
        if args.seed is not None:
            torch.manual_seed(args.seed)
        toolbox = Toolbox(argparse.Namespace(tools=args.tools, environment=None, tool_timeout=args.tool_timeout),
                          "chat", tools_key="--tools") if args.tools else None
        model, tokenizer, what = saved.load_causal_lm(args.path)
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k)
        chat = Chat(model.to(device), tokenizer, sampling, args.system, args.chat_template, toolbox,
                    args.max_tool_calls)
        if prompts is not None:
            answer(chat, prompts, sys.stdout)
            return 0
        print(f"chat: {args.path} ({what}; {'greedy' if sampling.greedy else 'sampling'} replies of at most "
              f"{sampling.max_new_tokens} tokens). {RESET} starts the conversation again, {EXIT} or Ctrl-D ends.",
              file=sys.stderr, flush=True)
        return interact(chat, sys.stdin, sys.stdout)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())

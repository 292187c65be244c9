"""Multi-turn rollouts with tools: the model samples until a complete tool call (``</tool_call>``, one id under
chatml-tools: ``templates.tool_call_end_id``) or the end of its turn; the calls it wrote are parsed
(``templates.parse_tool_calls``) and run (framework/tasks/online_rl/tools.py: a malformed call, an unknown tool, a
tool that raises or times out give an ``{'error': ...}`` result and count as failures); the tool turn's tokens
(``templates.tool_turn_ids``: the rest of the assistant turn, a tool turn per result, the next assistant header) are
appended; sampling goes on, up to ``max_tool_calls`` tool turns (TRL's ``max_tool_calling_iterations``).

Token in, token out: a rollout's completion is the sampled tokens and the inserted tokens, concatenated; nothing
sampled is decoded and encoded again (decoding is only to read the calls). ``sampled`` marks each completion token:
1 sampled, 0 inserted, which the loss leaves out (TRL's ``tool_mask``). ``max_completion_length`` counts both: each
turn samples at most what is left, and a tool turn that would leave no room for one more sampled token is not
appended (the rollout ends at its call, as TRL drops a result that overflows).

Sampling stays keyed by example: turn t of the rollout seeded s draws from the generator seeded ``s`` (turn 0) or
``row_seed(s, t)``; a row's turns depend on its own tokens and tools only, so the process count and the batch do
not change what a rollout draws."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from framework import templates
from framework.errors import UserError
from framework.tasks.online_rl import sampling
from framework.tasks.online_rl.tools import Toolbox


@dataclass
class Rollouts:
    """A batch's rollouts: per row its prompt's ids (an environment's observation included), its completion
    (sampled and inserted tokens), which of them were sampled, its calls and failed calls, and its completion as
    messages (assistant turns, with their ``tool_calls``, and tool results), as TRL gives reward functions."""

    prompts: List[List[int]]
    completions: List[List[int]]
    sampled: List[List[int]]
    calls: List[int] = field(default_factory=list)
    failures: List[int] = field(default_factory=list)
    messages: Optional[List[List[Dict[str, Any]]]] = None


class ToolLoop:
    """The rollout loop of a run with tools (module docstring)."""

    def __init__(self, toolbox: Toolbox, tokenizer, base: sampling.Sampling, max_tool_calls: int, longest: int):
        self.toolbox, self.tokenizer, self.max_tool_calls, self.longest = toolbox, tokenizer, max_tool_calls, longest
        end = templates.tool_call_end_id(tokenizer)
        if end is None:
            raise UserError(f"{templates.KEY}: the tokenizer splits {templates.TOOL_CALL_END} into several tokens, so "
                            f"sampling cannot stop at the end of a call; {templates.TOOLS_HINT}")
        templates.tool_turn_ids(tokenizer, [{"role": "tool", "name": "probe", "content": "0"}])  # a template's errors
        self.call_end = end
        self.sampling = dataclasses.replace(base, stop_ids=(*base.stop_ids, end))
        self.budget = base.max_new_tokens

    def groups(self, active: List[int], left: Dict[int, int], prompts: List[List[int]],
               completions: List[List[int]]) -> List[List[int]]:
        """The rows sampled together in a turn: a batch samples as many tokens as its row with the most budget left,
        and no row may pass the longest sequence the model was checked for (its prompt's longest and the
        completion budget), so a row joins the first group whose first row's budget still fits it."""
        groups: List[List[int]] = []
        for i in sorted(active, key=lambda i: -left[i]):
            fits = next((g for g in groups if len(prompts[i]) + len(completions[i]) + left[g[0]] <= self.longest),
                        None)
            if fits is None:
                groups.append([i])
            else:
                fits.append(i)
        return groups

    def generate(self, model: torch.nn.Module, prompts: List[List[int]], seeds: Sequence[int],
                 environments: Sequence[Optional[Any]], greedy: bool = False) -> Rollouts:
        n = len(prompts)
        out = Rollouts(prompts, [[] for _ in range(n)], [[] for _ in range(n)], [0] * n, [0] * n,
                       [[] for _ in range(n)])
        tools = [self.toolbox.tools_of(e) for e in environments]
        active, turn = list(range(n)), 0
        while active:
            left = {i: self.budget - len(out.completions[i]) for i in active}
            new = {}
            for group in self.groups(active, left, prompts, out.completions):
                turn_seeds = [] if greedy else [seeds[i] if turn == 0 else sampling.row_seed(seeds[i], turn)
                                                for i in group]
                settings = dataclasses.replace(self.sampling, max_new_tokens=left[group[0]])
                drawn = sampling.generate(model, [prompts[i] + out.completions[i] for i in group], turn_seeds,
                                          settings, greedy=greedy)
                new.update(zip(group, drawn))
            still = []
            for i in active:
                segment = new[i][:left[i]]  # a row's draws do not depend on the others': cutting it keeps them
                out.completions[i] += segment
                out.sampled[i] += [1] * len(segment)
                text = self.tokenizer.decode(segment, skip_special_tokens=True)
                calls = templates.parse_tool_calls(text)
                ends_in_call = bool(segment) and segment[-1] == self.call_end
                if ends_in_call and not calls:
                    calls = [templates.MalformedCall(text, f"no {templates.TOOL_CALL_START} before its "
                                                           f"{templates.TOOL_CALL_END}")]
                out.messages[i].append(assistant_message(text, calls))
                if not ends_in_call or turn >= self.max_tool_calls:
                    continue
                results = []
                for call in calls:
                    name, content, failed = self.toolbox.run(call, tools[i])
                    out.calls[i] += 1
                    out.failures[i] += failed
                    results.append({"role": "tool", "name": name, "content": content})
                inserted = templates.tool_turn_ids(self.tokenizer, results)
                if len(out.completions[i]) + len(inserted) >= self.budget:
                    continue  # no room to answer after the results: the rollout ends at its call
                out.completions[i] += inserted
                out.sampled[i] += [0] * len(inserted)
                out.messages[i] += results
                still.append(i)
            active, turn = still, turn + 1
        return out


def assistant_message(text: str, calls: List) -> Dict[str, Any]:
    """A sampled segment as an assistant message: its text before the first call, and its well-formed calls."""
    start = text.find(templates.TOOL_CALL_START)
    message: Dict[str, Any] = {"role": "assistant", "content": text if start < 0 else text[:start].strip()}
    made = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls if isinstance(c, templates.ToolCall)]
    if made:
        message["tool_calls"] = made
    return message


def with_observation(prompt: List[Dict[str, Any]], observation: str) -> List[Dict[str, Any]]:
    """A conversation with an environment's observation appended to its last message's content, as TRL appends it
    (the input row is left as it is)."""
    return prompt[:-1] + [{**prompt[-1], "content": str(prompt[-1].get("content") or "") + observation}]

def tool_frequencies(calls, failures) -> Dict[str, float]:
    """TRL's tool figures from each rollout's calls and failed calls: calls per rollout, failures per call."""
    total = float(np.sum(calls))
    return {"tools/call_frequency": total / max(len(calls), 1),
            "tools/failure_frequency": float(np.sum(failures)) / total if total else 0.0}

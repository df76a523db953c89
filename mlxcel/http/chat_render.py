"""Chat output in OpenAI's exact shapes: message bodies and streamed deltas.

Reasoning goes to `reasoning_content` (mirrored as `reasoning`, the OpenRouter spelling);
tool calls are `{id, type: "function", function: {name, arguments}}`. Streamed, a call's id,
type and name come only in the first delta of its `index`, then `arguments` fragments follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from mlxcel.actors.toolcalls import ToolCallArgs, ToolCallStart, collect
from mlxcel.http import logprobs
from mlxcel.runtime.slot import SlotUpdate, TokenLogprob


@attrs.define
class Collected:
    """A whole answer, merged from every slot update."""

    text: list[str] = attrs.field(factory=list)
    reasoning: list[str] = attrs.field(factory=list)
    tool_events: list[Any] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    finish_reason: str = "stop"

    def add(self, update: SlotUpdate) -> None:
        self.text.append(update.text)
        self.reasoning.append(update.reasoning)
        self.tool_events.extend(update.tool_events)
        self.logprobs.extend(update.logprobs)
        if update.finish_reason is not None:
            self.finish_reason = update.finish_reason


def message(c: Collected, alias: bool = True) -> dict[str, Any]:
    _, calls = collect(c.tool_events)
    text = "".join(c.text)
    msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    reasoning = "".join(c.reasoning)
    if reasoning:
        msg["reasoning_content"] = reasoning
        if alias:  # --reasoning-alias-field reasoning (the default)
            msg["reasoning"] = reasoning
    if calls:
        msg["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in calls
        ]
    return msg


def stream_choices(
    update: SlotUpdate, tok: Any, wants_logprobs: bool, alias: bool = True
) -> list[dict[str, Any]]:
    """The delta choices for one slot update: reasoning, then content, then tool calls."""
    out: list[dict[str, Any]] = []

    def choice(delta: dict[str, Any], lps: Sequence[TokenLogprob] = ()) -> None:
        scores = logprobs.chat(tok, lps) if wants_logprobs and lps else None
        out.append(
            {"index": update.index, "delta": delta, "logprobs": scores, "finish_reason": None}
        )

    if update.reasoning:
        delta = {"reasoning_content": update.reasoning}
        if alias:
            delta["reasoning"] = update.reasoning
        choice(delta)
    if update.text or (update.logprobs and not update.tool_events):
        choice({"content": update.text}, update.logprobs)
    for event in update.tool_events:
        if isinstance(event, ToolCallStart):
            call = {
                "index": event.index,
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            choice({"tool_calls": [call]})
        elif isinstance(event, ToolCallArgs):
            choice(
                {"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]}
            )
    return out

"""Anthropic Messages output: content blocks, stop reasons, usage, and the streamed event
state machine.

A streamed answer is a sequence of content blocks (thinking, text, tool_use), each announced by
``content_block_start``, filled by ``content_block_delta`` events and ended by
``content_block_stop``. At most one block is open at a time and indices increase by one per
block: strict clients (Claude Code) reject anything else. ``BlockStream`` is that state machine,
pure and synchronous; the route feeds it slot updates and writes what it returns.
"""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime
from typing import Any

import jiter

from mlxcel.actors.toolcalls import ToolCallArgs, ToolCallEnd, ToolCallStart, collect
from mlxcel.http.anthropic_wire import Thinking
from mlxcel.http.chat_render import Collected
from mlxcel.runtime.slot import OutputSlot, SlotUpdate

Event = tuple[str, dict[str, Any]]


def tool_use_id(call_id: str) -> str:
    """Anthropic's `toolu_` id for a parsed call (the parser's own id minus its prefix)."""
    return "toolu_" + call_id.removeprefix("call_")


def signature(thinking: str) -> str:
    """An opaque signature for a thinking block. Clients keep thinking across turns only when
    it is signed; this one is a digest of the text, since nothing here verifies it."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def stop_reason(
    finish: str,
    stop_word: str | None,
    completion_tokens: int,
    requested: int | None,
    *,
    interrupted: bool = False,
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finish reason."""
    if finish == "tool_calls":
        return "tool_use", None
    if stop_word is not None:
        return "stop_sequence", stop_word
    if finish == "length":
        # max_tokens was clamped to the context left after the prompt, and that ran out (a
        # generation cut by the shutdown drain is a plain max_tokens: the answer is truncated).
        if not interrupted and requested is not None and completion_tokens < requested:
            return "model_context_window_exceeded", None
        return "max_tokens", None
    return "end_turn", None


def usage(slot: OutputSlot) -> dict[str, int]:
    """Anthropic counts cached prompt tokens apart: input + cache_read is the whole prompt."""
    cached = slot.cached_tokens
    return {
        "input_tokens": slot.prompt_tokens - cached,
        "output_tokens": slot.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def model_page(models: list[tuple[str, int | None]], created: int) -> dict[str, Any]:
    """`GET /v1/models` in Anthropic's page shape, for clients that send `anthropic-version`
    (the OpenAI list has a `capabilities` list where Anthropic's SDK wants an object).
    ``models``: (id, context length, None when not known: a router model not loaded)."""
    when = datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    data = []
    for model_id, context_length in models:
        entry: dict[str, Any] = {
            "type": "model",
            "id": model_id,
            "display_name": model_id,
            "created_at": when,
            "lifecycle": "active",
        }
        if context_length is not None:
            entry["max_input_tokens"] = context_length
        data.append(entry)
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"data": data, "has_more": False, "first_id": first, "last_id": last}


def content(c: Collected, thinking: Thinking) -> list[dict[str, Any]]:
    """The non-streamed `content`: thinking, then text, then one tool_use per call."""
    blocks: list[dict[str, Any]] = []
    reasoning = "".join(c.reasoning)
    if reasoning:
        shown = "" if thinking.omitted else reasoning
        blocks.append({"type": "thinking", "thinking": shown, "signature": signature(reasoning)})
    text = "".join(c.text)
    if text:
        blocks.append({"type": "text", "text": text})
    _, calls = collect(c.tool_events)
    for call in calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name,
                "input": tool_input(call.arguments),
            }
        )
    return blocks


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's ``input``. A call that max_tokens cut has arguments that end mid-JSON: they read
    as far as they go, as the anthropic SDK reads a streamed ``input_json_delta`` (jiter's
    partial mode), so a streamed and a non-streamed answer show the same input."""
    try:
        value = json.loads(arguments)
    except ValueError:
        try:
            value = jiter.from_json(arguments.encode(), partial_mode=True)
        except ValueError:
            value = {}
    return value if isinstance(value, dict) else {}


class BlockStream:
    """Slot updates in, Anthropic stream events out, one block open at a time."""

    def __init__(self, thinking: Thinking) -> None:
        self._omit = thinking.omitted
        self._index = -1
        self._open: str | None = None
        self._thinking: list[str] = []

    def feed(self, update: SlotUpdate) -> list[Event]:
        # A merged update loses the order between its parts. A call still open from the last
        # update ends before anything else; otherwise thinking comes before the answer and
        # calls after their lead-in text, which is the order models write them in.
        out: list[Event] = []
        tools_first = self._open == "tool_use"
        if tools_first:
            self._tools(out, update.tool_events)
        if update.reasoning:
            self._ensure(out, "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking.append(update.reasoning)
            if not self._omit:
                self._delta(out, {"type": "thinking_delta", "thinking": update.reasoning})
        if update.text:
            self._ensure(out, "text", {"type": "text", "text": ""})
            self._delta(out, {"type": "text_delta", "text": update.text})
        if not tools_first:
            self._tools(out, update.tool_events)
        return out

    def _tools(self, out: list[Event], events: tuple[object, ...]) -> None:
        for event in events:
            if isinstance(event, ToolCallStart):
                self.close(out)
                block = {"type": "tool_use", "id": tool_use_id(event.id), "name": event.name}
                self._start(out, "tool_use", {**block, "input": {}})
            elif isinstance(event, ToolCallArgs) and self._open == "tool_use" and event.fragment:
                self._delta(out, {"type": "input_json_delta", "partial_json": event.fragment})
            elif isinstance(event, ToolCallEnd):
                self.close(out)

    def close(self, out: list[Event]) -> list[Event]:
        """Close the open block, if any (a thinking block gets its signature first)."""
        if self._open == "thinking":
            sig = signature("".join(self._thinking))
            self._delta(out, {"type": "signature_delta", "signature": sig})
            self._thinking.clear()
        if self._open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
            self._open = None
        return out

    def _ensure(self, out: list[Event], kind: str, block: dict[str, Any]) -> None:
        if self._open != kind:
            self.close(out)
            self._start(out, kind, block)

    def _start(self, out: list[Event], kind: str, block: dict[str, Any]) -> None:
        self._index += 1
        self._open = kind
        out.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": self._index, "content_block": block},
            )
        )

    def _delta(self, out: list[Event], delta: dict[str, Any]) -> None:
        out.append(
            (
                "content_block_delta",
                {"type": "content_block_delta", "index": self._index, "delta": delta},
            )
        )

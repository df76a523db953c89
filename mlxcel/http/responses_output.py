"""Responses output: items built from slot updates, the typed stream events, the final object.

``OutputBuilder`` is a plain state machine fed with ``SlotUpdate``s. Each feed returns the
stream events it implies (without ``sequence_number``; the writer numbers them). At most one
item is open at a time: reasoning text opens a reasoning item, answer text a message item,
each parsed tool call a function_call item; whatever is open closes when another kind starts
or the response ends. The non-streaming route feeds the same builder and ignores the events,
so both modes produce the same items.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from mlxcel.actors.toolcalls import ToolCallArgs, ToolCallEnd, ToolCallStart
from mlxcel.http import logprobs
from mlxcel.http.responses_wire import new_id
from mlxcel.runtime.slot import SlotUpdate, TokenLogprob

Event = dict[str, Any]


class OutputBuilder:
    def __init__(self, tok: Any, wants_logprobs: bool, max_tool_calls: int | None) -> None:
        self._tok = tok
        self._wants_logprobs = wants_logprobs
        self._max_calls = max_tool_calls
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text: list[str] = []
        self._lps: list[dict[str, Any]] = []
        self._pending: list[TokenLogprob] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self.reasoning_text: list[str] = []

    # --- feeding -----------------------------------------------------------------------------

    def feed(self, update: SlotUpdate) -> list[Event]:
        events: list[Event] = []
        # Tokens of an update that is only reasoning are not part of the answer's logprobs.
        if self._wants_logprobs and (update.text or not update.reasoning):
            self._pending.extend(update.logprobs)
        if update.reasoning:
            self.reasoning_text.append(update.reasoning)
            events += self._append("reasoning", update.reasoning)
        if update.text:
            events += self._append("message", update.text)
        for event in update.tool_events:
            events += self._tool(event)
        return events

    def finish(self, incomplete: bool = False) -> list[Event]:
        """Close what is open; an item cut off by the token limit is `incomplete`."""
        return self._close("incomplete" if incomplete else "completed")

    def live_items(self) -> list[dict[str, Any]]:
        """The items as they stand, the open one with its text so far: what a poll of a
        running response shows (a function call's arguments grow in place already)."""
        items = [_copy(item) for item in self.items]
        if self._open is not None and self._open["type"] != "function_call":
            text = "".join(self._text)
            part: dict[str, Any] = (
                {"type": "reasoning_text", "text": text}
                if self._open["type"] == "reasoning"
                else {"type": "output_text", "text": text, "annotations": []}
            )
            items[self.items.index(self._open)]["content"] = [part]
        return items

    @property
    def has_calls(self) -> bool:
        return any(item["type"] == "function_call" for item in self.items)

    # --- items -------------------------------------------------------------------------------

    def _append(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._start(kind)
        item = self._open
        assert item is not None
        self._text.append(text)
        index = len(self.items) - 1
        if kind == "reasoning":
            events.append(
                {
                    "type": "response.reasoning_text.delta",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "delta": text,
                }
            )
        else:
            lps = self._take_logprobs()
            self._lps += lps
            events.append(
                {
                    "type": "response.output_text.delta",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "delta": text,
                    "logprobs": lps,
                }
            )
        return events

    def _take_logprobs(self) -> list[dict[str, Any]]:
        if not self._pending:
            return []
        entries = logprobs.chat_content(self._tok, self._pending)
        self._pending = []
        return entries

    def _start(self, kind: str) -> list[Event]:
        item: dict[str, Any]
        if kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "id": new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self._open = item
        self._text, self._lps = [], []
        index = len(self.items) - 1
        return [
            {"type": "response.output_item.added", "output_index": index, "item": _copy(item)},
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": part,
            },
        ]

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        text = "".join(self._text)
        if item["type"] == "function_call":
            item["status"] = status
            return [
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                },
                {"type": "response.output_item.done", "output_index": index, "item": _copy(item)},
            ]
        events: list[Event]
        if item["type"] == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            events = [
                {
                    "type": "response.reasoning_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": text,
                }
            ]
        else:
            self._lps += self._take_logprobs()
            part = {"type": "output_text", "text": text, "annotations": []}
            if self._wants_logprobs:
                part["logprobs"] = self._lps
            item["content"] = [part]
            item["status"] = status
            events = [
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": text,
                    "logprobs": self._lps,
                }
            ]
        events += [
            {
                "type": "response.content_part.done",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": _copy(part),
            },
            {"type": "response.output_item.done", "output_index": index, "item": _copy(item)},
        ]
        return events

    def _tool(self, event: object) -> list[Event]:
        if isinstance(event, ToolCallStart):
            if self._max_calls is not None and event.index >= self._max_calls:
                return []
            events = self._close("completed")
            item: dict[str, Any] = {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": event.id,
                "name": event.name,
                "arguments": "",
                "status": "in_progress",
            }
            self.items.append(item)
            self._open = item
            self._calls[event.index] = item
            added = {"type": "response.output_item.added", "output_index": len(self.items) - 1}
            return [*events, {**added, "item": _copy(item)}]
        if isinstance(event, ToolCallArgs) and (call := self._calls.get(event.index)) is not None:
            call["arguments"] += event.fragment
            return [
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": call["id"],
                    "output_index": self.items.index(call),
                    "delta": event.fragment,
                }
            ]
        if isinstance(event, ToolCallEnd) and self._calls.get(event.index) is self._open:
            return self._close("completed")
        return []


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(obj)


def usage(
    prompt_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int
) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_object(
    base: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    *,
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
) -> dict[str, Any]:
    """The full response: the echoed request fields in ``base``, plus state and output."""
    finished = status in ("completed", "incomplete", "failed", "cancelled")
    # The SDKs compute `output_text` themselves; curl users and thin clients read it here.
    text = "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    return {
        **base,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "output": _copy({"o": output})["o"],
        "output_text": text,
        "usage": usage if finished else None,
    }

"""The generic tool-call format, for chat templates that have none of their own (llama-server's
``generic`` format).

The tools are described in a system message and the answer is one JSON object, constrained by
llguidance (see ``mlxcel.actors.grammars.generic_tool_grammar``)::

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    {"tool_calls": [{"name": ..., "arguments": {...}}, ...]}     (parallel calls allowed)
    {"response": "text for the user"}                           (tool_choice auto only)

Earlier turns are rendered as text the model can read whatever its template knows: an
assistant's calls become the JSON it would have written, and tool results become a user turn
of ``{"tool_response": {"tool": name, "tool_call_id": id, "content": ...}}`` lines.

The parser streams a ``response`` string as it is decoded and emits calls once the object is
whole; anything that is not this shape is content, as with the other formats.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mlxcel.actors.toolcalls._stream import WS, Balancer, call_from_json, cut_call, loads
from mlxcel.actors.toolcalls.events import (
    Event,
    IdFactory,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)

INSTRUCTION = (
    "Respond in JSON format, either with `{calls}` (a request to call tools) or with "
    "`response` (a reply to the user's request)."
)
REQUIRED_INSTRUCTION = "Respond in JSON format with `{calls}` (a request to call tools)."


def _described(tool: Mapping[str, Any]) -> dict[str, Any]:
    nested = tool.get("function")
    fn: Mapping[str, Any] = nested if isinstance(nested, Mapping) else tool
    out: dict[str, Any] = {"name": fn.get("name")}
    if fn.get("description"):
        out["description"] = fn["description"]
    params = fn.get("parameters", fn.get("input_schema"))
    out["parameters"] = params if params else {"type": "object", "properties": {}}
    return out


def system_prompt(tools: Sequence[Mapping[str, Any]], *, parallel: bool, required: bool) -> str:
    """The tool description block: one JSON line per tool, an example and the instruction."""
    calls = "tool_calls" if parallel else "tool_call"
    example_call = {"name": "<tool name>", "arguments": {"<argument>": "<value>"}}
    example: dict[str, Any] = {calls: [example_call] if parallel else example_call}
    lines = [
        "You can call the following tools (name, description, JSON schema of the arguments):",
        *(json.dumps(_described(t), ensure_ascii=False) for t in tools),
        "",
        "A tool call looks like: " + json.dumps(example),
    ]
    if not required:
        lines.append('A reply looks like: {"response": "<your reply>"}')
    lines.append((REQUIRED_INSTRUCTION if required else INSTRUCTION).format(calls=calls))
    return "\n".join(lines)


def _call_text(calls: list[Any], parallel: bool) -> str:
    out = []
    for call in calls:
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            raise ValueError("a tool call must be an object with a `function` object")
        out.append({"name": fn.get("name"), "arguments": fn.get("arguments", {})})
    single = len(out) == 1 and not parallel
    body: dict[str, Any] = {"tool_call": out[0]} if single else {"tool_calls": out}
    return json.dumps(body, ensure_ascii=False)


def render_messages(
    messages: Sequence[Mapping[str, Any]], system: str | None, *, parallel: bool = False
) -> list[dict[str, Any]]:
    """Messages any chat template renders: tool calls and results as text (calls in the shape
    this turn asks for), and ``system`` (the tool description) appended to the first system
    message or put first. ValueError for a malformed tool call."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for msg in messages:
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            calls = msg["tool_calls"]
            if not isinstance(calls, list):
                raise ValueError("tool_calls must be a list")
            for call in calls:
                if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
                    names[str(call.get("id"))] = str(call["function"].get("name"))
            text = str(msg.get("content") or "")
            content = (text + "\n" if text.strip() else "") + _call_text(calls, parallel)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            call_id = str(msg.get("tool_call_id", ""))
            result = {
                "tool": msg.get("name") or names.get(call_id, ""),
                "tool_call_id": call_id,
                "content": msg.get("content", ""),
            }
            line = json.dumps({"tool_response": result}, ensure_ascii=False)
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line, "tool_results": True})
        else:
            out.append(dict(msg))
    for m in out:
        m.pop("tool_results", None)
    if system:
        if out and out[0].get("role") == "system":
            first = str(out[0].get("content") or "")
            out[0] = {**out[0], "content": f"{first}\n\n{system}" if first else system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


# The grammar writes compact JSON; whitespace is allowed here so unconstrained output
# (--skip-chat-parsing aside, a client's own grammar) is read the same way.
_HEAD = re.compile(r'\s*\{\s*"(response|tool_calls|tool_call)"\s*:\s*')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class GenericParser:
    """Incremental parser for the generic format; ``feed`` and ``finish`` never raise."""

    def __init__(self, new_id: IdFactory) -> None:
        self._new_id = new_id
        self._buf = ""
        self._mode = ""  # "" undecided, "text", "response", "value", "calls", "done"
        self._pos = 0  # response: next undecoded character; calls: the balancer's job
        self._bal: Balancer | None = None

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self, cut: bool = False) -> list[Event]:
        if cut and self._mode in ("", "calls") and self._buf.lstrip().startswith("{"):
            # The budget ended the object: the calls so far, not the wrapper as text.
            out = self._cut() if self._mode == "calls" else []
            self._buf, self._mode = "", "done"
            return out
        out = self._run(final=True)
        match self._mode:
            case "" | "calls" | "value":
                # Cut off or not this shape after all: the text is the answer.
                if self._buf:
                    out.append(TextDelta(self._buf))
            case "response":
                out += self._text(self._buf[self._pos :])
        self._buf, self._mode = "", "done"
        return out

    def _run(self, final: bool) -> list[Event]:
        if self._mode == "":
            m = _HEAD.match(self._buf)
            if m is None:
                if not final and _may_become_head(self._buf):
                    return []
                self._mode = "text"
            elif m.group(1) == "response" and m.end() < len(self._buf):
                if self._buf[m.end()] == '"':
                    self._mode, self._pos = "response", m.end() + 1
                else:
                    self._mode = "value"
            elif m.group(1) != "response":
                self._mode = "calls"
            if m is not None:
                self._bal = Balancer(self._buf.index("{"))
        match self._mode:
            case "text":
                out, self._buf = self._text(self._buf), ""
                return out
            case "response":
                return self._response()
            case "calls" | "value":
                return self._whole()
        return []

    def _text(self, s: str) -> list[Event]:
        return [TextDelta(s)] if s else []

    def _response(self) -> list[Event]:
        """Decode the response string as far as it has come; the rest of the object is dropped."""
        buf, i = self._buf, self._pos
        parts: list[str] = []
        while i < len(buf):
            c = buf[i]
            if c == '"':
                self._mode, self._buf = "done", ""
                return self._text("".join(parts))
            if c != "\\":
                j = i
                while j < len(buf) and buf[j] not in '"\\':
                    j += 1
                parts.append(buf[i:j])
                i = j
                continue
            if i + 1 >= len(buf):
                break
            esc = buf[i + 1]
            if esc in _ESCAPES:
                parts.append(_ESCAPES[esc])
                i += 2
                continue
            if esc != "u":
                parts.append(esc)
                i += 2
                continue
            # A \uXXXX escape is decoded once its four digits have arrived; a high surrogate
            # waits for its low half, so the pair decodes as one character.
            end = i + 6
            if end > len(buf):
                break
            if _is_high_surrogate(buf[i + 2 : end]):
                if end + 6 > len(buf):
                    break
                end += 6
            try:
                parts.append(json.loads('"' + buf[i:end] + '"'))
            except ValueError:
                parts.append(buf[i:end])
            i = end
        self._pos = i
        return self._text("".join(parts))

    def _whole(self) -> list[Event]:
        """Calls (or a non-string response) once the object is complete."""
        assert self._bal is not None
        end = self._bal.advance(self._buf)
        if end is None:
            return []
        if end < 0:
            self._mode = "text"
            return self._run(final=False)
        try:
            obj = loads(self._buf[:end])
        except (ValueError, RecursionError):
            obj = None
        events = self._decode(obj)
        if events is None:
            self._mode = "text"
            return self._run(final=False)
        self._buf, self._mode = "", "done"
        return events

    def _cut(self) -> list[Event]:
        """Whole calls of a cut object, then the call being written (see StreamParser.finish)."""
        m = _HEAD.match(self._buf)
        assert m is not None
        buf, pos = self._buf, m.end()
        listed = m.group(1) == "tool_calls"
        if listed:
            if not buf.startswith("[", pos):
                return []
            pos += 1
        events: list[Event] = []
        index = 0
        while True:
            while pos < len(buf) and buf[pos] in WS + ",":
                pos += 1
            if not buf.startswith("{", pos):
                return events
            end = Balancer(pos).advance(buf)
            if end is None:
                part = cut_call(buf[pos:])
                if part is not None:
                    events += [ToolCallStart(index, self._new_id(), part[0])]
                    events += [ToolCallArgs(index, part[1])] if part[1] else []
                return events
            try:
                call = call_from_json(loads(buf[pos:end])) if end > 0 else None
            except (ValueError, RecursionError):
                call = None
            if call is None:
                return events
            events += [ToolCallStart(index, self._new_id(), call[0])]
            events += [ToolCallArgs(index, call[1]), ToolCallEnd(index)]
            index, pos = index + 1, end
            if not listed:
                return events

    def _decode(self, obj: object) -> list[Event] | None:
        if not isinstance(obj, dict):
            return None
        if self._mode == "value":
            return self._text(json.dumps(obj.get("response"), ensure_ascii=False))
        value = obj.get("tool_calls", obj.get("tool_call"))
        items = value if isinstance(value, list) else [value]
        events: list[Event] = []
        for index, item in enumerate(items):
            call = call_from_json(item)
            if call is None:
                return None
            events += [ToolCallStart(index, self._new_id(), call[0])]
            events += [ToolCallArgs(index, call[1]), ToolCallEnd(index)]
        return events or None


def _may_become_head(buf: str) -> bool:
    """Could more text turn ``buf`` into the start of a generic object?"""
    s = buf.lstrip()
    if not s:
        return True
    if not s.startswith("{"):
        return False
    rest = s[1:].lstrip()
    if not rest:
        return True
    return any(f'"{key}"'.startswith(rest[: len(key) + 2]) for key in _KEYS) and len(rest) < 32


_KEYS = ("response", "tool_calls", "tool_call")


def _is_high_surrogate(hex4: str) -> bool:
    try:
        return 0xD800 <= int(hex4, 16) <= 0xDBFF
    except ValueError:
        return False

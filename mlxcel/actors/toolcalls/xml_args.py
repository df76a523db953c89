"""Formats whose arguments are tagged raw values, not a JSON object: Qwen3-Coder's
``<function=NAME><parameter=KEY>`` and GLM-4.5's ``<arg_key>/<arg_value>``.

The model writes a string argument as bare text (a file's content is written as is, with no JSON
escaping), so a value's JSON type comes from the tool's ``parameters`` schema, as vLLM's
``qwen3_coder`` and ``glm45`` parsers decide it: the parser is built with the request's tools.

Regions are scanned structurally, tag by tag, keeping the position between deltas, so a long
value is searched once; a value ends at the first closing tag (neither format escapes one
inside a value, so the first is the only reading the model's own template allows).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mlxcel.actors.toolcalls._stream import (
    WS,
    Bail,
    Done,
    More,
    Scan,
    StreamParser,
    dumps_args,
    loads,
)
from mlxcel.actors.toolcalls.events import IdFactory
from mlxcel.actors.toolcalls.formats import python_literal

# A tool's name -> its ``parameters`` schema.
Schemas = Mapping[str, Mapping[str, Any]]


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Name -> parameters schema, from OpenAI's ``{"function": {...}}`` nesting or flat tools."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters", fn.get("input_schema"))
            out[fn["name"]] = params if isinstance(params, Mapping) else {}
    return out


def param_type(schemas: Schemas, tool: str, key: str) -> str | None:
    """The declared JSON type of one parameter, lower-cased; None when the schema says none.

    A type list (``["integer", "null"]``) counts as its first non-null member.
    """
    props = schemas.get(tool, {}).get("properties")
    spec = props.get(key) if isinstance(props, Mapping) else None
    kind = spec.get("type") if isinstance(spec, Mapping) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind.strip().lower() if isinstance(kind, str) else None


_NOT_FOUND = object()


def _structured(text: str) -> object:
    """JSON, else a Python literal, else _NOT_FOUND. Models sometimes write Python literals
    (``{'a': 1}``, ``True``) where JSON was meant; they are read, never evaluated."""
    try:
        return loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        return python_literal(text)
    except ValueError:
        return _NOT_FOUND


_TEXT_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def qwen3_coder_text(kind: str | None) -> bool:
    """Whether a parameter of this declared type is kept as text."""
    return kind is None or kind in _TEXT_TYPES


def qwen3_coder_value(raw: str, kind: str | None) -> object:
    """A ``<parameter>`` value by its schema type, as vLLM's qwen3_coder parser converts it:
    ``null`` is None; string-like and untyped values stay text; integers and numbers are parsed
    (text when they do not parse); booleans from true/false; anything else JSON, else a Python
    literal, else text."""
    if raw.lower() == "null":
        return None
    if qwen3_coder_text(kind):
        return raw
    assert kind is not None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(raw.strip())
        except ValueError:
            return raw
    if kind.startswith(("num", "float")):
        try:
            number = float(raw.strip())
        except ValueError:
            return raw
        if not math.isfinite(number):  # inf/nan have no JSON spelling
            return raw
        return int(number) if number.is_integer() else number  # vLLM: 3.0 is sent as 3
    if kind in ("boolean", "bool", "binary"):
        # vLLM turns anything but "true" into false; other text is kept, so a client sees
        # what the model actually wrote instead of a silent false.
        word = raw.strip().lower()
        return True if word == "true" else False if word == "false" else raw
    value = _structured(raw)
    return raw if value is _NOT_FOUND else value


def glm45_value(raw: str, kind: str | None) -> object:
    """An ``<arg_value>`` as vLLM's glm45 parser reads it: a parameter the schema types as a
    string is the stripped text; any other (or unknown) parameter is JSON, else a Python
    literal, else the text."""
    text = raw.strip()
    if kind == "string":
        return text
    value = _structured(text)
    return text if value is _NOT_FOUND else value


def expect(buf: str, i: int, literal: str) -> int | None:
    """Index past ``literal`` at ``i``; None while ``buf[i:]`` is still a proper prefix of it
    (the delta that completes it has not arrived); -1 when it is not there."""
    if buf.startswith(literal, i):
        return i + len(literal)
    return None if literal.startswith(buf[i:]) else -1


def _skip(buf: str, i: int) -> int:
    while i < len(buf) and buf[i] in WS:
        i += 1
    return i


class _Tagged(StreamParser):
    """Shared scanning for a value that runs to a closing tag."""

    def __init__(self, new_id: IdFactory, schemas: Schemas | None = None) -> None:
        super().__init__(new_id)
        self._schemas: Schemas = schemas or {}
        self._search = 0  # where the search for the current value's closing tag resumes

    def _find_close(self, buf: str, close: str) -> int | None:
        """Where ``close`` starts, searching only text not searched before; None: not yet."""
        end = buf.find(close, self._search)
        if end < 0:
            self._search = max(self._search, len(buf) - len(close) + 1)
            return None
        return end


_QWEN_FUNCTION = re.compile(r"<function=([^>\n<]+)>")
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n<]+)>")
_TAG_NAME = re.compile(r"[^>\n<]{0,200}")


def _tag_possible(rest: str, opener: str) -> bool:
    """Could ``rest`` still grow into ``<opener>name>``?"""
    if opener.startswith(rest):
        return True
    return rest.startswith(opener) and _TAG_NAME.fullmatch(rest[len(opener) :]) is not None


class Qwen3CoderParser(_Tagged):
    """``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
    </function>\\n</tool_call>`` (Qwen3-Coder); one block per call, several functions in one
    block accepted too. A value loses the one newline the template puts on each side of it."""

    markers = ("<tool_call>",)
    CLOSE = "</tool_call>"

    def _begin(self, marker: str) -> None:
        self._pos = len(marker)
        self._calls: list[tuple[str, str]] = []
        self._name: str | None = None
        self._args: dict[str, object] = {}
        self._key: str | None = None  # the parameter whose value is being read
        self._vstart = self._search = 0

    def _scan(self, buf: str, final: bool) -> Scan:
        more: Scan = Bail(len(buf)) if final else More()
        while True:
            if self._key is not None:
                end = self._find_close(buf, "</parameter>")
                if end is None:
                    return more
                raw = buf[self._vstart : end]
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
                assert self._name is not None
                kind = param_type(self._schemas, self._name, self._key)
                self._args[self._key] = qwen3_coder_value(raw, kind)
                self._key, self._pos = None, end + len("</parameter>")
                continue
            j = _skip(buf, self._pos)
            rest = buf[j:]
            if self._name is None:
                m = _QWEN_FUNCTION.match(buf, j)
                if m is not None:
                    self._name, self._args, self._pos = m.group(1).strip(), {}, m.end()
                    continue
                if self._calls and rest.startswith(self.CLOSE):
                    return Done(j + len(self.CLOSE), self._calls)
                if self._calls and self.CLOSE.startswith(rest):
                    # Stopped inside (or before) the close tag: the calls are whole.
                    return Done(len(buf), self._calls) if final else More()
                if not final and _tag_possible(rest, "<function="):
                    return More()
                return Bail(j if self._calls else len(self.markers[0]))
            m = _QWEN_PARAMETER.match(buf, j)
            if m is not None:
                self._key, self._vstart = m.group(1).strip(), m.end()
                self._search = self._vstart
                continue
            close = expect(buf, j, "</function>")
            if close is not None and close >= 0:
                args = dumps_args(self._args)
                if args is None:
                    return Bail(close)
                self._calls.append((self._name, args))
                self._name, self._pos = None, close
                continue
            if not final and (close is None or _tag_possible(rest, "<parameter=")):
                return More()
            return Bail(j)


_GLM_NAME = re.compile(r"[^\s<>]{1,200}")


class Glm45Parser(_Tagged):
    """``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>``
    (GLM-4.5/4.6; GLM-4.7 drops the newlines, which is read the same)."""

    markers = ("<tool_call>",)
    CLOSE = "</tool_call>"
    TAGS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    def _begin(self, marker: str) -> None:
        self._pos = len(marker)
        self._name: str | None = None
        self._args: dict[str, object] = {}
        self._key: str | None = None
        self._in_value = False
        self._vstart = self._search = 0

    def _scan(self, buf: str, final: bool) -> Scan:
        more: Scan = Bail(len(buf)) if final else More()
        while True:
            if self._name is None:
                j = _skip(buf, self._pos)
                m = _GLM_NAME.match(buf, j)
                if m is None:
                    # "<tool_call>{...}" (Hermes JSON) or prose: not this format.
                    return more if j == len(buf) else Bail(len(self.markers[0]))
                if m.end() == len(buf):
                    return more  # the name may go on in the next delta
                self._name, self._pos = m.group(), m.end()
                continue
            if self._key is not None and not self._in_value:
                end = self._find_close(buf, "</arg_key>")
                if end is None:
                    return more
                self._key = buf[self._vstart : end].strip()
                j = _skip(buf, end + len("</arg_key>"))
                opened = expect(buf, j, "<arg_value>")
                if opened is None:
                    return more
                if opened < 0:
                    return Bail(j)
                self._in_value, self._vstart = True, opened
                self._search = opened
                continue
            if self._key is not None:
                end = self._find_close(buf, "</arg_value>")
                if end is None:
                    return more
                kind = param_type(self._schemas, self._name, self._key)
                self._args[self._key] = glm45_value(buf[self._vstart : end], kind)
                self._key, self._in_value = None, False
                self._pos = end + len("</arg_value>")
                continue
            j = _skip(buf, self._pos)
            key = expect(buf, j, "<arg_key>")
            if key is not None and key >= 0:
                self._key, self._vstart = "", key
                self._search = key
                continue
            close = expect(buf, j, self.CLOSE)
            if close is not None and close >= 0:
                args = dumps_args(self._args)
                return Bail(close) if args is None else Done(close, [(self._name, args)])
            if close is None or key is None:
                if final and close is None and (buf[j:] or self._args):
                    # Stopped before or inside the close tag: every argument is whole.
                    args = dumps_args(self._args)
                    return Bail(len(buf)) if args is None else Done(len(buf), [(self._name, args)])
                return more
            return Bail(j)

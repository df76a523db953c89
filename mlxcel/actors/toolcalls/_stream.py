"""The incremental machinery every tool-call format shares.

Output alternates between content and tool-call *regions*. In content, text streams out at once
except a tail that might still be the start of a marker. A region is buffered until its format
decides it: a complete, valid call (emitted as Start, one Args fragment, End) or not a call after
all (its text goes back to content). Calls are emitted whole rather than argument by argument so
that nothing ever has to be retracted: a truncated or malformed call can still become content,
and streaming gives exactly what the non-streaming path gives. Long calls are covered by the SSE
keepalive while they buffer.

Whitespace and separators between or around calls are dropped, so a turn that is only calls has
no content at all (``content: null``), as OpenAI clients expect.
"""

from __future__ import annotations

import abc
import json
import re
from typing import cast

import attrs

from mlxcel.actors.toolcalls.events import (
    Event,
    IdFactory,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)

WS = " \t\r\n"


@attrs.frozen
class More:
    """The region cannot be decided yet."""


@attrs.frozen
class Done:
    """The first ``end`` characters of the region are these calls: (name, arguments JSON)."""

    end: int
    calls: list[tuple[str, str]]


@attrs.frozen
class Bail:
    """The first ``end`` characters (at least one) are content after all."""

    end: int


Scan = More | Done | Bail


@attrs.frozen
class Cut:
    """The token budget ended a region: ``calls`` were whole before the cut, then ``partial``
    is the call being written, (name, arguments text so far), if its name was whole."""

    calls: list[tuple[str, str]]
    partial: tuple[str, str] | None


_CLOSERS = {"{": "}", "[": "]", "(": ")"}


class Balancer:
    """Finds where a bracketed value ends, incrementally, skipping quoted strings.

    Keeps its position between calls so a long region is scanned once, not once per delta.
    """

    def __init__(self, start: int, quotes: str = '"', brackets: str = "{[") -> None:
        self.pos = start
        self._stack: list[str] = []
        self._quote = ""
        self._interesting = re.compile(
            "[" + re.escape(quotes + brackets + "".join(_CLOSERS[b] for b in brackets)) + r"\\]"
        )
        self._in_string = re.compile(r"[\\" + re.escape(quotes) + "]")

    def advance(self, buf: str) -> int | None:
        """Index just past the value, None while incomplete, -1 on a mismatched bracket."""
        i = self.pos
        while True:
            if self._quote:
                m = self._in_string.search(buf, i)
                if m is None:
                    self.pos = len(buf)
                    return None
                i = m.end()
                if m.group() == "\\":
                    if i >= len(buf):  # the escaped character has not arrived yet
                        self.pos = i - 1
                        return None
                    i += 1
                elif m.group() == self._quote:
                    self._quote = ""
                continue
            m = self._interesting.search(buf, i)
            if m is None:
                self.pos = len(buf)
                return None
            c, i = m.group(), m.end()
            if c in _CLOSERS:
                self._stack.append(_CLOSERS[c])
            elif c in "}])":
                if not self._stack or self._stack.pop() != c:
                    self.pos = i
                    return -1
                if not self._stack:
                    self.pos = i
                    return i
            elif c != "\\":
                self._quote = c


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> object:
    """json.loads that refuses NaN/Infinity: we could not send them back as valid JSON."""
    return json.loads(text, parse_constant=_no_constants)


def dumps_args(args: object) -> str | None:
    """Serialise an arguments object, None when it is not a JSON object."""
    if not isinstance(args, dict):
        return None
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def call_from_json(obj: object) -> tuple[str, str] | None:
    """(name, arguments JSON) from one decoded call object, None if it is not one.

    Accepts the spellings models actually use: ``arguments`` or ``parameters``, arguments
    encoded as a JSON string, and OpenAI's own ``{"type": "function", "function": {...}}``.
    """
    if not isinstance(obj, dict):
        return None
    obj = cast("dict[str, object]", obj)
    fn = obj.get("function")
    if isinstance(fn, dict):
        obj = fn
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    dumped = dumps_args(args)
    return None if dumped is None else (name, dumped)


# A JSON call object as the grammars write it: the name first, then the arguments.
_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def cut_call(text: str) -> tuple[str, str] | None:
    """(name, arguments so far) of a JSON call object cut off inside its arguments; None when
    the cut came before the name was whole (there is no call to show then)."""
    m = _CALL_HEAD.match(text)
    if m is None:
        return None
    try:
        name = json.loads('"' + m.group(1) + '"')
    except ValueError:
        return None
    return name, text[m.end() :]


def held_prefix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


class StreamParser(abc.ABC):
    """Base of every format's parser. ``feed`` and ``finish`` never raise on model output."""

    # Strings that open a region anywhere in content.
    markers: tuple[str, ...] = ()
    # Characters that open a region with no marker, but only before any content or between
    # calls (Llama's bare JSON, pythonic lists): elsewhere they are ordinary prose.
    bare_starts: str = ""
    # Dropped between calls (beyond whitespace), e.g. Llama's "; " between JSON calls.
    separators: str = WS

    def __init__(self, new_id: IdFactory) -> None:
        self._new_id = new_id
        self._buf = ""
        self._in_region = False
        self._pending = ""  # droppable tail of content, not yet emitted
        self._emitted = False  # any content emitted yet
        self._between_calls = False  # only separators since the last call
        self._index = 0
        self._finished = False
        self._cut = False  # finishing because the token budget ran out
        self._marker = ""  # the marker that opened the current region ("" for a bare start)

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        self._run(out, final=False)
        return out

    def finish(self, cut: bool = False) -> list[Event]:
        """Decide everything still held: unfinished regions become content, except with ``cut``
        (the token budget ended the output): a call being written is emitted as far as it got
        (start and arguments so far, no end), as OpenAI returns a call the length cut, and a
        region that opened with a marker is dropped rather than shown as text."""
        out: list[Event] = []
        if self._finished:
            return out
        self._finished = True
        if cut and self._in_region and (part := self._partial(self._buf)) is not None:
            self._emit(part.calls, out)
            if part.partial is not None:
                i, (name, args) = self._index, part.partial
                self._index += 1
                out += [ToolCallStart(i, self._new_id(), name)]
                out += [ToolCallArgs(i, args)] if args else []
            self._buf, self._pending = "", ""
            return out
        self._cut = cut
        self._run(out, final=True)
        if self._pending and not (self._index and self._between_calls):
            out.append(TextDelta(self._pending))
        self._pending = ""
        return out

    # --- format hooks ------------------------------------------------------------------------

    @abc.abstractmethod
    def _begin(self, marker: str) -> None:
        """A region starts with ``marker`` ("" for a bare start); reset per-region state."""

    @abc.abstractmethod
    def _scan(self, buf: str, final: bool) -> Scan:
        """Decide the region at the start of ``buf``; with ``final`` never return More."""

    def _partial(self, buf: str) -> Cut | None:
        """The region at the start of ``buf`` as the budget left it, if a call was being
        written; formats whose arguments are not JSON text keep this default."""
        return None

    # --- machinery ---------------------------------------------------------------------------

    def _emit(self, calls: list[tuple[str, str]], out: list[Event]) -> None:
        self._pending = ""
        self._between_calls = True
        for name, args in calls:
            i = self._index
            self._index += 1
            out += [ToolCallStart(i, self._new_id(), name)]
            out += [ToolCallArgs(i, args), ToolCallEnd(i)]

    def _run(self, out: list[Event], final: bool) -> None:
        while self._buf:
            if self._in_region:
                res = self._scan(self._buf, final)
                match res:
                    case More():
                        return
                    case Done(end, calls):
                        self._emit(calls, out)
                    case Bail(end):
                        if final and self._cut and self._marker:
                            # The budget ended a call inside this format's markup: none of
                            # what is left is the answer.
                            self._buf, self._in_region = "", False
                            return
                        self._text(self._buf[:end], out)
                self._buf = self._buf[end:]
                self._in_region = False
                continue
            start = self._find_start(self._buf)
            if start is None:
                keep = 0 if final else held_prefix(self._buf, self.markers)
                self._text(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                return
            pos, marker = start
            self._text(self._buf[:pos], out)
            self._buf = self._buf[pos:]
            self._in_region = True
            self._marker = marker
            self._begin(marker)

    def _find_start(self, buf: str) -> tuple[int, str] | None:
        if self.bare_starts and (not self._emitted or self._between_calls):
            seps = self.separators if self._between_calls else WS
            j = 0
            while j < len(buf) and buf[j] in seps:
                j += 1
            if j < len(buf) and buf[j] in self.bare_starts:
                return j, ""
        hits = [(i, m) for m in self.markers if (i := buf.find(m)) >= 0]
        return min(hits) if hits else None

    def _text(self, s: str, out: list[Event]) -> None:
        """Emit content, holding back a droppable tail until we know what follows it."""
        if not s:
            return
        text = self._pending + s
        seps = self.separators if self._between_calls else WS
        i = len(text)
        while i and text[i - 1] in seps:
            i -= 1
        if i == 0:
            self._pending = text
            return
        self._pending = text[i:]
        self._between_calls = False
        self._emitted = True
        out.append(TextDelta(text[:i]))

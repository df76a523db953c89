"""Formats that wrap calls in a section of special tokens, each call a name (or id) and a JSON
arguments object between its own tokens: DeepSeek V3.1, DeepSeek V3/R1 and Kimi K2.

The streamer sees special tokens spelled out (it detokenises with them kept), so the markers
here are their text.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mlxcel.actors.toolcalls._stream import (
    Bail,
    Balancer,
    Cut,
    Done,
    More,
    Scan,
    StreamParser,
    dumps_args,
    loads,
)
from mlxcel.actors.toolcalls.xml_args import _skip, expect


class _Section(StreamParser):
    """``SECTION_BEGIN (CALL_BEGIN head HEAD_END {json} CALL_END)+ SECTION_END``."""

    CALL_BEGIN = ""
    HEAD_END = ""
    CALL_END = ""
    SECTION_ENDS: tuple[str, ...] = ()

    def _begin(self, marker: str) -> None:
        self._pos = len(marker)
        self._calls: list[tuple[str, str]] = []
        self._head: str | None = None  # the name of the call being read
        self._bal: Balancer | None = None
        self._vstart = 0
        self._args: str | None = None  # the current call's arguments, once read

    @abc.abstractmethod
    def _read_head(self, head: str) -> str | None:
        """The call's name from the text before HEAD_END."""

    @classmethod
    def tokens(cls) -> tuple[str, ...]:
        """The markers inside a section (special tokens in the model's vocabulary)."""
        return (cls.CALL_BEGIN, cls.HEAD_END, cls.CALL_END, *cls.SECTION_ENDS)

    def _scan(self, buf: str, final: bool) -> Scan:
        more: Scan = Bail(len(buf)) if final else More()
        while True:
            if self._bal is not None:
                end = self._bal.advance(buf)
                if end is None:
                    return more
                if end < 0:
                    return Bail(self._bal.pos)
                try:
                    self._args = dumps_args(loads(buf[self._vstart : end]))
                except (ValueError, RecursionError):
                    self._args = None
                if self._args is None:
                    return Bail(end)
                self._bal, self._pos = None, end
            if self._args is not None:  # the arguments are read; the call's end comes next
                j = _skip(buf, self._pos)
                close = expect(buf, j, self.CALL_END)
                if close is None:
                    return more
                if close < 0:
                    return Bail(j)
                assert self._head is not None
                self._calls.append((self._head, self._args))
                self._args, self._head, self._pos = None, None, close
                continue
            j = _skip(buf, self._pos)
            if self._head is None:
                opened = expect(buf, j, self.CALL_BEGIN)
                if opened is not None and opened >= 0:
                    sep = buf.find(self.HEAD_END, opened)
                    if sep < 0:
                        # A name is short: a long run without the separator is not a call.
                        if final or len(buf) - opened > 300:
                            return Bail(j if self._calls else len(buf))
                        return More()
                    head = self._read_head(buf[opened:sep])
                    if head is None:
                        return Bail(sep)
                    self._head, self._pos = head, sep + len(self.HEAD_END)
                    continue
                if self._calls:
                    closes = [expect(buf, j, end) for end in self.SECTION_ENDS]
                    close = max((c for c in closes if c is not None), default=None)
                    if close is not None and close >= 0:
                        return self._done(close)
                    if None in closes:
                        # Stopped inside (or before) the section's end: the calls are whole.
                        return self._done(len(buf)) if final else More()
                if opened is None and not final:
                    return More()
                return Bail(j if self._calls else self._pos)
            if j == len(buf):
                return more
            if buf[j] != "{":
                return Bail(j)
            self._vstart, self._bal = j, Balancer(j)

    def _partial(self, buf: str) -> Cut | None:
        if self._head is None:
            return Cut(self._calls, None)
        if self._args is not None:  # the arguments are whole; only the call's end was cut
            return Cut([*self._calls, (self._head, self._args)], None)
        args = buf[self._vstart :] if self._bal is not None else ""
        return Cut(self._calls, (self._head, args))

    def _done(self, end: int) -> Scan:
        return Done(end, self._calls)


_NAME = re.compile(r"\s*([^\s<>{}]{1,200})\s*")


class DeepSeekV31Parser(_Section):
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
    ...<｜tool▁calls▁end｜>`` (DeepSeek V3.1 and V3.2-Exp templates)."""

    markers = ("<｜tool▁calls▁begin｜>",)
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    HEAD_END = "<｜tool▁sep｜>"
    CALL_END = "<｜tool▁call▁end｜>"
    SECTION_ENDS = ("<｜tool▁calls▁end｜>",)

    def _read_head(self, head: str) -> str | None:
        m = _NAME.fullmatch(head)
        return None if m is None else m.group(1)


_FENCED_HEAD = re.compile(r"\s*function<｜tool▁sep｜>([^\s<>{}]{1,200})\s*")


class DeepSeekV3Parser(_Section):
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}
    \\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (DeepSeek V3-0324 and R1 templates): the
    call's type and name before the fence, its arguments inside it. The fence's opening ends
    the head and its closing starts the call's end, so the section scanning is V3.1's."""

    markers = ("<｜tool▁calls▁begin｜>",)
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    HEAD_END = "```json"
    CALL_END = "```<｜tool▁call▁end｜>"
    SECTION_ENDS = ("<｜tool▁calls▁end｜>",)

    @classmethod
    def tokens(cls) -> tuple[str, ...]:
        return (cls.CALL_BEGIN, "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", *cls.SECTION_ENDS)

    def _read_head(self, head: str) -> str | None:
        m = _FENCED_HEAD.fullmatch(head)
        return None if m is None else m.group(1)


# Kimi K2 ids are "functions.NAME:IDX" (IDX counts calls across the conversation).
_KIMI_ID = re.compile(r"\s*((?:functions\.)?([^\s<>:]{1,200}):\d{1,9})\s*")


class KimiK2Parser(_Section):
    """``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``.

    Calls get ids of the API family (``call_...``, ``toolu_...``), not the model's own
    ``functions.NAME:IDX``: ids must look like the family's and come back from the client as it
    keeps them, so the prompt is where Kimi's spelling is restored (``kimi_history_ids``)."""

    # vLLM also accepts the singular spelling, which Kimi K2 writes at times.
    markers = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    CALL_BEGIN = "<|tool_call_begin|>"
    HEAD_END = "<|tool_call_argument_begin|>"
    CALL_END = "<|tool_call_end|>"
    SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")

    def _read_head(self, head: str) -> str | None:
        m = _KIMI_ID.fullmatch(head)
        return None if m is None else m.group(2)


def kimi_history_ids(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with Kimi's own call ids: each earlier call becomes ``functions.NAME:IDX``
    (IDX counting calls across the conversation, as the model numbers them) and each tool
    result points at its call's new id. Clients keep the ids we gave them (``call_...``,
    ``toolu_...``); Kimi's template writes ids verbatim, and the model reads this syntax."""
    ids: dict[str, str] = {}
    count = 0
    out: list[dict[str, Any]] = []
    for msg in messages:
        calls = msg.get("tool_calls")
        if msg.get("role") == "assistant" and isinstance(calls, list):
            renamed = []
            for call in calls:
                fn = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(fn, Mapping):
                    kimi = f"functions.{fn.get('name')}:{count}"
                    count += 1
                    ids[str(call.get("id"))] = kimi
                    call = {**call, "id": kimi}
                renamed.append(call)
            out.append({**msg, "tool_calls": renamed})
        elif msg.get("role") == "tool" and str(msg.get("tool_call_id")) in ids:
            out.append({**msg, "tool_call_id": ids[str(msg.get("tool_call_id"))]})
        else:
            out.append(dict(msg))
    return out

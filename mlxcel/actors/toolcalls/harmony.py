"""gpt-oss's harmony format: the tool-call messages.

A harmony output is a run of messages, each ``<|start|>ROLE HEADER<|message|>BODY`` ended by
``<|end|>``, ``<|call|>`` or ``<|return|>``; the header names a channel (``<|channel|>analysis``,
``commentary``, ``final``) and, for a tool call, a recipient: ``to=functions.NAME`` after the
channel (what the model writes, ``<|channel|>commentary to=functions.NAME <|constrain|>json``) or
after the role (what gpt-oss's chat template writes back, ``<|start|>assistant to=functions.NAME
<|channel|>commentary json``). The channels are split by ``mlxcel.actors.harmony``, which hands
this parser only the messages that have a recipient, framing included.
"""

from __future__ import annotations

import re

from mlxcel.actors.toolcalls._stream import (
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

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
CONSTRAIN = "<|constrain|>"
# Every harmony special token: gpt-oss's output is only readable with all of them kept.
TOKENS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
# What ends a message's body.
ENDS = (END, CALL, RETURN)
# A header is a role, a channel, a recipient and a content type: a long run without
# <|message|> is not one.
HEADER_MAX = 256

_RECIPIENT = re.compile(r"\bto=([^\s<]{1,200})")


def recipient(header: str) -> str | None:
    """The ``to=`` of a message header, None for a message to the user (or the model's own
    analysis). ``to=assistant`` is a tool's result, not a call."""
    m = _RECIPIENT.search(header)
    return None if m is None or m.group(1) == "assistant" else m.group(1)


def function_name(to: str) -> str:
    """The tool name of a recipient: function tools are addressed as ``functions.NAME``;
    built-in tools (``browser.search``, ``python``) by their own name."""
    return to.removeprefix("functions.")


class HarmonyParser(StreamParser):
    """``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``:
    one call per message. The model's ``<|call|>`` is an end-of-generation token, so a call
    whose JSON is whole is accepted at the end of the output without it."""

    # Headers open a region; a stray end marker is one too, only to be dropped.
    markers = (START, CHANNEL, *ENDS)

    def _begin(self, marker: str) -> None:
        self._name: str | None = None
        self._bal: Balancer | None = None
        self._vstart = 0
        self._body = 0  # where the message's body starts
        self._args: str | None = None  # the arguments, once whole
        self._end = 0  # where they end

    def _scan(self, buf: str, final: bool) -> Scan:
        # Framing is never content: where a message turns out not to be a call, its header
        # (and later its end marker) is dropped and its body is content.
        if self._marker in ENDS:
            return Done(len(self._marker), [])
        if self._name is None:
            i = buf.find(MESSAGE)
            if i < 0:
                if final:
                    return Done(len(buf), [])  # the output ended inside a header
                if len(buf) > HEADER_MAX or any(e in buf for e in ENDS):
                    return Done(len(self._marker), [])  # not a header: its text is content
                return More()
            self._body = i + len(MESSAGE)
            to = recipient(buf[:i])
            if to is None:
                return Done(self._body, [])  # a message to the user: not a call
            self._name = function_name(to)
            self._vstart = self._body
        not_a_call = Done(self._body, [])
        more: Scan = not_a_call if final else More()
        if self._args is None:
            if self._bal is None:
                j = _skip(buf, self._vstart)
                if j == len(buf):
                    return more
                if buf[j] != "{":
                    return not_a_call
                self._vstart, self._bal = j, Balancer(j)
            end = self._bal.advance(buf)
            if end is None:
                return more
            if end < 0:
                return not_a_call
            try:
                self._args = dumps_args(loads(buf[self._vstart : end]))
            except (ValueError, RecursionError):
                self._args = None
            if self._args is None:
                return not_a_call
            self._end = end
        call = (self._name, self._args)
        j = _skip(buf, self._end)
        closes = [expect(buf, j, e) for e in ENDS]
        close = max((c for c in closes if c is not None), default=None)
        if close is not None and close >= 0:
            return Done(close, [call])
        if None in closes and not final:
            return More()
        # Whatever follows the whole JSON without an end marker is not part of the call.
        return Done(j, [call])

    def _partial(self, buf: str) -> Cut | None:
        if self._name is None:
            return None
        if self._args is not None:  # only the end marker was cut
            return Cut([(self._name, self._args)], None)
        args = buf[self._vstart :] if self._bal is not None else ""
        return Cut([], (self._name, args))

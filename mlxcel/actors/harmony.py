"""gpt-oss's harmony channels, split incrementally: the reasoning splitter of harmony models.

The model writes messages (``mlxcel.actors.toolcalls.harmony`` describes their framing):
``analysis`` is its reasoning, ``final`` the answer, ``commentary`` without a recipient a
preamble shown to the user, and a message with a recipient a tool call. The splitter turns
analysis into ReasoningDelta and the answer and preambles into TextDelta with every header and
end marker taken out; a tool-call message goes on as TextDelta with its framing intact, for the
tool-call parser (``HarmonyParser``) behind it. Streaming and non-streaming run the same
splitter, so they agree whatever the chunking.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlxcel.actors.toolcalls._stream import WS, held_prefix
from mlxcel.actors.toolcalls.events import ReasoningDelta, TextDelta
from mlxcel.actors.toolcalls.harmony import CHANNEL, ENDS, HEADER_MAX, MESSAGE, START, recipient

_HEADS = (START, CHANNEL)
# The generation prompt ends with "<|start|>assistant", so the first header of the output has
# no <|start|>: it opens with its channel, or with the recipient (" to=functions.NAME").
_OPEN_HEADS = (CHANNEL, " to=", "to=")

Piece = ReasoningDelta | TextDelta


class HarmonySplitter:
    """Routes analysis to ReasoningDelta, answers to TextDelta and tool-call messages (framing
    included) to TextDelta for the call parser. Text outside any message (a model that does
    not keep to the format) is content, with the whitespace between messages dropped.

    ``calls`` false (the request parses no calls: no tools, or ``tool_choice: none``): a call
    message's body is content like any other, its framing dropped."""

    def __init__(self, *, calls: bool = True) -> None:
        self._calls = calls
        self._mode = "open"  # open | out | header | analysis | text | call
        self._buf = ""
        self._seen = False
        self._implicit = False  # the header being read continues the prompt's <|start|>
        self._ws = ""  # trailing whitespace outside messages, shown only if text follows
        self._lead = True

    @property
    def in_reasoning(self) -> bool:
        return self._mode == "analysis"

    @property
    def saw_reasoning(self) -> bool:
        return self._seen

    def feed(self, delta: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += delta
        self._run(out, final=False)
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        self._run(out, final=True)
        self._buf = self._ws = ""
        return out

    def _run(self, out: list[Piece], final: bool) -> None:
        while self._buf:
            match self._mode:
                case "open":
                    if not final and any(h.startswith(self._buf) for h in _OPEN_HEADS):
                        return
                    self._implicit = any(self._buf.startswith(h) for h in _OPEN_HEADS[1:])
                    self._mode = "header" if self._implicit else "out"
                case "out":
                    if not self._outside(out, final):
                        return
                case "header":
                    if not self._header(out, final):
                        return
                case _:
                    if not self._body(out, final):
                        return

    def _take(self, final: bool) -> tuple[str, str | None]:
        """Cut the text before the first marker off the buffer: (that text, the marker, still
        at the buffer's start). Without one, all but a tail that may start one (the marker
        None)."""
        stops = (*_HEADS, *ENDS)
        hits = [(i, m) for m in stops if (i := self._buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            text, self._buf = self._buf[:i], self._buf[i:]
            return text, marker
        keep = 0 if final else held_prefix(self._buf, stops)
        text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        return text, None

    def _outside(self, out: list[Piece], final: bool) -> bool:
        """Text between messages; True when a header (or a stray end marker) was reached."""
        text, marker = self._take(final)
        self._loose(text, out)
        if marker is None:
            return False
        if marker in ENDS:
            self._buf = self._buf[len(marker) :]  # a stray end: framing, never shown
        else:
            self._mode, self._implicit = "header", False
            self._ws, self._lead = "", True
        return True

    def _loose(self, s: str, out: list[Piece]) -> None:
        text = self._ws + s
        if self._lead:
            text = text.lstrip(WS)
        body = text.rstrip(WS)
        if body:
            out.append(TextDelta(body))
            self._lead = False
        self._ws = text[len(body) :]

    def _header(self, out: list[Piece], final: bool) -> bool:
        i = self._buf.find(MESSAGE)
        if i < 0:
            if final:
                self._buf = ""  # a header the output ended inside: framing, never shown
                return False
            if len(self._buf) <= HEADER_MAX and not any(e in self._buf for e in ENDS):
                return False
            # Not a header after all: its opening marker goes, the rest is text.
            opener = next((h for h in _HEADS if self._buf.startswith(h)), "")
            self._buf = self._buf[len(opener) :]
            self._mode = "out"
            return True
        header = self._buf[:i]
        if recipient(header) is not None and self._calls:
            head = START + "assistant" + header if self._implicit else header
            out.append(TextDelta(head + MESSAGE))
            self._mode = "call"
        elif f"{CHANNEL}analysis" in header:
            self._mode = "analysis"
            self._seen = True
        else:
            self._mode = "text"  # final, or a commentary preamble
        self._buf = self._buf[i + len(MESSAGE) :]
        return True

    def _body(self, out: list[Piece], final: bool) -> bool:
        text, marker = self._take(final)
        self._piece(text, out)
        if marker is None:
            return False
        if marker in ENDS:
            if self._mode == "call":
                self._piece(marker, out)  # the call parser ends the call on it
            self._buf = self._buf[len(marker) :]
        # (a header: the next message began without this one's end)
        self._mode = "out"
        return True

    def _piece(self, s: str, out: list[Piece]) -> None:
        if s:
            out.append(ReasoningDelta(s) if self._mode == "analysis" else TextDelta(s))


def harmony_history(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as gpt-oss's template reads them: an assistant turn's reasoning in
    ``thinking`` (clients send it back as ``reasoning_content``, Anthropic thinking blocks and
    Responses reasoning items become that). The template renders it only before a call that
    no final answer follows, and refuses a call turn with both content and thinking: there
    the content (what the template shows as the call's analysis) is kept."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        reasoning = msg.get("reasoning_content")
        new = {k: v for k, v in msg.items() if k != "reasoning_content"}
        if msg.get("role") == "assistant" and isinstance(reasoning, str) and reasoning:
            if not (msg.get("tool_calls") and msg.get("content")):
                new.setdefault("thinking", reasoning)
        out.append(new)
    return out

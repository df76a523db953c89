"""Splitting thinking from the answer, incrementally; and the thinking-budget decision.

Pure text processing for the streamer. Streaming and non-streaming responses run the same
splitter, so ``reasoning_content`` is identical in both, whatever the chunking.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from mlxcel.actors.harmony import HarmonySplitter
from mlxcel.actors.toolcalls._stream import held_prefix
from mlxcel.actors.toolcalls.events import ReasoningDelta, TextDelta
from mlxcel.actors.toolcalls.harmony import CHANNEL, END, MESSAGE

__all__ = [
    "HarmonyFormat",
    "ReasoningDelta",
    "ReasoningFormat",
    "ReasoningSplitter",
    "Splitter",
    "ThinkingBudget",
    "detect_reasoning",
    "split_complete",
]


class Splitter(Protocol):
    """What the streamer drives: text in, thinking and answer pieces out."""

    @property
    def in_reasoning(self) -> bool: ...

    @property
    def saw_reasoning(self) -> bool: ...

    def feed(self, delta: str) -> list[ReasoningDelta | TextDelta]: ...

    def finish(self) -> list[ReasoningDelta | TextDelta]: ...


@attrs.frozen
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"

    def opened_by(self, prompt: str) -> bool:
        """Whether the rendered prompt already opened thinking (DeepSeek-R1-0528, QwQ and
        Qwen3 templates end the generation prompt with ``<think>\\n``), so the output starts
        inside reasoning and only the end marker will appear."""
        i = prompt.rfind(self.start)
        return i >= 0 and i > prompt.rfind(self.end) and not prompt[i + len(self.start) :].strip()

    def splitter(self, *, starts_open: bool = False, calls: bool = True) -> Splitter:
        """``calls``: a tool-call parser reads what the splitter passes on as content."""
        return ReasoningSplitter(self.start, self.end, starts_open=starts_open)


@attrs.frozen
class HarmonyFormat(ReasoningFormat):
    """gpt-oss: thinking is the ``analysis`` channel's message (start and end are what the
    thinking budget and the grammar guide match); the splitter reads every channel."""

    start: str = f"{CHANNEL}analysis{MESSAGE}"
    end: str = END

    def opened_by(self, prompt: str) -> bool:
        return False  # the generation prompt opens a message, never its channel

    def splitter(self, *, starts_open: bool = False, calls: bool = True) -> Splitter:
        return HarmonySplitter(calls=calls)


def detect_reasoning(chat_template: str | None) -> ReasoningFormat | None:
    """The thinking markup a template uses, None for templates that do not think."""
    t = chat_template or ""
    if CHANNEL in t and MESSAGE in t:
        return HarmonyFormat()
    # DeepSeek R1's first template only cuts "</think>" out of earlier answers: the model
    # still opens its thinking with <think>.
    if "<think>" in t or "</think>" in t or "enable_thinking" in t:
        return ReasoningFormat()
    return None


class ReasoningSplitter:
    """Routes text between start/end markers to ReasoningDelta, the rest to TextDelta.

    Holds back only a tail that might be the start of a marker. Whitespace at the edges of a
    thinking block (the newlines models put inside ``<think>\\n...\\n</think>\\n\\n``) belongs to
    neither side and is dropped, as llama.cpp does; content is otherwise passed through exactly.
    Output that never closes its thinking (cut by max_tokens) stays reasoning at finish.
    """

    def __init__(
        self, start: str = "<think>", end: str = "</think>", *, starts_open: bool = False
    ) -> None:
        self._start, self._end = start, end
        self._in = starts_open
        # A primed-open block sometimes repeats the opening marker; it is swallowed, not shown.
        self._fresh = starts_open
        self._lead = starts_open  # at the start of a segment whose leading whitespace is dropped
        self._ws = ""  # trailing whitespace of reasoning, shown only if more reasoning follows
        self._buf = ""
        self._seen = starts_open

    @property
    def in_reasoning(self) -> bool:
        """True while the output is inside a thinking block (what ThinkingBudget counts)."""
        return self._in

    @property
    def saw_reasoning(self) -> bool:
        return self._seen

    def feed(self, delta: str) -> list[ReasoningDelta | TextDelta]:
        out: list[ReasoningDelta | TextDelta] = []
        self._buf += delta
        while self._buf:
            if self._in and self._fresh:
                s = self._buf.lstrip()
                if not s or (self._start.startswith(s) and s != self._start):
                    return out  # still might be a repeated opening marker
                self._fresh = False
                if s.startswith(self._start):
                    self._buf = s[len(self._start) :]
                    continue
            marker = self._end if self._in else self._start
            i = self._buf.find(marker)
            if i < 0:
                keep = held_prefix(self._buf, (marker,))
                self._emit(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            self._emit(self._buf[:i], out)
            self._buf = self._buf[i + len(marker) :]
            self._in = not self._in
            self._seen = True
            self._lead, self._ws = True, ""
        return out

    def finish(self) -> list[ReasoningDelta | TextDelta]:
        out: list[ReasoningDelta | TextDelta] = []
        self._fresh = False
        self._emit(self._buf, out)
        self._buf = self._ws = ""
        return out

    def _emit(self, s: str, out: list[ReasoningDelta | TextDelta]) -> None:
        if self._lead:
            s = s.lstrip()
            if not s:
                return
            self._lead = False
        if not self._in:
            if s:
                out.append(TextDelta(s))
            return
        body = s.rstrip()
        if body:
            out.append(ReasoningDelta(self._ws + body))
            self._ws = ""
        self._ws += s[len(body) :]


def split_complete(
    text: str, fmt: ReasoningFormat | None = None, *, starts_open: bool = False
) -> tuple[str | None, str]:
    """(reasoning or None, content) for a whole output; what any chunking of ``feed`` gives."""
    sp = (fmt or ReasoningFormat()).splitter(starts_open=starts_open)
    events = sp.feed(text) + sp.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    return (reasoning if sp.saw_reasoning else None), content


class ThinkingBudget:
    """Counts reasoning tokens and says when to force thinking closed.

    ``limit``: -1 unlimited, 0 no thinking, N at most N tokens inside a thinking block (the
    token that opens the block is not counted). The server calls ``observe`` once per generated
    token with the splitter's ``in_reasoning`` after that token's text; when it returns True the
    server injects the end marker's tokens. ``exhausted`` before the first token with a
    primed-open prompt and limit 0 means: close thinking in the prompt itself.
    """

    def __init__(self, limit: int, *, starts_open: bool = False) -> None:
        if limit < -1:
            raise ValueError("thinking budget must be -1 (unlimited), 0 or a positive count")
        self.limit = limit
        self.used = 0
        self._open = starts_open
        self._closing = False  # asked to close, waiting to see the end marker go through

    @property
    def exhausted(self) -> bool:
        return self.limit >= 0 and self.used >= self.limit

    def observe(self, in_reasoning: bool) -> bool:
        """Count one token; True exactly once per thinking block that must be closed now."""
        was_open, self._open = self._open, in_reasoning
        if not in_reasoning:
            self._closing = False
            return False
        if was_open:
            self.used += 1
        if self.exhausted and not self._closing:
            self._closing = True
            return True
        return False

"""Pure text helpers for the streamer: incremental detokenisation and stop-string matching."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens kept as left context: SentencePiece-style tokenizers drop a word's leading
# space when a slice is decoded on its own, so every slice starts a few tokens early.
_CONTEXT = 6


class IncrementalDetokenizer:
    """Turns a token stream into text deltas that never split a UTF-8 character.

    Decodes a short window twice per token (text before and after the new token) and only
    emits the difference once it no longer ends in U+FFFD, the mark of an incomplete byte
    sequence. Cost is bounded by the window, not the length of the output.
    """

    def __init__(
        self, tokenizer: Any, context: Sequence[int] = (), hidden: frozenset[int] | None = None
    ) -> None:
        self._tok = tokenizer
        # Special tokens left out of the text; None hides them all. Output parsers need some
        # special tokens kept as text (Llama's <|python_tag|>, Mistral's [TOOL_CALLS]).
        self._hidden = hidden
        self._ids: list[int] = list(context[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if self._hidden is None:
            return str(self._tok.decode(ids, skip_special_tokens=True))
        return str(
            self._tok.decode([i for i in ids if i not in self._hidden], skip_special_tokens=False)
        )

    def add(self, token: int) -> str:
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


class StopMatcher:
    """Finds stop strings across delta boundaries; holds back text that might start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Return (text safe to emit, the stop string matched or None)."""
        if not self._stops:
            return text, None
        buf = self._held + text
        hits = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            i, stop = min(hits)
            self._held = ""
            return buf[:i], stop
        keep = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

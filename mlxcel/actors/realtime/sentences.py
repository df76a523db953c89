"""Cuts streamed answer text into pieces worth speaking, as soon as each is complete.

Text-to-speech wants whole sentences (prosody), but waiting for one delays the first audio: the
user hears nothing until the answer's first sentence is generated *and* spoken. So the first
piece ends early: at a clause break (",", ";", ":") once it holds ``first_clause_chars``, or
after its first ``first_words`` words when no break comes (Piper then speaks those words as a
phrase; a slight dip in prosody against ~0.3-0.6 s less silence before the answer here). Later
pieces are whole sentences, cut at a word boundary when one grows past ``max_chars``, or cut
early when the caller says to ``hurry`` (the listener is about to run out of audio): then at
the last clause break, else after the last whole word once ``hurry_words`` are there.
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"[.!?\u2026\u3002]+[\"')\]]*(?=\s)|\n+")
_CLAUSE_END = re.compile(r"[,;:\u2014](?=\s)")
_WORD_END = re.compile(r"\S(?=\s)")


class SentenceSplitter:
    def __init__(
        self,
        *,
        first_clause_chars: int = 10,
        first_words: int = 5,
        hurry_words: int = 3,
        max_chars: int = 240,
    ) -> None:
        self._buf = ""
        self._first = True
        self._first_clause_chars = first_clause_chars
        self._first_words = first_words
        self._hurry_words = hurry_words
        self._max_chars = max_chars

    def feed(self, text: str, *, hurry: bool = False) -> list[str]:
        """Add streamed text; return the pieces it completed (stripped, non-empty)."""
        self._buf += text
        out: list[str] = []
        while piece := self._cut(hurry and not out):
            out.append(piece)
        return out

    def flush(self) -> str:
        """Whatever is left at the end of the answer."""
        rest, self._buf = self._buf.strip(), ""
        return rest

    def _cut(self, hurry: bool = False) -> str | None:
        end = None
        if m := _SENTENCE_END.search(self._buf):
            end = m.end()
        elif self._first:
            end = self._first_end()
        elif hurry:
            end = self._hurried_end()
        if end is None and len(self._buf) > self._max_chars:
            space = self._buf.rfind(" ", 0, self._max_chars)
            end = space if space > 0 else self._max_chars
        if end is None:
            return None
        piece, self._buf = self._buf[:end].strip(), self._buf[end:]
        if not piece:
            return self._cut(hurry) if self._buf.strip() and end > 0 else None
        self._first = False
        return piece

    def _first_end(self) -> int | None:
        """Where the first piece may end before its sentence does (a word counts once the
        whitespace after it has arrived: the next token could still extend it)."""
        start = len(self._buf) - len(self._buf.lstrip())
        if m := _CLAUSE_END.search(self._buf, start + self._first_clause_chars):
            return m.end()
        ends = self._word_ends()
        if len(ends) >= self._first_words:
            return ends[self._first_words - 1]
        return None

    def _hurried_end(self) -> int | None:
        """The last clause break, else the end of the last whole word (``hurry_words`` at
        least)."""
        clauses = [m.end() for m in _CLAUSE_END.finditer(self._buf)]
        if clauses:
            return clauses[-1]
        ends = self._word_ends()
        return ends[-1] if len(ends) >= self._hurry_words else None

    def _word_ends(self) -> list[int]:
        return [m.end() for m in _WORD_END.finditer(self._buf)]

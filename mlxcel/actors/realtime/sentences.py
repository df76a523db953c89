"""Cuts streamed answer text into pieces worth speaking, as soon as each is complete.

Text-to-speech wants whole sentences (prosody), but waiting for a long one delays the first
audio, so the first piece may also end at a clause break (",", ";", ":") once it is long
enough, and any piece is cut at a word boundary when it grows past ``max_chars``.
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"[.!?\u2026\u3002]+[\"')\]]*(?=\s)|\n+")
_CLAUSE_END = re.compile(r"[,;:\u2014](?=\s)")


class SentenceSplitter:
    def __init__(self, *, first_clause_chars: int = 24, max_chars: int = 240) -> None:
        self._buf = ""
        self._first = True
        self._first_clause_chars = first_clause_chars
        self._max_chars = max_chars

    def feed(self, text: str) -> list[str]:
        """Add streamed text; return the pieces it completed (stripped, non-empty)."""
        self._buf += text
        out: list[str] = []
        while piece := self._cut():
            out.append(piece)
        return out

    def flush(self) -> str:
        """Whatever is left at the end of the answer."""
        rest, self._buf = self._buf.strip(), ""
        return rest

    def _cut(self) -> str | None:
        end = None
        if m := _SENTENCE_END.search(self._buf):
            end = m.end()
        elif self._first and len(self._buf) >= self._first_clause_chars:
            if m := _CLAUSE_END.search(self._buf, self._first_clause_chars // 2):
                end = m.end()
        if end is None and len(self._buf) > self._max_chars:
            space = self._buf.rfind(" ", 0, self._max_chars)
            end = space if space > 0 else self._max_chars
        if end is None:
            return None
        piece, self._buf = self._buf[:end].strip(), self._buf[end:]
        if not piece:
            return self._cut() if self._buf.strip() and end > 0 else None
        self._first = False
        return piece

"""A session's outgoing events: bounded in bytes, never blocking the producer.

Producers (the reader, the response, the speaker) ``put`` without waiting; the session's writer
task sends in order. A client that reads slower than the session produces fills the box: past
``max_bytes`` what is queued is dropped and the box closes with 1008 (``OVERFLOW``), so the
session ends instead of stalling or growing. The overflow is a close like any other, not an
exception: it must not travel through the producers' tasks, which turn their own failures into
``error`` events and would have to tell the two apart.
Audio of a cancelled response that is still waiting here is ``purge``d: the user never heard it.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import attrs
import trio

# The close that ends a session whose client fell ``max_bytes`` behind.
OVERFLOW = (1008, "client too slow: outgoing queue overflow")


@attrs.define
class Outgoing:
    payload: dict[str, Any]
    text: str
    # The response this event belongs to (purgeable on cancel) and, for the first audio chunk
    # of a spoken piece, that piece's index.
    response_id: str | None = None
    first_of_piece: int | None = None


class Outbox:
    def __init__(self, max_bytes: int) -> None:
        self._items: collections.deque[Outgoing] = collections.deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._wake = trio.Event()
        self.closing: tuple[int, str] | None = None
        # Whether the box closed because it overflowed (the client was too slow).
        self.overflowed = False

    def put(
        self,
        payload: dict[str, Any],
        *,
        response_id: str | None = None,
        first_of_piece: int | None = None,
    ) -> None:
        """Queue one event; once closing, drop it. An event that would take the box past
        ``max_bytes`` drops everything queued and closes the box with ``OVERFLOW``."""
        if self.closing is not None:
            return
        text = json.dumps(payload, ensure_ascii=False)
        if self._bytes + len(text) > self._max_bytes:
            self._items.clear()
            self._bytes = 0
            self.overflowed = True
            self.close(*OVERFLOW)
            return
        self._items.append(Outgoing(payload, text, response_id, first_of_piece))
        self._bytes += len(text)
        self._wake.set()

    def close(self, code: int, reason: str) -> None:
        """Send what is queued, then close the WebSocket with ``code``. First call wins."""
        if self.closing is None:
            self.closing = (code, reason)
            self._wake.set()

    def purge(self, response_id: str) -> set[int]:
        """Drop the queued events of a response; return the pieces whose first audio was dropped."""
        kept: collections.deque[Outgoing] = collections.deque()
        dropped: set[int] = set()
        for item in self._items:
            if item.response_id == response_id:
                self._bytes -= len(item.text)
                if item.first_of_piece is not None:
                    dropped.add(item.first_of_piece)
            else:
                kept.append(item)
        self._items = kept
        return dropped

    async def get(self) -> Outgoing | tuple[int, str]:
        """The next event to send, or the close (code, reason) once everything is sent."""
        while True:
            if self._items:
                item = self._items.popleft()
                self._bytes -= len(item.text)
                return item
            if self.closing is not None:
                return self.closing
            await self._wake.wait()
            self._wake = trio.Event()

    @property
    def pending_bytes(self) -> int:
        """Bytes of events queued and not yet handed to the socket."""
        return self._bytes

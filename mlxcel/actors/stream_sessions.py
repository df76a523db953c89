"""The stream-sessions actor: resumable streams, as llama-server b10621 has them (#1444).

A streaming request that sends ``X-Conversation-Id`` does not stream straight to its client:
this actor runs the stream body in its own nursery and copies every SSE frame, byte for byte,
into a per-conversation buffer; the client (and anyone with the same key who asks later,
through ``GET /v1/stream``) follows that buffer from a byte offset. So a dropped connection
loses nothing: the generation runs on to its natural end, and the client resumes from the
last byte it saw. What stops it is ``DELETE /v1/stream``, or a new stream under the same id.

Sessions are keyed by ``(owner, conversation id)``, the owner being a digest of the API key
that started the stream ("" without keys): another key sees exactly what an unknown id gets,
so the routes tell nothing about whether a session exists. A buffer keeps its last 4 MiB (a replay
from an offset that fell off the front is refused); a finished session stays for 5 minutes,
and at most 256 finished ones are kept (the oldest go first). Live ones are bounded by
admission, since each holds a request.

Keepalive comments are not stored: offsets count only what the stream said, and each reader
gets its own keepalives while it waits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import trio

log = logging.getLogger(__name__)

TTL_S = 300.0
MAX_BYTES = 4 << 20
MAX_RETAINED = 256
GC_INTERVAL_S = 60.0
# How long a cancelled stream body may take to run its cleanup (it stores a Responses result).
CLOSE_GRACE_S = 10.0
KEEPALIVE = b": keepalive\n\n"

# The scope of the key that started a stream ("" without keys): http/security.key_scope.
Owner = str


class StreamSession:
    """One resumable stream: the SSE bytes of one generation, outliving its connection."""

    def __init__(self, conversation_id: str, cap: int, clock: Callable[[], float]) -> None:
        self.conversation_id = conversation_id
        self.started_at = int(clock())
        # Unix seconds once done; 0 while the stream runs (llama-server's lookup says the same).
        self.completed_at = 0
        self.done = False
        # Bytes dropped from the front of the buffer: the stream offset of its first byte.
        self.dropped = 0
        self._buf = bytearray()
        # The stream offset where each appended chunk began: a chunk is one SSE frame, so a
        # Responses stream's frame n is its event of sequence_number n (background resume).
        self._starts: list[int] = []
        self._cap = cap
        self._clock = clock
        self._changed = trio.Event()
        # Entered by the task that runs the body; cancelling it first is fine (it never starts).
        self.scope = trio.CancelScope()

    @property
    def total_bytes(self) -> int:
        return self.dropped + len(self._buf)

    def append(self, data: bytes) -> None:
        if self.done or not data:
            return
        self._starts.append(self.total_bytes)
        self._buf += data
        over = len(self._buf) - self._cap
        if over > 0:
            del self._buf[:over]
            self.dropped += over
        self._wake()

    def offset_after(self, frame: int) -> int:
        """The stream offset just past frame ``frame`` (-1: the start); past the last frame
        so far, the current end, so a reader waits there for what comes."""
        after = frame + 1
        return self._starts[after] if 0 <= after < len(self._starts) else self.total_bytes

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.completed_at = int(self._clock())
            self._wake()

    def cancel(self) -> None:
        """Stop the generation (its body is closed, which aborts it) and end the readers."""
        self.scope.cancel()
        self.finish()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def follow(self, offset: int, ping: float) -> AsyncIterator[bytes]:
        """The stream from byte ``offset``: what is buffered, then what comes, until it ends.

        A keepalive comment goes out after ``ping`` seconds without news. A reader so slow
        that its offset falls off the front of the buffer is ended: it reconnects and is told
        the offset is lost. Cancelling the reader (its client left) leaves the stream running.
        """
        while True:
            if offset < self.dropped:
                return
            if offset < self.total_bytes:
                chunk = bytes(self._buf[offset - self.dropped :])
                offset += len(chunk)
                yield chunk
                continue
            if self.done:
                return
            changed = self._changed
            with trio.move_on_after(ping) as idle:
                await changed.wait()
            if idle.cancelled_caught:
                yield KEEPALIVE


class StreamSessions:
    def __init__(
        self,
        *,
        ttl: float = TTL_S,
        max_bytes: int = MAX_BYTES,
        max_retained: int = MAX_RETAINED,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._ttl = ttl
        self._max_bytes = max_bytes
        self._max_retained = max_retained
        self._clock = clock
        self._sessions: dict[tuple[Owner, str], StreamSession] = {}
        self._nursery: trio.Nursery | None = None
        self._bodies = 0  # bodies still running
        self._body_ended = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the stream bodies and sweep expired sessions. Cancelling it closes every body
        still running, which aborts their generations."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                while True:
                    await trio.sleep(GC_INTERVAL_S)
                    self.sweep()
            finally:
                self._nursery = None

    def __len__(self) -> int:
        return len(self._sessions)

    def attach(
        self,
        owner: Owner,
        conversation_id: str,
        body: AsyncIterator[bytes],
        on_drop: Callable[[], None],
    ) -> StreamSession:
        """Start running ``body`` into a new session; one under the same key is cancelled."""
        if self._nursery is None:
            raise RuntimeError("the stream-sessions actor is not running")
        self.sweep()
        session = StreamSession(conversation_id, self._max_bytes, self._clock)
        previous = self._sessions.pop((owner, conversation_id), None)
        self._sessions[(owner, conversation_id)] = session
        if previous is not None:
            log.info("stream %r replaced: the previous one is cancelled", conversation_id)
            previous.cancel()
        self._bodies += 1
        self._nursery.start_soon(self._drain, session, body, on_drop)
        return session

    async def wait_idle(self) -> None:
        """Until no body runs: the shutdown waits here for background responses, which store
        their final object once their generation has ended."""
        while self._bodies:
            await self._body_ended.wait()

    async def _drain(
        self, session: StreamSession, body: AsyncIterator[bytes], on_drop: Callable[[], None]
    ) -> None:
        try:
            with session.scope:
                async for chunk in body:
                    if chunk != KEEPALIVE:
                        session.append(chunk)
        except Exception:
            log.exception("stream %r failed", session.conversation_id)
        finally:
            # A cancelled body has not run its `finally` yet; closing it does (the generation
            # is aborted there, and a Responses stream stores its result).
            with trio.move_on_after(CLOSE_GRACE_S) as scope:
                scope.shield = True
                aclose = getattr(body, "aclose", None)
                if aclose is not None:
                    await aclose()
            on_drop()
            session.finish()
            self._bodies -= 1
            self._body_ended.set()
            self._body_ended = trio.Event()

    def get(self, owner: Owner, conversation_id: str) -> StreamSession | None:
        self.sweep()
        return self._sessions.get((owner, conversation_id))

    def lookup(self, owner: Owner, ids: Iterable[str]) -> list[StreamSession]:
        """The owner's sessions for these ids: each matches itself and its ``<id>::<model>``
        variants, as llama-server's lookup does. Nothing is listed that was not asked for."""
        self.sweep()
        found: list[StreamSession] = []
        for wanted in ids:
            if not wanted:
                continue
            for (who, cid), session in self._sessions.items():
                if who == owner and (cid == wanted or cid.startswith(wanted + "::")):
                    if session not in found:
                        found.append(session)
        return found

    def evict(self, owner: Owner, conversation_id: str) -> None:
        """Cancel and forget the owner's session; unknown ids (or another's) do nothing."""
        session = self._sessions.pop((owner, conversation_id), None)
        if session is not None:
            session.cancel()

    def sweep(self) -> None:
        """Forget finished sessions past the TTL, and the oldest finished past the cap."""
        cutoff = self._clock() - self._ttl
        finished: list[tuple[int, Any]] = []
        for key, session in list(self._sessions.items()):
            if not session.done:
                continue
            if session.completed_at <= cutoff:
                del self._sessions[key]
            else:
                finished.append((session.completed_at, key))
        excess = len(finished) - self._max_retained
        if excess > 0:
            finished.sort(key=lambda pair: pair[0])
            for _, key in finished[:excess]:
                del self._sessions[key]

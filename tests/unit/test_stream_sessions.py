"""The stream-sessions actor on its own: buffers, readers, replacement, expiry, ownership."""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio
import trio.testing

from mlxcel.actors.stream_sessions import KEEPALIVE, StreamSession, StreamSessions


class Producer:
    """A stream body that says what it is fed, and records how it ended."""

    def __init__(self) -> None:
        self.tx, self.rx = trio.open_memory_channel[bytes](10)
        self.events: list[str] = []

    async def body(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.rx:
                yield chunk
            self.events.append("ended")
        finally:
            self.events.append("closed")

    def on_drop(self) -> None:
        self.events.append("dropped")

    def attach(self, streams: StreamSessions, owner: str = "", cid: str = "c") -> StreamSession:
        return streams.attach(owner, cid, self.body(), self.on_drop)


async def _collect(it: AsyncIterator[bytes], into: list[bytes]) -> None:
    async for chunk in it:
        into.append(chunk)


async def test_readers_get_the_buffer_then_live_bytes_then_the_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    streams = StreamSessions()
    p = Producer()
    async with trio.open_nursery() as nursery:
        await nursery.start(streams.run)
        session = p.attach(streams)
        await p.tx.send(b"data: 1\n\n")
        await trio.sleep(0.1)
        early: list[bytes] = []
        late: list[bytes] = []
        nursery.start_soon(_collect, session.follow(0, 5.0), early)
        await trio.sleep(0.1)
        await p.tx.send(b"data: 2\n\n")
        # Keepalives reach the reader while it waits, but never the buffer.
        await p.tx.send(KEEPALIVE)
        await trio.sleep(12)
        nursery.start_soon(_collect, session.follow(len(b"data: 1\n\n"), 5.0), late)
        await trio.sleep(0.1)
        await p.tx.aclose()
        await trio.sleep(0.1)
        assert session.done and session.total_bytes == 18
        assert b"".join(c for c in early if c != KEEPALIVE) == b"data: 1\n\ndata: 2\n\n"
        assert early.count(KEEPALIVE) == 2  # 12 s idle at a 5 s ping
        assert late == [b"data: 2\n\n"]
        assert p.events == ["ended", "closed", "dropped"]
        nursery.cancel_scope.cancel()


async def test_a_reader_leaving_does_not_stop_the_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    streams = StreamSessions()
    p = Producer()
    async with trio.open_nursery() as nursery:
        await nursery.start(streams.run)
        session = p.attach(streams)
        with trio.move_on_after(1):
            await _collect(session.follow(0, 5.0), [])
        await p.tx.send(b"data: after\n\n")
        await trio.sleep(0.1)
        assert session.total_bytes == len(b"data: after\n\n") and not session.done
        assert p.events == []
        nursery.cancel_scope.cancel()
    # Shutting the actor down closes the body (which aborts its generation).
    assert p.events == ["closed", "dropped"]


async def test_the_buffer_keeps_its_tail_and_a_reader_behind_it_is_ended(
    autojump_clock: trio.testing.MockClock,
) -> None:
    streams = StreamSessions(max_bytes=10)
    p = Producer()
    async with trio.open_nursery() as nursery:
        await nursery.start(streams.run)
        session = p.attach(streams)
        for chunk in (b"aaaa", b"bbbb", b"cccc"):
            await p.tx.send(chunk)
        await trio.testing.wait_all_tasks_blocked()
        assert session.dropped == 2 and session.total_bytes == 12
        got: list[bytes] = []
        await _collect(session.follow(0, 5.0), got)  # offset 0 fell off the front
        assert got == []
        with trio.move_on_after(0.1):
            await _collect(session.follow(2, 5.0), got)
        assert got == [b"aabbbbcccc"]
        nursery.cancel_scope.cancel()


async def test_replacing_or_evicting_cancels_the_old_generation_and_ends_its_readers() -> None:
    streams = StreamSessions()
    first, second = Producer(), Producer()
    async with trio.open_nursery() as nursery:
        await nursery.start(streams.run)
        old = first.attach(streams, "k", "c")
        await first.tx.send(b"x")
        await trio.testing.wait_all_tasks_blocked()
        got: list[bytes] = []
        nursery.start_soon(_collect, old.follow(0, 5.0), got)
        new = second.attach(streams, "k", "c")
        await trio.testing.wait_all_tasks_blocked()
        assert old.done and first.events == ["closed", "dropped"] and got == [b"x"]
        assert streams.get("k", "c") is new and len(streams) == 1
        streams.evict("k", "c")
        await trio.testing.wait_all_tasks_blocked()
        assert new.done and second.events == ["closed", "dropped"]
        assert streams.get("k", "c") is None
        streams.evict("k", "c")  # idempotent
        nursery.cancel_scope.cancel()


async def test_a_session_cancelled_before_its_body_runs_says_nothing_and_cleans_up() -> None:
    streams = StreamSessions()
    p = Producer()
    await p.tx.send(b"never read")
    async with trio.open_nursery() as nursery:
        await nursery.start(streams.run)
        session = p.attach(streams)
        streams.evict("", "c")  # before the actor's task ever ran
        await trio.testing.wait_all_tasks_blocked()
        assert session.done and session.total_bytes == 0
        assert p.events == ["closed", "dropped"]
        nursery.cancel_scope.cancel()


async def test_finished_sessions_expire_and_the_oldest_go_past_the_cap() -> None:
    now = [1000.0]
    streams = StreamSessions(ttl=300, max_retained=2, clock=lambda: now[0])
    async with trio.open_nursery() as nursery:
        await nursery.start(streams.run)
        producers = [Producer() for _ in range(4)]
        for i, p in enumerate(producers[:3]):
            p.attach(streams, "", f"c{i}")
            await p.tx.aclose()
            await trio.testing.wait_all_tasks_blocked()
            now[0] += 10
        live = producers[3]
        live.attach(streams, "", "live")
        await trio.testing.wait_all_tasks_blocked()
        # Three finished, two may stay: the oldest (c0) goes; the live one is never swept.
        assert [s.conversation_id for s in streams.lookup("", ["c0", "c1", "c2", "live"])] == [
            "c1",
            "c2",
            "live",
        ]
        now[0] += 300
        assert streams.get("", "c1") is None and streams.get("", "c2") is None
        assert streams.get("", "live") is not None
        nursery.cancel_scope.cancel()


async def test_lookup_sees_only_the_owners_sessions_and_model_variants() -> None:
    streams = StreamSessions()
    async with trio.open_nursery() as nursery:
        await nursery.start(streams.run)
        for owner, cid in [("a", "c"), ("a", "c::m"), ("a", "cc"), ("b", "c")]:
            p = Producer()
            p.attach(streams, owner, cid)
        assert sorted(s.conversation_id for s in streams.lookup("a", ["c", ""])) == ["c", "c::m"]
        assert [s.conversation_id for s in streams.lookup("b", ["c", "c::m"])] == ["c"]
        assert streams.lookup("", ["c"]) == []
        streams.evict("b", "c::m")  # not b's: nothing happens
        assert len(streams.lookup("a", ["c"])) == 2
        nursery.cancel_scope.cancel()

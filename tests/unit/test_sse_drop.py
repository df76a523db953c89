"""A stream body dropped before its first byte still aborts its generation."""

from __future__ import annotations

import gc

from mlxcel.http import sse


async def test_body_dropped_before_it_starts_runs_on_drop() -> None:
    # A client that leaves between the handler's return and the first byte: Quart never starts
    # the body generator, so its `finally` cannot run; on_drop must.
    dropped: list[str] = []

    async def body():  # type: ignore[no-untyped-def]
        try:
            yield b"data: 1\n\n"
        finally:
            dropped.append("finally")

    response = sse.response(body(), lambda: dropped.append("on_drop"))
    assert response.mimetype == "text/event-stream"
    del response
    gc.collect()
    assert dropped == ["on_drop"]


async def test_body_that_ran_cleans_up_in_finally_first() -> None:
    events: list[str] = []

    async def body():  # type: ignore[no-untyped-def]
        try:
            yield b"data: 1\n\n"
        finally:
            events.append("finally")

    response = sse.response(body(), lambda: events.append("on_drop"))
    async with response.response as chunks:
        assert [c async for c in chunks] == [b"data: 1\n\n"]
    del response, chunks
    gc.collect()
    assert events == ["finally", "on_drop"]

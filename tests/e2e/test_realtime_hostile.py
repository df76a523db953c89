"""/v1/realtime against slow and hostile clients (issue 39, item 4), on the real server (tiny
chat model, Whisper, Piper) with trio-websocket clients: one that never reads what the server
sends, one that sends far more audio than any turn could use, far faster than real time, and
one that reconnects in a loop, dropping each session mid-turn. Each is bounded, the session
next to it is still answered, and nothing it started is left running once it has gone."""

from __future__ import annotations

import base64
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio_websocket

from tests.conftest import ServerProcess
from tests.support.metrics import sample, wait_for
from tests.support.realtime import Client, connect, spoken

SEND_TIMEOUT = 1.0
SETUP = {"system_prompt": "Answer briefly.", "max_response_output_tokens": 12, "seed": "7"}
# The uncommitted input audio a session may hold (120 s at 16 kHz, float32), and its outbox.
MAX_INPUT_BYTES = 120 * 16_000 * 4
MAX_OUTPUT_BYTES = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        [
            "-m",
            str(tiny_model_dir),
            "--metrics",
            "--realtime-send-timeout-secs",
            str(SEND_TIMEOUT),
        ]
    )
    yield server
    server.stop()


def buffered(base: str, direction: str) -> float:
    value = sample(base, "mlxcel_realtime_buffered_bytes", direction=direction)
    assert value is not None
    return value


def dropped(base: str) -> float | None:
    return sample(base, "mlxcel_realtime_dropped_sessions_total", reason="send_timeout")


def nothing_left_running(base: str) -> None:
    """Wait until no session, speech job or generation is left (each bounded by a deadline)."""
    wait_for(base, "mlxcel_realtime_sessions_open", lambda v: v == 0, timeout=30)
    for worker in ("speech-to-text", "text-to-speech"):
        for state in ("held", "waiting"):
            wait_for(base, "mlxcel_audio_jobs", lambda v: v == 0, worker=worker, state=state)
    wait_for(base, "llamacpp:requests_processing", lambda v: v == 0, timeout=30)
    wait_for(base, "llamacpp:requests_deferred", lambda v: v == 0, timeout=30)
    for direction in ("input", "output"):
        assert buffered(base, direction) == 0


async def ask(base: str, text: str = "Name a colour.") -> list[dict[str, Any]]:
    """A well-behaved session: one spoken answer to a typed question, read as it comes."""
    async with connect(base) as c:
        assert (await c.recv())["type"] == "session.created"
        await c.send({"type": "session.update", "session": {**SETUP, "multi_turn": True}})
        assert (await c.recv())["type"] == "session.updated"
        await c.send(
            {
                "type": "conversation.item.create",
                "item": {"role": "user", "content": [{"type": "input_text", "text": text}]},
            }
        )
        await c.send({"type": "response.create"})
        return await c.until("response.done", timeout=120)


def answered(events: list[dict[str, Any]]) -> bool:
    return events[-1]["response"]["status"] == "completed" and any(
        e["type"] == "response.audio.delta" for e in events
    )


@contextlib.asynccontextmanager
async def raw_client(base: str, *, receive_buffer: int | None = None) -> AsyncIterator[Client]:
    """A WebSocket on a socket we own: optionally with a tiny receive buffer (so a client that
    stops reading fills its TCP window at once), dropped at the end without a close handshake
    (a reset, as when a client's process or network dies)."""
    host, _, port = base.removeprefix("http://").partition(":")
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    try:
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(nursery, stream, host, "/v1/realtime")
            yield Client(ws)
            nursery.cancel_scope.cancel()
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()


async def test_a_client_that_never_reads_is_dropped_and_the_other_is_served(
    server: ServerProcess,
) -> None:
    base = server.base_url
    peak = 0.0
    async with raw_client(base, receive_buffer=4096) as hostile:
        assert (await hostile.recv())["type"] == "session.created"
        # A long spoken answer, then the client reads nothing more (trio-websocket stops
        # reading the socket once one message waits unread).
        setup = {"multi_turn": True, "max_response_output_tokens": 200, "seed": "1"}
        await hostile.send({"type": "session.update", "session": setup})
        await hostile.send(
            {
                "type": "conversation.item.create",
                "item": {"role": "user", "content": [{"type": "input_text", "text": "Go on."}]},
            }
        )
        await hostile.send({"type": "response.create"})
        async with trio.open_nursery() as n:
            result: list[list[dict[str, Any]]] = []

            async def other() -> None:
                result.append(await ask(base))

            n.start_soon(other)
            with trio.fail_after(60):
                while not await trio.to_thread.run_sync(dropped, base):
                    peak = max(peak, await trio.to_thread.run_sync(buffered, base, "output"))
                    await trio.sleep(0.1)
        assert answered(result[0]), result[0][-1]
        # The dropped client finds its connection reset: no close frame could reach it.
        with trio.fail_after(30), pytest.raises(trio_websocket.ConnectionClosed) as closed:
            while True:
                await hostile.recv()
        assert closed.value.reason.code == 1006
    assert peak <= MAX_OUTPUT_BYTES
    await trio.to_thread.run_sync(nothing_left_running, base)
    assert "Traceback" not in server.log()


async def test_far_too_much_audio_is_refused_in_band_and_the_session_goes_on(
    server: ServerProcess,
) -> None:
    base = server.base_url
    # 24 s a message (just under the 1 MiB message cap), sent as fast as the socket takes it:
    # six of them are 144 s of audio in well under a second.
    chunk = np.full(24 * 16_000, 300, np.int16)
    async with connect(base) as c:
        assert (await c.recv())["type"] == "session.created"
        await c.send({"type": "session.update", "session": {**SETUP, "multi_turn": True}})
        assert (await c.recv())["type"] == "session.updated"
        for _ in range(6):
            await c.send({"type": "input_audio_buffer.append", "audio": b64(chunk)})
        refused = await c.recv(timeout=30)
        assert refused["type"] == "error", refused
        assert refused["error"]["code"] == "input_audio_buffer_full"
        held = await trio.to_thread.run_sync(buffered, base, "input")
        assert held == MAX_INPUT_BYTES  # the five that fit, and not a byte more
        await c.send({"type": "input_audio_buffer.clear"})
        assert (await c.recv())["type"] == "input_audio_buffer.cleared"
        # The session goes on: the next turn is heard and answered.
        await c.append(spoken())
        await c.send({"type": "input_audio_buffer.commit"})
        events = await c.until("response.done", timeout=120)
    transcript = next(
        e["transcript"]
        for e in events
        if e["type"] == "conversation.item.input_audio_transcription.completed"
    )
    assert "france" in transcript.lower()
    assert answered(events)
    await trio.to_thread.run_sync(nothing_left_running, base)


async def test_a_client_reconnecting_in_a_loop_leaves_nothing_running(
    server: ServerProcess,
) -> None:
    base = server.base_url
    question = spoken()
    # Each session is dropped at a later point of its turn: as it is transcribed, as its
    # answer starts, as its first audio arrives.
    drop_at = ["input_audio_buffer.committed", "response.created", "response.audio.delta"] * 2
    result: list[list[dict[str, Any]]] = []

    async def other() -> None:
        result.append(await ask(base))

    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            n.start_soon(other)
            for kind in drop_at:
                async with raw_client(base) as c:
                    assert (await c.recv())["type"] == "session.created"
                    setup = {**SETUP, "max_response_output_tokens": 200}
                    await c.send({"type": "session.update", "session": setup})
                    await c.append(question)
                    await c.send({"type": "input_audio_buffer.commit"})
                    await c.until(kind)
    assert answered(result[0]), result[0][-1]
    await trio.to_thread.run_sync(nothing_left_running, base)
    assert "Traceback" not in server.log()


def b64(pcm: np.ndarray) -> str:
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode()

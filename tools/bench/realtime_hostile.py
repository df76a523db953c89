"""A well-behaved realtime voice session beside slow and hostile clients (issue 39, item 4).

Starts ``mlxcel serve`` on the tiny test model (packaged Whisper and Piper) and measures one
session's time from ``response.create`` to its first ``response.audio.delta``, for
``--answers`` typed questions: first alone, then beside the chosen hostile clients, in the
same run:

- ``non_reader``: asks for a long spoken answer, then reads nothing (reconnects once dropped);
- ``flooder``: sends 24 s audio messages (just under the 1 MiB message cap) as fast as the
  socket takes them, clearing the buffer after each;
- ``looper``: opens a session, speaks a question, drops the connection at the first audio of
  the answer, and again.

    .venv/bin/python tools/bench/realtime_hostile.py --hostile flooder
    .venv/bin/python tools/bench/realtime_hostile.py --hostile non_reader flooder looper
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import trio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import ServerProcess  # noqa: E402 - after sys.path
from tests.e2e.test_realtime_hostile import b64, raw_client  # noqa: E402 - after sys.path
from tests.support.realtime import connect, spoken  # noqa: E402 - after sys.path
from tests.support.tiny_model import build_tiny_model  # noqa: E402 - after sys.path

SETUP = {"system_prompt": "Answer briefly.", "max_response_output_tokens": 24, "seed": "7"}


def item(text: str) -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "item": {"role": "user", "content": [{"type": "input_text", "text": text}]},
    }


async def good(base: str, answers: int) -> list[float]:
    """Seconds from response.create to the first audio, one per answer."""
    firsts = []
    async with connect(base) as c:
        await c.recv()
        await c.send({"type": "session.update", "session": {**SETUP, "multi_turn": True}})
        await c.recv()
        for _ in range(answers):
            await c.send(item("Name a colour."))
            await c.send({"type": "response.create"})
            start, first = time.monotonic(), None
            while (event := await c.recv(120))["type"] != "response.done":
                if event["type"] == "response.audio.delta" and first is None:
                    first = time.monotonic() - start
            assert first is not None, "an answer without audio"
            firsts.append(first)
            await trio.sleep(0.5)
    return firsts


async def non_reader(base: str) -> None:
    while True:
        async with raw_client(base, receive_buffer=4096) as c:
            await c.recv()
            setup = {"multi_turn": True, "max_response_output_tokens": 200}
            await c.send({"type": "session.update", "session": setup})
            await c.send(item("Go on."))
            await c.send({"type": "response.create"})
            with trio.move_on_after(30):
                while True:  # pings are read by the server even while it cannot write
                    await trio.sleep(0.5)
                    await c.ws.ping()


async def flooder(base: str) -> None:
    chunk = b64(np.full(24 * 16_000, 300, np.int16))
    async with connect(base) as c:
        await c.recv()
        await c.send({"type": "session.update", "session": {**SETUP, "multi_turn": True}})
        await c.recv()
        while True:
            await c.send({"type": "input_audio_buffer.append", "audio": chunk})
            await c.send({"type": "input_audio_buffer.clear"})


async def looper(base: str) -> None:
    question = spoken()
    while True:
        async with raw_client(base) as c:
            await c.recv()
            setup = {**SETUP, "max_response_output_tokens": 200}
            await c.send({"type": "session.update", "session": setup})
            await c.append(question)
            await c.send({"type": "input_audio_buffer.commit"})
            await c.until("response.audio.delta", timeout=120)


HOSTILE: dict[str, Callable[[str], Awaitable[None]]] = {
    "non_reader": non_reader,
    "flooder": flooder,
    "looper": looper,
}


async def measure(base: str, hostile: list[str], answers: int) -> None:
    await good(base, 2)  # the voices' first use
    alone = await good(base, answers)
    async with trio.open_nursery() as n:
        for name in hostile:
            n.start_soon(HOSTILE[name], base)
        await trio.sleep(2)
        beside = await good(base, answers)
        n.cancel_scope.cancel()
    for label, xs in (("alone", alone), (f"beside {' + '.join(hostile)}", beside)):
        print(
            f"{label}: first audio median {statistics.median(xs):.2f} s, "
            f"max {max(xs):.2f} s ({len(xs)} answers)"
        )
    print(f"ratio (median): {statistics.median(beside) / statistics.median(alone):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hostile", nargs="+", choices=sorted(HOSTILE), required=True)
    parser.add_argument("--answers", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-llama")
        server = ServerProcess(["-m", str(model), "--metrics"])
        try:
            trio.run(measure, server.base_url, args.hostile, args.answers)
        finally:
            server.stop()


if __name__ == "__main__":
    main()

"""SIGTERM with live streams of every family, and kill -9 while stored Responses are written,
against real `mlxcel serve` processes (tiny random llama)."""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio_websocket

from tests.conftest import ServerProcess
from tests.support.metrics import wait_for
from tests.support.realtime import connect

LONG = 6000
GRACE = 6.0
PROMPT = "Tell me a long story."
# The tiny model's end-of-text ids (<|endoftext|>, <|im_end|>): banned where a family has no
# ignore_eos, so every generation is still running at SIGTERM.
NO_EOS = {"0": -100, "2": -100}
CHAT = [{"role": "user", "content": PROMPT}]

# (name, path, body): all streamed, all far longer than the grace period.
STREAMS: list[tuple[str, str, dict[str, Any]]] = [
    ("chat", "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True}),
    (
        "chat+usage",
        "/v1/chat/completions",
        {"messages": CHAT, "ignore_eos": True, "stream_options": {"include_usage": True}},
    ),
    ("completions", "/v1/completions", {"prompt": PROMPT, "ignore_eos": True}),
    ("anthropic", "/v1/messages", {"messages": CHAT, "ignore_eos": True}),
    ("responses", "/v1/responses", {"input": PROMPT, "logit_bias": NO_EOS}),
    (
        "responses+store",
        "/v1/responses",
        {"input": PROMPT, "logit_bias": NO_EOS, "store": True},
    ),
    ("native", "/completion", {"prompt": PROMPT, "ignore_eos": True}),
]


def stream_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    length = {
        "/v1/messages": "max_tokens",
        "/v1/responses": "max_output_tokens",
        "/completion": "n_predict",
    }.get(path, "max_tokens")
    return {"model": "default", "stream": True, length: LONG, **body}


def sse_events(raw: str) -> list[tuple[str | None, str]]:
    """(event name, data) for each SSE frame; keepalive comments are skipped."""
    events = []
    for frame in raw.split("\n\n"):
        name, data = None, []
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            events.append((name, "\n".join(data)))
    return events


def assert_ended_properly(name: str, raw: str) -> None:
    """The stream's last events are its family's final event with a cut-answer reason and its
    terminator, exactly as a client that reached max_tokens would see them."""
    events = sse_events(raw)
    assert len(events) > 3, (name, raw[-500:])
    last_name, last = events[-1]
    if name.startswith(("chat", "completions")):
        assert last == "[DONE]", (name, raw[-500:])
        finishes = [
            c["finish_reason"]
            for _, d in events[:-1]
            for c in json.loads(d)["choices"]
            if c["finish_reason"] is not None
        ]
        assert finishes == ["length"], (name, finishes)
        if name == "chat+usage":
            usage = json.loads(events[-2][1])["usage"]
            assert usage["completion_tokens"] > 0
    elif name == "anthropic":
        assert last_name == "message_stop", (name, raw[-500:])
        delta = json.loads(events[-2][1])
        assert events[-2][0] == "message_delta"
        assert delta["delta"]["stop_reason"] == "max_tokens"
        assert delta["usage"]["output_tokens"] > 0
    elif name.startswith("responses"):
        final = json.loads(last)
        assert last_name == "response.incomplete", (name, raw[-500:])
        assert final["response"]["status"] == "incomplete"
        assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
        assert final["response"]["output"][0]["content"][0]["text"]
    else:
        final = json.loads(last)
        assert final["stop"] is True and final["stop_type"] == "limit", (name, final)
        assert final["tokens_predicted"] > 0


async def read_stream(
    client: httpx.AsyncClient, name: str, path: str, body: dict[str, Any], results: dict[str, Any]
) -> None:
    started: trio.Event = results["started"][name]
    async with client.stream("POST", path, json=stream_body(path, body)) as r:
        assert r.status_code == 200, (name, await r.aread())
        raw = ""
        async for text in r.aiter_text():
            raw += text
            # Running: some output came after the opening events.
            if not started.is_set() and len(sse_events(raw)) > 4:
                started.set()
    results["raw"][name] = raw
    results["ended_at"][name] = time.monotonic()


async def busy_slots(client: httpx.AsyncClient) -> int:
    return sum(1 for s in (await client.get("/slots")).json() if s["is_processing"])


async def health_status(client: httpx.AsyncClient) -> int:
    return (await client.get("/health")).status_code


async def poll(probe: Callable[[], Awaitable[int]], want: int) -> None:
    """Ask the server (another process) until ``probe`` gives ``want``, as a probe would."""
    with trio.fail_after(30):
        while await probe() != want:  # noqa: ASYNC110 - another process: no event to await
            await trio.sleep(0.05)


async def non_streamed(client: httpx.AsyncClient, results: dict[str, Any]) -> None:
    body = {"model": "default", "messages": CHAT, "max_tokens": LONG, "ignore_eos": True}
    results["plain"] = await client.post("/v1/chat/completions", json=body)


async def realtime_close(base_url: str, results: dict[str, Any]) -> None:
    async with connect(base_url) as c:
        assert (await c.recv())["type"] == "session.created"
        results["ws_open"].set()
        try:
            while True:
                await c.recv()
        except trio_websocket.ConnectionClosed as closed:
            results["ws_close"] = closed.reason
        results["ws_events"] = c.events


@pytest.fixture
def draining_server(tiny_model_dir: Path, tmp_path: Path) -> Any:
    server = ServerProcess(
        [
            "-m",
            str(tiny_model_dir),
            "--parallel",
            str(len(STREAMS) + 1),
            "-c",
            "8192",
            "--graceful-timeout",
            str(GRACE),
            "--cache-dir",
            str(tmp_path),
            "--sse-ping-interval",
            "1",
            "--no-warmup",
        ]
    )
    yield server
    server.stop()


async def test_sigterm_ends_every_stream_properly_then_exits_0(
    draining_server: ServerProcess, tmp_path: Path
) -> None:
    server = draining_server
    results: dict[str, Any] = {
        "started": {name: trio.Event() for name, _, _ in STREAMS},
        "raw": {},
        "ended_at": {},
        "ws_open": trio.Event(),
    }
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as client:
        async with trio.open_nursery() as n:
            n.start_soon(realtime_close, server.base_url, results)
            for name, path, body in STREAMS:
                n.start_soon(read_stream, client, name, path, body, results)
            n.start_soon(non_streamed, client, results)
            with trio.fail_after(60):
                for event in results["started"].values():
                    await event.wait()
                await results["ws_open"].wait()
                # The non-streamed request is running too: every slot is busy.
                await poll(lambda: busy_slots(client), len(STREAMS) + 1)
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # Draining: out of the load balancer's rotation, and new work is turned away.
            await poll(lambda: health_status(client), 503)
            health = await client.get("/health")
            refused = await client.post(
                "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}
            )
        code = await trio.to_thread.run_sync(lambda: server.proc.wait(timeout=30))
    exited = time.monotonic() - signalled

    assert health.status_code == 503
    assert health.json()["error"]["code"] == 503
    assert "shutting down" in health.json()["error"]["message"]
    assert health.headers["Retry-After"] == "1"
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "unavailable_error"
    assert refused.headers["Retry-After"] == "1"

    for name, _, _ in STREAMS:
        assert_ended_properly(name, results["raw"][name])
        # Ended within the grace period, not by Hypercorn cutting the connection after it.
        assert results["ended_at"][name] - signalled < GRACE, name
    plain = results["plain"]
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["finish_reason"] == "length"
    assert 0 < plain.json()["usage"]["completion_tokens"] < LONG

    close = results["ws_close"]
    assert (close.code, close.reason) == (1001, "server shutting down")
    assert results["ws_events"][-1]["error"]["code"] == "server_shutting_down"

    assert code == 0
    assert exited < GRACE + 3

    # The cut Responses stream asked to be stored: it is, as incomplete.
    stored_id = json.loads(sse_events(results["raw"]["responses+store"])[-1][1])["response"]["id"]
    db = sqlite3.connect(tmp_path / "sessions.sqlite3")
    try:
        (row,) = db.execute("SELECT body FROM responses WHERE id = ?", (stored_id,)).fetchone()
    finally:
        db.close()
    assert json.loads(row)["response"]["status"] == "incomplete"


def test_kill_9_while_storing_responses_loses_no_acknowledged_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    args = ["-m", str(tiny_model_dir), "--cache-dir", str(tmp_path), "--parallel", "4"]
    args += ["--no-warmup", "--no-audio"]
    first = ServerProcess(args)
    acknowledged: list[tuple[str, str]] = []
    stop = threading.Event()

    def writer(seed: int) -> None:
        with httpx.Client(base_url=first.base_url, timeout=30) as client:
            while not stop.is_set():
                body = {"input": f"Note {seed}.", "max_output_tokens": 4, "store": True}
                try:
                    r = client.post("/v1/responses", json=body)
                except httpx.TransportError:
                    return  # the server is gone: this one was never acknowledged
                if r.status_code == 200:
                    acknowledged.append((r.json()["id"], r.json()["output_text"]))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(acknowledged) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    first.proc.kill()  # mid-write: requests are in flight on every thread
    stop.set()
    for t in threads:
        t.join(30)
    first.stop()
    assert len(acknowledged) >= 12

    second = ServerProcess(args)
    try:
        with httpx.Client(base_url=second.base_url, timeout=30) as client:
            for rid, text in acknowledged:
                got = client.get(f"/v1/responses/{rid}")
                assert got.status_code == 200, (rid, got.text)
                assert got.json()["output_text"] == text
    finally:
        second.stop()
    db = sqlite3.connect(tmp_path / "sessions.sqlite3")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        db.close()


def test_sigterm_lets_a_speech_request_in_flight_finish(tiny_model_dir: Path) -> None:
    """Not a generation: admission does not know it, the drain still waits for it."""
    server = ServerProcess(
        ["-m", str(tiny_model_dir), "--graceful-timeout", "20", "--no-warmup", "--metrics"]
    )
    text = " ".join(f"This is sentence number {i}." for i in range(8))
    result: dict[str, Any] = {}

    def speak() -> None:
        try:
            result["r"] = httpx.post(
                f"{server.base_url}/v1/audio/speech",
                json={"input": text, "voice": "alloy", "response_format": "wav"},
                timeout=60,
            )
        except httpx.HTTPError as error:
            result["error"] = error

    t = threading.Thread(target=speak)
    t.start()
    # In flight: the speech request and this scrape (the voice then needs seconds).
    wait_for(server.base_url, "mlxcel_http_requests_in_flight", lambda v: v >= 2)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    code = server.proc.wait(timeout=30)
    server.stop()
    assert "error" not in result, result
    assert result["r"].status_code == 200
    assert result["r"].content.startswith(b"RIFF") and len(result["r"].content) > 50_000
    assert code == 0

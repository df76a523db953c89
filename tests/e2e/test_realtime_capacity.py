"""/v1/realtime past capacity (issue 39): more clients than ``--realtime-max-sessions``, each
speaking one question at the same moment, against speech workers with room for one job each
(``--audio-queue-depth 1``). The refused ones are refused at open; every admitted session's
turn is transcribed and answered with audio, however long its turn waits for the workers.
That cap is above what the workers carry at real-time pace (one session), so the server warns
at start, naming both numbers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess
from tests.support.realtime import Client, connect, spoken

CAP = 3
CLIENTS = 5
SETUP = {"system_prompt": "Answer briefly.", "max_response_output_tokens": 12, "seed": "7"}


@pytest.fixture(scope="module")
def crowded(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        [
            "-m",
            str(tiny_model_dir),
            "--realtime-max-sessions",
            str(CAP),
            "--parallel",
            str(CAP),
            "--audio-queue-depth",
            "1",
            "--metrics",
        ]
    )
    yield server
    server.stop()


def audio_metrics(
    base: str, prefix: str = "mlxcel_audio"
) -> dict[str, dict[tuple[str, ...], float]]:
    """The speech workers' families from /metrics: {sample name: {labels: value}}."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    found: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(prefix):
            for s in family.samples:
                key = tuple(f"{k}={v}" for k, v in sorted(s.labels.items()))
                found.setdefault(s.name, {})[key] = s.value
    return found


def session_metrics(base: str) -> dict[str, dict[tuple[str, ...], float]]:
    """The realtime session gauges from /metrics."""
    return audio_metrics(base, "mlxcel_realtime")


async def test_every_admitted_turn_is_answered_past_capacity(crowded: ServerProcess) -> None:
    question = spoken()
    opened: list[str] = []
    all_opened = trio.Event()
    outcomes: list[tuple[str, list[dict[str, Any]], int | None]] = []

    async def client() -> None:
        async with connect(crowded.base_url) as c:
            first = await c.recv()
            opened.append(first["type"])
            if len(opened) == CLIENTS:
                all_opened.set()
            if first["type"] == "error":
                outcomes.append(("refused", [first], await c.closed()))
                return
            # Stay open until every client has been admitted or refused, so that exactly
            # CAP sessions are open at once; then all speak at the same moment.
            await all_opened.wait()
            await c.send({"type": "session.update", "session": SETUP})
            assert (await c.recv())["type"] == "session.updated"
            await c.append(question)
            await c.send({"type": "input_audio_buffer.commit"})
            events = await until_done(c)
            outcomes.append(("admitted", events, await c.closed()))

    crowd: dict[str, dict[tuple[str, ...], float]] = {}

    async def watch() -> None:
        # While the admitted sessions are open (their turns take seconds): the gauge says so.
        await all_opened.wait()
        crowd.update(await trio.to_thread.run_sync(session_metrics, crowded.base_url))

    with trio.fail_after(240):
        async with trio.open_nursery() as n:
            n.start_soon(watch)
            for _ in range(CLIENTS):
                n.start_soon(client)

    refused = [o for o in outcomes if o[0] == "refused"]
    admitted = [o for o in outcomes if o[0] == "admitted"]
    assert len(admitted) == CAP and len(refused) == CLIENTS - CAP
    for _, (busy,), code in refused:
        assert busy["error"]["code"] == "server_busy" and code == 1013
    for _, events, code in admitted:
        kinds = [e["type"] for e in events]
        # No turn lost to a busy worker, no session ended by one.
        assert "error" not in kinds, [e for e in events if e["type"] == "error"]
        transcript = next(
            e["transcript"]
            for e in events
            if e["type"] == "conversation.item.input_audio_transcription.completed"
        )
        assert "france" in transcript.lower()
        assert "response.audio.delta" in kinds
        assert events[-1]["response"]["status"] == "completed"
        assert code == 1000  # the one-shot session's normal end, not 1011
    # The turns met a full queue and waited in line: /metrics shows it, and the line is gone.
    m = await trio.to_thread.run_sync(audio_metrics, crowded.base_url)
    stt = ("worker=speech-to-text",)
    waits = m["mlxcel_audio_wait_seconds_count"]
    assert waits[stt] >= CAP and waits[("worker=text-to-speech",)] >= CAP
    at_once = m["mlxcel_audio_wait_seconds_bucket"][("le=0.0", "worker=speech-to-text")]
    assert at_once < waits[stt], "no turn waited: the test did not crowd the worker"
    assert m["mlxcel_audio_jobs"][("state=waiting", "worker=speech-to-text")] == 0
    assert m["mlxcel_audio_refused_total"][stt] == 0
    # Sessions open against the cap, during the crowd and after it.
    assert crowd["mlxcel_realtime_sessions_open"][()] == CAP
    assert crowd["mlxcel_realtime_sessions_limit"][()] == CAP
    assert crowd["mlxcel_realtime_sessions_capacity"][()] == 1
    after = await trio.to_thread.run_sync(session_metrics, crowded.base_url)
    assert after["mlxcel_realtime_sessions_open"][()] == 0


def test_a_cap_above_the_capacity_is_warned_about_at_start(crowded: ServerProcess) -> None:
    log = crowded.log()
    assert "realtime voice sessions at once: 3 (--realtime-max-sessions)" in log
    warning = next(line for line in log.splitlines() if "is above the" in line)
    assert "WARNING" in warning
    assert "--realtime-max-sessions 3 is above the 1 realtime sessions" in warning
    assert "Raise --audio-queue-depth to 3" in warning  # --parallel 3 carries 3 already
    caps = httpx.get(f"{crowded.base_url}/props", timeout=30).json()["capabilities"]
    assert caps["realtime"]["max_sessions"] == CAP and caps["realtime"]["capacity"] == 1


async def until_done(c: Client) -> list[dict[str, Any]]:
    """Events up to the turn's end: its answer's ``response.done``, or an ``error``."""
    seen = []
    while True:
        event = await c.recv(timeout=180)
        seen.append(event)
        if event["type"] in ("response.done", "error"):
            return seen

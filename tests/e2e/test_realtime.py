"""/v1/realtime against `mlxcel serve` (tiny chat model, packaged Whisper tiny.en and Piper
voice), with trio-websocket as the client. The question is spoken by the Piper voice in the
test and sent as 16 kHz PCM16 in 80 ms frames, as a microphone client would."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio
import trio_websocket
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess
from tests.support.realtime import Client, connect, frames, silence, spoken

SETUP = {"system_prompt": "Answer briefly.", "max_response_output_tokens": 16, "seed": "7"}
VAD = {"type": "server_vad", "silence_duration_ms": 400}


def words(text: str) -> str:
    return text.lower().replace("?", "").replace(",", "")


async def configure(c: Client, **extra: object) -> dict[str, object]:
    created = await c.recv()
    assert created["type"] == "session.created"
    await c.send({"type": "session.update", "session": {**SETUP, **extra}})
    updated = await c.recv()
    assert updated["type"] == "session.updated", updated
    return updated


def pcm_of(events: list[dict[str, object]]) -> np.ndarray:
    raw = b"".join(base64.b64decode(str(e["delta"])) for e in events)
    assert len(raw) % 2 == 0
    return np.frombuffer(raw, "<i2")


async def test_commit_turn_transcribes_answers_and_speaks(tiny_server: ServerProcess) -> None:
    async with connect(tiny_server.base_url) as c:
        created = await c.recv()
        assert created["type"] == "session.created"
        assert created["session"]["state"] == "configuring"
        assert created["session"]["id"].startswith("sess_")
        assert created["event_id"].startswith("event_")
        await c.send({"type": "session.update", "session": SETUP})
        updated = await c.recv()
        assert updated["session"]["state"] == "ready"
        assert updated["session"]["frame_samples"] == 1280
        assert updated["session"]["output_audio_format"] == {"type": "pcm16", "sample_rate": 22050}
        assert updated["session"]["seed"] == 7
        await c.append(spoken())
        await c.send({"type": "input_audio_buffer.commit"})
        events = await c.until("response.done", timeout=240)
        code = await c.closed()
    kinds = [e["type"] for e in events]
    assert kinds[0] == "input_audio_buffer.committed"
    transcript = next(
        e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"
    )
    assert "capital" in words(transcript["transcript"])
    assert "france" in words(transcript["transcript"])
    texts = [e for e in events if e["type"] == "response.text.delta"]
    assert texts and texts[-1]["text"] == "".join(t["delta"] for t in texts)
    audio = [e for e in events if e["type"] == "response.audio.delta"]
    assert audio and all(a["sample_rate"] == 22050 and a["format"] == "pcm16" for a in audio)
    pcm = pcm_of(audio)
    assert pcm.size > 22050 // 10 and np.abs(pcm).max() > 1000  # a voice, not silence
    assert kinds.index("response.text.delta") < kinds.index("response.audio.delta")
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["text"] == texts[-1]["text"]
    assert all("frame_index" in e for e in events)
    # The seed's one-shot session: closed normally once the committed turn is answered.
    assert code == 1000


async def test_a_session_without_instructions_answers(tiny_server: ServerProcess) -> None:
    # Clients (the OpenAI SDK's among them) often set no instructions at all.
    async with connect(tiny_server.base_url) as c:
        await c.recv()
        setup = {"max_response_output_tokens": 8, "seed": "7"}
        await c.send({"type": "session.update", "session": setup})
        assert (await c.recv())["type"] == "session.updated"
        await c.append(spoken())
        await c.send({"type": "input_audio_buffer.commit"})
        events = await c.until("response.done", timeout=240)
    assert not [e for e in events if e["type"] == "error"], events
    assert events[-1]["response"]["status"] == "completed"
    assert any(e["type"] == "response.text.delta" for e in events)


async def test_server_vad_turns_without_commit_keep_history(tiny_server: ServerProcess) -> None:
    question = np.concatenate([silence(0.4), spoken(), silence(0.8)])
    async with connect(tiny_server.base_url) as c:
        updated = await configure(c, turn_detection=VAD)
        assert updated["session"]["multi_turn"] is True
        usage = []
        for _ in range(2):
            await c.append(question)
            events = await c.until("response.done", timeout=240)
            kinds = [e["type"] for e in events]
            assert kinds.index("input_audio_buffer.speech_started") < kinds.index(
                "input_audio_buffer.speech_stopped"
            )
            assert "input_audio_buffer.committed" in kinds
            transcript = next(
                e["transcript"]
                for e in events
                if e["type"] == "conversation.item.input_audio_transcription.completed"
            )
            assert "france" in words(transcript)
            assert events[-1]["response"]["status"] == "completed"
            usage.append(events[-1]["response"]["usage"]["input_tokens"])
        # The second prompt carries the first exchange: the session keeps its conversation.
        assert usage[1] > usage[0] + 8
        await c.send({"type": "session.ping"})
        assert (await c.until("session.pong"))[-1]["type"] == "session.pong"


async def test_barge_in_cancels_the_answer_and_the_next_turn_works(
    tiny_server: ServerProcess,
) -> None:
    question = np.concatenate([spoken(), silence(0.8)])
    async with connect(tiny_server.base_url) as c:
        await configure(c, turn_detection=VAD, max_response_output_tokens=200)
        await c.append(question)
        before = await c.until("response.created", timeout=240)
        assert "input_audio_buffer.speech_stopped" in [e["type"] for e in before]
        # The user talks over the answer (a long one: 200 tokens to generate and speak).
        await c.append(question)
        events = await c.until("response.cancelled", timeout=120)
        kinds = [e["type"] for e in events]
        started = kinds.index("input_audio_buffer.speech_started")
        cancel_gap = c.arrivals[-1] - c.arrivals[len(c.events) - len(events) + started]
        # Audio still queued for the old answer is dropped, not sent after the user spoke.
        assert "response.audio.delta" not in kinds[started:]
        cancelled = events[-1]["response"]
        assert cancelled["status"] == "cancelled"
        assert cancelled["text"].startswith(cancelled["spoken"].split(" ")[0])
        assert cancel_gap < 5.0, cancel_gap
        after = await c.until("response.done", timeout=240)
        assert after[-1]["response"]["status"] == "completed"
        assert any(
            "france" in words(e["transcript"])
            for e in after
            if e["type"] == "conversation.item.input_audio_transcription.completed"
        )


async def test_session_cancel_during_an_answer_reports_it_then_closes_1000(
    tiny_server: ServerProcess,
) -> None:
    async with connect(tiny_server.base_url) as c:
        await configure(c, max_response_output_tokens=200)
        await c.append(spoken())
        await c.send({"type": "input_audio_buffer.commit"})
        await c.until("response.created", timeout=240)
        await c.send({"type": "session.cancel"})
        code = await c.closed()
    kinds = [e["type"] for e in c.events]
    assert "response.done" not in kinds
    cancelled = next(e for e in c.events if e["type"] == "response.cancelled")
    assert cancelled["response"]["status"] == "cancelled"
    assert code == 1000


async def test_idle_session_is_closed_1008(tiny_server: ServerProcess) -> None:
    async with connect(tiny_server.base_url) as c:
        await configure(c, idle_timeout_s=1)
        error = await c.recv(timeout=30)
        assert error["type"] == "error" and error["error"]["code"] == "idle_timeout"
        assert await c.closed() == 1008


async def test_session_life_is_capped_even_when_busy(tiny_server: ServerProcess) -> None:
    async with connect(tiny_server.base_url) as c:
        await configure(c, max_streaming_seconds=2, idle_timeout_s=5)

        async def keep_active() -> None:
            # An active client (the cap applies however busy the session is).
            with contextlib.suppress(trio_websocket.ConnectionClosed):
                while True:
                    await c.send({"type": "session.ping"})
                    await trio.sleep(0.3)

        async with trio.open_nursery() as n:
            n.start_soon(keep_active)
            code = await c.closed()
            n.cancel_scope.cancel()
    errors = [e["error"]["code"] for e in c.events if e["type"] == "error"]
    assert errors == ["session_expired"]
    assert code == 1008


async def test_uncommitted_audio_is_bounded(tiny_server: ServerProcess) -> None:
    """A client that streams without committing gets an error once 120 s are buffered; the
    extra audio is dropped and the session goes on."""
    chunk = base64.b64encode(np.zeros(16_000 * 20, "<i2").tobytes()).decode()  # 20 s, 853 KB
    async with connect(tiny_server.base_url) as c:
        await configure(c)
        for _ in range(7):
            await c.send({"type": "input_audio_buffer.append", "audio": chunk})
        full = await c.recv()
        assert full["error"]["code"] == "input_audio_buffer_full"
        await c.send({"type": "input_audio_buffer.clear"})
        assert (await c.recv())["type"] == "input_audio_buffer.cleared"
        await c.send({"type": "input_audio_buffer.append", "audio": chunk})
        await c.send({"type": "session.ping"})
        assert (await c.recv())["type"] == "session.pong"


async def test_bad_frames_are_error_events_and_the_session_goes_on(
    tiny_server: ServerProcess,
) -> None:
    async with connect(tiny_server.base_url) as c:
        await c.recv()
        await c.send({"type": "input_audio_buffer.append", "audio": frames(spoken())[0]})
        early = await c.recv()
        assert early["error"]["message"] == "send session.update before audio"
        await c.send({"type": "session.update", "session": SETUP})
        assert (await c.recv())["type"] == "session.updated"
        await c.send({"type": "session.update", "session": SETUP})
        again = await c.recv()
        assert again["error"]["code"] == "session_initialization_failed"

        await c.ws.send_message(b"\x00\x01binary")
        binary = await c.recv()
        assert binary["error"] == {
            "code": "invalid_request",
            "message": "message must be a JSON object",
            "param": None,
        }
        await c.send({"type": "input_audio_buffer.append", "audio": "not base64!!"})
        bad = await c.recv()
        assert bad["error"]["code"] == "inference_error" and "base64" in bad["error"]["message"]
        odd = base64.b64encode(b"\x01\x02\x03").decode()
        await c.send({"type": "input_audio_buffer.append", "audio": odd})
        odd_error = await c.recv()
        assert odd_error["error"]["code"] == "inference_error"
        assert "even byte count" in odd_error["error"]["message"]
        await c.send({"type": "input_audio_buffer.commit"})
        empty = await c.recv()
        assert empty["error"]["code"] == "input_audio_buffer_commit_empty"
        await c.send({"type": "conversation.frobnicate"})
        unknown = await c.recv()
        assert unknown["error"]["message"] == "unsupported event type 'conversation.frobnicate'"
        await c.send({"type": "session.ping"})
        assert (await c.recv())["type"] == "session.pong"
        # Over the 1 MiB message limit: the server closes with 1009 (message too big).
        await c.ws.send_message("x" * (1024 * 1024 + 10))
        assert await c.closed() == 1009


async def test_session_update_field_we_cannot_honour_is_named(tiny_server: ServerProcess) -> None:
    async with connect(tiny_server.base_url) as c:
        await c.recv()
        await c.send({"type": "session.update", "session": {"tools": []}})
        error = await c.recv()
        assert error["error"]["code"] == "session_initialization_failed"
        assert error["error"]["param"] == "session.tools"


@pytest.fixture(scope="module")
def guarded_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        [
            "-m",
            str(tiny_model_dir),
            "--api-key",
            "sekrit",
            "--realtime-max-sessions",
            "1",
            "--metrics",
        ]
    )
    yield server
    server.stop()


async def test_handshake_needs_a_header_key_and_sessions_are_bounded(
    guarded_server: ServerProcess,
) -> None:
    base = guarded_server.base_url
    for query, headers in (("", {}), ("?api_key=sekrit", {}), ("", {"X-Api-Key": "wrong"})):
        with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
            async with connect(base, query, headers):
                pass
        assert rejected.value.status_code == 401
    with pytest.raises(trio_websocket.ConnectionRejected) as in_query:
        async with connect(base, "?api_key=sekrit", {"X-Api-Key": "sekrit"}):
            pass
    assert in_query.value.status_code == 401
    assert b"query string" in (in_query.value.body or b"")

    async with connect(base, headers={"Authorization": "Bearer sekrit"}) as first:
        assert (await first.recv())["type"] == "session.created"
        async with connect(base, headers={"X-Api-Key": "sekrit"}) as second:
            busy = await second.recv()
            assert busy["type"] == "error" and busy["error"]["code"] == "server_busy"
            assert await second.closed() == 1013
    # The place is free again once the first session has gone.
    with trio.fail_after(30):
        while True:
            async with connect(base, headers={"X-Api-Key": "sekrit"}) as third:
                if (await third.recv())["type"] == "session.created":
                    break
            await trio.sleep(0.2)


async def test_open_sessions_leave_the_speech_models_half_the_blas_threads(
    guarded_server: ServerProcess,
) -> None:
    base, auth = guarded_server.base_url, {"X-Api-Key": "sekrit"}

    async def blas_threads() -> int:
        reply = await trio.to_thread.run_sync(
            lambda: httpx.get(f"{base}/metrics", headers=auth, timeout=30)
        )
        for family in text_string_to_metric_families(reply.text):
            if family.name == "mlxcel_blas_threads":
                return int(family.samples[0].value)
        raise AssertionError("no mlxcel_blas_threads in /metrics")

    full = await blas_threads()
    # This machine has 2 cores; OpenBLAS starts on all of them.
    assert full >= 2
    async with connect(base, headers=auth) as session:
        assert (await session.recv())["type"] == "session.created"
        assert await blas_threads() == full // 2
    with trio.fail_after(30):  # the handler finishes just after the close
        while True:
            if await blas_threads() == full:
                break
            await trio.sleep(0.1)


def test_no_audio_server_refuses_with_501(tiny_model_dir: Path) -> None:
    server = ServerProcess(["-m", str(tiny_model_dir), "--no-audio"])
    try:

        async def handshake() -> None:
            with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
                async with connect(server.base_url):
                    pass
            assert rejected.value.status_code == 501
            assert b"--no-audio" in (rejected.value.body or b"")

        trio.run(handshake)
    finally:
        server.stop()

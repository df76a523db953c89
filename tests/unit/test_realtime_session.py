"""A realtime session with a fake transport: a client that stops reading is hung up once a send
waits past the send timeout, one that reads too slowly is closed 1008 once its outgoing queue
is full, and a worker's failure inside a turn does not end the session."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
import numpy as np
import trio

from mlxcel.actors.realtime.events import Item
from mlxcel.actors.realtime.machine import MAX_HISTORY_ITEMS
from mlxcel.actors.realtime.vad import shared_model
from mlxcel.actors.realtime_voice import RealtimeSession, VoiceDeps
from mlxcel.http.realtime_voicechat import VoiceChat
from mlxcel.http.realtime_wire import RealtimeWire
from mlxcel.runtime.errors import ServerBusy, Timeout
from mlxcel.runtime.messages import GenerationRequest, SamplingParams
from mlxcel.runtime.slot import AbortBox, OutputSlot, Reservation


class StuckClient:
    """Sends what the test queues; never reads what the server sends after the first event.

    As under Hypercorn, the send that finds the client's TCP window full cannot be cancelled
    (it writes in a shielded scope); only hanging up the connection ends it.
    """

    def __init__(self) -> None:
        self.inbox_tx, self.inbox_rx = trio.open_memory_channel[str](1000)
        self.sent: list[str] = []
        self.closed: tuple[int, str] | None = None
        self.hung_up_at: float | None = None
        self._gone = trio.Event()

    async def receive(self) -> str:
        return await self.inbox_rx.receive()

    async def send(self, data: str) -> None:
        self.sent.append(data)
        if len(self.sent) > 1:
            with trio.CancelScope(shield=True):
                await self._gone.wait()

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)

    def hang_up(self) -> bool:
        self.hung_up_at = trio.current_time()
        self._gone.set()
        return True


class NoVoice:
    sample_rate = 22_050

    def voice_for(self, voice: str | None) -> str:
        return "default"


def deps(max_outbox_bytes: int) -> VoiceDeps:
    return VoiceDeps(
        generation=Any,  # type: ignore[arg-type]  # no answer is generated in these tests
        stt=Any,  # type: ignore[arg-type]
        tts=NoVoice(),  # type: ignore[arg-type]
        sampling=SamplingParams(),
        model_id="m",
        vad_model=shared_model,
        vad_limiter=trio.CapacityLimiter(1),
        max_outbox_bytes=max_outbox_bytes,
    )


async def test_a_client_that_stops_reading_is_hung_up_after_the_send_timeout(
    autojump_clock: Any,
) -> None:
    client = StuckClient()
    session = RealtimeSession(RealtimeWire(client, VoiceChat(22_050)), deps(max_outbox_bytes=2000))
    client.inbox_tx.send_nowait(json.dumps({"type": "session.update", "session": {}}))
    for _ in range(100):
        client.inbox_tx.send_nowait(json.dumps({"type": "session.ping"}))
    start = trio.current_time()
    with trio.fail_after(60):
        await session.run()
    # The outbox overflowed (its bound held), but a close frame cannot reach a client that
    # reads nothing: the connection is dropped once the stuck send is send_timeout old.
    assert client.hung_up_at is not None and client.hung_up_at - start == 10.0
    assert session.dropped == "send_timeout"
    assert session.output_bytes == 0


async def test_a_departed_clients_stuck_send_is_hung_up_too(autojump_clock: Any) -> None:
    # The client goes (the server cancels the session) while a send to it is stuck: the
    # session still ends, send_timeout after the send began.
    client = StuckClient()
    session = RealtimeSession(RealtimeWire(client, VoiceChat(22_050)), deps(100_000))
    client.inbox_tx.send_nowait(json.dumps({"type": "session.update", "session": {}}))
    client.inbox_tx.send_nowait(json.dumps({"type": "session.ping"}))
    start = trio.current_time()
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            n.start_soon(session.run)
            await trio.sleep(1)
            n.cancel_scope.cancel()
    assert client.hung_up_at is not None and client.hung_up_at - start == 10.0
    assert session.dropped == "send_timeout"


async def test_a_client_reading_too_slowly_is_closed_1008(autojump_clock: Any) -> None:
    client = StuckClient()

    async def slowly(data: str) -> None:
        client.sent.append(data)
        await trio.sleep(1)  # takes each event, one a second

    client.send = slowly  # type: ignore[method-assign]
    session = RealtimeSession(RealtimeWire(client, VoiceChat(22_050)), deps(max_outbox_bytes=2000))
    client.inbox_tx.send_nowait(json.dumps({"type": "session.update", "session": {}}))
    for _ in range(100):
        client.inbox_tx.send_nowait(json.dumps({"type": "session.ping"}))
    with trio.fail_after(60):
        await session.run()
    assert client.closed == (1008, "client too slow: outgoing queue overflow")
    assert client.hung_up_at is None and session.dropped == "outgoing_backlog"
    # What was queued when the box overflowed was dropped, not sent.
    assert len(client.sent) < 20


async def test_two_sessions_one_stuck_the_other_served(autojump_clock: Any) -> None:
    stuck, fine = StuckClient(), StuckClient()
    fine_sent: list[str] = []

    async def reads(data: str) -> None:
        fine_sent.append(data)

    fine.send = reads  # type: ignore[method-assign]
    a = RealtimeSession(RealtimeWire(stuck, VoiceChat(22_050)), deps(2000))
    b = RealtimeSession(RealtimeWire(fine, VoiceChat(22_050)), deps(2000))
    for c in (stuck, fine):
        c.inbox_tx.send_nowait(json.dumps({"type": "session.update", "session": {}}))
        for _ in range(50):
            c.inbox_tx.send_nowait(json.dumps({"type": "session.ping"}))
    fine.inbox_tx.send_nowait(json.dumps({"type": "session.cancel"}))
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            n.start_soon(a.run)
            n.start_soon(b.run)
    pongs = [m for m in fine_sent if json.loads(m)["type"] == "session.pong"]
    assert len(pongs) == 50
    assert fine.closed == (1000, "session cancelled")
    assert stuck.hung_up_at is not None


async def test_a_long_conversation_forgets_its_oldest_quarter_at_once() -> None:
    # Past MAX_HISTORY_ITEMS the oldest quarter goes in one drop (the prompt's start then
    # stays put for the next 64 items), and the truncation cut moves with the items.
    wire = RealtimeWire(StuckClient(), VoiceChat(22_050))
    session = RealtimeSession(wire, deps(max_outbox_bytes=2000)).machine
    for i in range(MAX_HISTORY_ITEMS):
        session.remember(Item(f"item_{i}", "user", f"q{i}"))
    session.context_from = 100
    session.remember(Item("one_more", "user", "q"))
    drop = MAX_HISTORY_ITEMS // 4
    assert len(session.history) == MAX_HISTORY_ITEMS + 1 - drop
    assert session.history[0].id == f"item_{drop}"
    assert session.context_from == 100 - drop
    assert session.messages(None)[0]["content"] == "q100"
    for i in range(drop - 1):  # no further drop until the cap is passed again
        session.remember(Item(f"later_{i}", "user", "q"))
    assert len(session.history) == MAX_HISTORY_ITEMS


async def test_deep_or_invalid_unicode_events_are_errors_and_the_session_goes_on() -> None:
    client = StuckClient()
    sent: list[str] = []

    async def reads(data: str) -> None:
        sent.append(data)

    client.send = reads  # type: ignore[method-assign]
    session = RealtimeSession(
        RealtimeWire(client, VoiceChat(22_050)), deps(max_outbox_bytes=100_000)
    )
    client.inbox_tx.send_nowait(json.dumps({"type": "session.update", "session": {}}))
    client.inbox_tx.send_nowait('{"type": ' + "[" * 10_000 + "]" * 10_000 + "}")
    client.inbox_tx.send_nowait(json.dumps({"type": "session.ping", "event_id": "a\ud800"}))
    client.inbox_tx.send_nowait(json.dumps({"type": "session.ping"}))
    client.inbox_tx.send_nowait(json.dumps({"type": "session.cancel"}))
    with trio.fail_after(10):
        await session.run()
    errors = [json.loads(m)["error"] for m in sent if json.loads(m)["type"] == "error"]
    assert "nests deeper than" in errors[0]["message"]
    assert "lone surrogate" in errors[1]["message"] and errors[1]["param"] == "event_id"
    assert any(json.loads(m)["type"] == "session.pong" for m in sent)
    assert client.closed == (1000, "session cancelled")


# --- a worker's failure is an error event; the session goes on ---------------------------------


class Heard:
    text = "What is the capital of France?"


class Ears:
    """Speech-to-text that fails its first ``failures`` turns, then hears the question."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.waited: list[bool] = []

    async def transcribe(self, audio: Any, **options: Any) -> Heard:
        await trio.lowlevel.checkpoint()
        self.waited.append(options.get("wait", False))
        if self.failures:
            self.failures -= 1
            raise Timeout("The speech-to-text worker did not answer within 120 s.")
        return Heard()


class BrokenVoice(NoVoice):
    """The voice fails its first sentence the way a full queue used to (ServerBusy, raised
    inside the answer's nursery), then speaks."""

    def __init__(self) -> None:
        self.failures = 1
        self.waited: list[bool] = []

    async def synthesize(self, text: str, **options: Any) -> AsyncIterator[bytes]:
        await trio.lowlevel.checkpoint()
        self.waited.append(options.get("wait", False))
        if self.failures:
            self.failures -= 1
            raise ServerBusy()
        yield b"\x01\x00" * 2205


class Answers:
    def submit(self, request: GenerationRequest) -> OutputSlot:
        slot = OutputSlot(request.request_id, Reservation(None, None), AbortBox())
        slot.accept(5)
        slot.push("Paris is the capital. ", 5)
        slot.finish("stop")
        return slot


async def test_worker_failures_are_error_events_and_the_session_goes_on() -> None:
    client = StuckClient()
    sent: list[dict[str, Any]] = []
    news = trio.Event()

    async def reads(data: str) -> None:
        nonlocal news
        sent.append(json.loads(data))
        news.set()
        news = trio.Event()

    async def seen(kind: str, count: int = 1) -> None:
        while sum(e["type"] == kind for e in sent) < count:
            await news.wait()

    client.send = reads  # type: ignore[method-assign]
    ears, voice = Ears(failures=1), BrokenVoice()
    session = RealtimeSession(
        RealtimeWire(client, VoiceChat(22_050)),
        attrs.evolve(deps(1_000_000), generation=Answers(), stt=ears, tts=voice),
    )
    audio = base64.b64encode(np.zeros(8000, "<i2").tobytes()).decode()
    turn = [
        {"type": "input_audio_buffer.append", "audio": audio},
        {"type": "input_audio_buffer.commit"},
    ]
    update = {"type": "session.update", "session": {"multi_turn": True}}
    client.inbox_tx.send_nowait(json.dumps(update))
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(session.run)
            # 1: transcription fails; 2: the answer's voice fails; 3: all goes well.
            for event in turn:
                client.inbox_tx.send_nowait(json.dumps(event))
            await seen("error")
            for event in turn:
                client.inbox_tx.send_nowait(json.dumps(event))
            await seen("response.done")
            for event in turn:
                client.inbox_tx.send_nowait(json.dumps(event))
            await seen("response.done", 2)
            client.inbox_tx.send_nowait(json.dumps({"type": "session.cancel"}))
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["inference_error", "inference_error"]
    assert "transcription failed" in errors[0]["message"]
    assert "answer failed" in errors[1]["message"] and "busy" in errors[1]["message"]
    done = [e["response"]["status"] for e in sent if e["type"] == "response.done"]
    assert done == ["failed", "completed"]
    assert any(e["type"] == "response.audio.delta" for e in sent)
    # Closed by the client, not by an exception (1011).
    assert client.closed == (1000, "session cancelled")
    # The session waits for busy workers rather than being refused.
    assert ears.waited and all(ears.waited) and voice.waited and all(voice.waited)


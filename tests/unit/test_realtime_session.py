"""A realtime session with a fake transport: a client that stops reading is hung up once a send
waits past the send timeout, one that reads too slowly is closed 1008 once its outgoing queue
is full, and no failure inside a turn ends the session."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
import numpy as np
import trio

from mlxcel.actors.realtime.events import Item
from mlxcel.actors.realtime.machine import MAX_HISTORY_CHARS, MAX_HISTORY_ITEMS
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


async def test_a_conversation_of_long_typed_items_is_bounded_in_characters() -> None:
    # Typed items may each be as long as a WebSocket message: the text is capped too, and
    # past the cap the oldest items go until a quarter of it is free.
    wire = RealtimeWire(StuckClient(), VoiceChat(22_050))
    session = RealtimeSession(wire, deps(max_outbox_bytes=2000)).machine
    third = "x" * (MAX_HISTORY_CHARS * 3 // 10)
    for i in range(3):
        session.remember(Item(f"item_{i}", "user", third))
    assert len(session.history) == 3
    session.remember(Item("item_3", "user", third))
    assert [i.id for i in session.history] == ["item_2", "item_3"]
    # One item over the cap by itself stays, alone: the newest turn is never forgotten.
    session.remember(Item("huge", "user", "y" * (MAX_HISTORY_CHARS + 1)))
    assert [i.id for i in session.history] == ["huge"]


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


class ReadingClient(StuckClient):
    """Reads every event; a test can wait until it has seen some kind of event."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []
        self._news = trio.Event()

    async def send(self, data: str) -> None:
        self.events.append(json.loads(data))
        self._news.set()
        self._news = trio.Event()

    async def seen(self, kind: str, count: int = 1) -> None:
        while sum(e["type"] == kind for e in self.events) < count:
            await self._news.wait()

    def queue(self, event: dict[str, Any]) -> None:
        self.inbox_tx.send_nowait(json.dumps(event))

    def queue_turn(self) -> None:
        """Half a second of audio, committed (the fake ears hear the question in it)."""
        audio = base64.b64encode(np.zeros(8000, "<i2").tobytes()).decode()
        self.queue({"type": "input_audio_buffer.append", "audio": audio})
        self.queue({"type": "input_audio_buffer.commit"})


async def talk(session: RealtimeSession, client: ReadingClient, *, answers: int) -> None:
    """A multi-turn session: a first turn that ends in an error event, then ``answers`` turns
    that each end with their response.done, then the client cancels the session."""
    client.queue({"type": "session.update", "session": {"multi_turn": True}})
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(session.run)
            client.queue_turn()
            await client.seen("error")
            for answered in range(1, answers + 1):
                client.queue_turn()
                await client.seen("response.done", answered)
            client.queue({"type": "session.cancel"})


async def test_worker_failures_are_error_events_and_the_session_goes_on() -> None:
    client = ReadingClient()
    sent = client.events
    ears, voice = Ears(failures=1), BrokenVoice()
    session = RealtimeSession(
        RealtimeWire(client, VoiceChat(22_050)),
        attrs.evolve(deps(1_000_000), generation=Answers(), stt=ears, tts=voice),
    )
    # 1: transcription fails; 2: the answer's voice fails; 3: all goes well.
    await talk(session, client, answers=2)
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


# --- an unexpected exception in a turn is an error event too (never close 1011) ----------------


class CrashingEars(Ears):
    """Speech-to-text whose first turn meets a bug (a plain exception, not a worker error)."""

    async def transcribe(self, audio: Any, **options: Any) -> Heard:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("bug in the transcription path")
        return await super().transcribe(audio, **options)


class CrackedVoice(NoVoice):
    """A voice whose first sentence comes out as an odd number of bytes (numpy refuses it)."""

    def __init__(self) -> None:
        self.failures = 1

    async def synthesize(self, text: str, **options: Any) -> AsyncIterator[bytes]:
        await trio.lowlevel.checkpoint()
        if self.failures:
            self.failures -= 1
            yield b"\x01"
            return
        yield b"\x01\x00" * 2205


async def test_unexpected_exceptions_in_a_turn_are_error_events_and_the_session_goes_on() -> None:
    client = ReadingClient()
    sent = client.events
    counted = 0

    def count_tokens(request: GenerationRequest) -> int:
        nonlocal counted
        counted += 1
        if counted == 2:  # the second answer's context fitting meets a bug
            raise KeyError("bug in the prompt path")
        return 10

    session = RealtimeSession(
        RealtimeWire(client, VoiceChat(22_050)),
        attrs.evolve(
            deps(1_000_000),
            generation=Answers(),
            stt=CrashingEars(failures=1),
            tts=CrackedVoice(),
            count_tokens=count_tokens,
            context_length=4096,
        ),
    )
    # 1: transcription crashes; 2: the voice's audio; 3: fitting the context; 4: fine.
    await talk(session, client, answers=3)
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["inference_error"] * 3
    assert errors[0]["message"] == "transcription failed: internal error (RuntimeError)"
    assert errors[1]["message"] == "answer failed: internal error (ValueError)"
    assert errors[2]["message"] == "answer failed: internal error (KeyError)"
    done = [e["response"]["status"] for e in sent if e["type"] == "response.done"]
    assert done == ["failed", "failed", "completed"]
    assert client.closed == (1000, "session cancelled")


class BrokenDetector:
    """A VAD model that fails on every window."""

    def run(self, *args: Any) -> Any:
        raise RuntimeError("onnxruntime failed")


async def test_a_failing_speech_detector_is_an_error_event_and_the_session_goes_on() -> None:
    client = ReadingClient()
    session = RealtimeSession(
        RealtimeWire(client, VoiceChat(22_050)),
        attrs.evolve(deps(100_000), vad_model=BrokenDetector),
    )
    client.queue({"type": "session.update", "session": {"turn_detection": {"type": "server_vad"}}})
    audio = base64.b64encode(np.zeros(8000, "<i2").tobytes()).decode()
    client.queue({"type": "input_audio_buffer.append", "audio": audio})  # meets the detector
    client.queue({"type": "session.ping"})
    client.queue({"type": "session.cancel"})
    with trio.fail_after(10):
        await session.run()
    errors = [e["error"] for e in client.events if e["type"] == "error"]
    assert [e["message"] for e in errors] == [
        "speech detection failed: internal error (RuntimeError)"
    ]
    assert any(e["type"] == "session.pong" for e in client.events)
    assert client.closed == (1000, "session cancelled")

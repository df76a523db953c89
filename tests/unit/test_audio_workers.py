"""The audio worker actors on fake engines: queue bound, timeout, cancellation, turn-taking.

The engines run on the workers' real threads, so a mock clock would jump past the workers'
own timeouts whenever a thread works: the tests wait on what the fakes signal instead
(``threading.Event``s, awaited from a worker thread) and on ``wait_all_tasks_blocked``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from mlxcel.actors.audio.stt import SpeechToText, SttInfo, SttOptions
from mlxcel.actors.audio.tts import TextToSpeech, TtsInfo
from mlxcel.actors.audio.worker import AudioWorker
from mlxcel.runtime.errors import InternalError, InvalidRequest, ServerBusy, Timeout
from mlxcel.runtime.messages import Segment

STT_INFO = SttInfo(model_id="fake-whisper", path=None, engine="fake", multilingual=False)
TTS_INFO = TtsInfo(model_id="fake-voice", path=None, engine="fake", sample_rate=8000, voices=("v",))


class FakeWhisper:
    """One segment per second of audio; each segment waits for ``gate`` when one is given.
    ``decoding`` is set when a segment starts (and so waits at the gate)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.decoding = threading.Event()
        self.started: list[float] = []
        self.segments_run = 0

    def start(self, audio: Any, options: SttOptions) -> tuple[Iterator[Segment], str, float]:
        seconds = len(audio) / 16000
        self.started.append(seconds)
        return self._segments(int(seconds), options), "en", seconds

    def _segments(self, n: int, options: SttOptions) -> Iterator[Segment]:
        for i in range(n):
            self.decoding.set()
            if self.gate is not None:
                self.gate.wait(10)
            self.segments_run += 1
            yield Segment(id=i, start=i, end=i + 1, text=f" s{i}", temperature=options.temperature)


async def _cancellable(scope: trio.CancelScope, call: Any, *args: Any, **kwargs: Any) -> None:
    with scope:
        await call(*args, **kwargs)


def audio(seconds: int) -> np.ndarray:
    return np.zeros(16000 * seconds, dtype=np.float32)


async def test_transcribe_collects_segments_in_order() -> None:
    stt = SpeechToText(STT_INFO, FakeWhisper, queue_depth=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(stt.run)
        result = await stt.transcribe(audio(3), temperature=0.4)
        assert result.text == "s0 s1 s2"
        assert [s.id for s in result.segments] == [0, 1, 2]
        assert result.segments[0].temperature == 0.4
        assert result.duration == 3
        assert stt.queued == 0
        nursery.cancel_scope.cancel()


async def test_full_queue_is_server_busy_and_frees_up() -> None:
    gate = threading.Event()
    stt = SpeechToText(STT_INFO, lambda: FakeWhisper(gate), queue_depth=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(stt.run)
        done = trio.Event()

        async def first() -> None:
            await stt.transcribe(audio(1))
            done.set()

        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(ServerBusy):
            await stt.transcribe(audio(1))
        gate.set()
        await done.wait()
        # The first job is done: there is room again.
        assert (await stt.transcribe(audio(2))).text == "s0 s1"
        nursery.cancel_scope.cancel()


async def test_timeout_is_504_and_drops_the_job() -> None:
    gate = threading.Event()
    whisper = FakeWhisper(gate)
    stt = SpeechToText(STT_INFO, lambda: whisper, queue_depth=2, timeout=0.3)
    async with trio.open_nursery() as nursery:
        await nursery.start(stt.run)
        with pytest.raises(Timeout):
            await stt.transcribe(audio(5))
        assert stt.queued == 0
        gate.set()
        # The abandoned job stops after the segment that was running; a new job runs in full.
        assert (await stt.transcribe(audio(1))).text == "s0"
        assert whisper.segments_run <= 2
        nursery.cancel_scope.cancel()


async def test_cancelled_caller_drops_queued_work() -> None:
    gate = threading.Event()
    whisper = FakeWhisper(gate)
    stt = SpeechToText(STT_INFO, lambda: whisper, queue_depth=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(stt.run)
        async with trio.open_nursery() as callers:
            callers.start_soon(stt.transcribe, audio(1))
            await trio.to_thread.run_sync(whisper.decoding.wait, 10)
            # Queued behind the first (blocked) job; its caller gives up (client disconnect).
            gives_up = trio.CancelScope()
            callers.start_soon(_cancellable, gives_up, stt.transcribe, audio(7))
            await trio.testing.wait_all_tasks_blocked()
            assert stt.queued == 2
            gives_up.cancel()
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        # The 7-second job never started decoding.
        assert whisper.started == [1]
        assert stt.queued == 0
        nursery.cancel_scope.cancel()


async def test_long_job_does_not_block_a_short_one() -> None:
    gate = threading.Event()
    whisper = FakeWhisper(gate)
    stt = SpeechToText(STT_INFO, lambda: whisper, queue_depth=4)
    order: list[int] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(stt.run)

        async def run(seconds: int) -> None:
            await stt.transcribe(audio(seconds))
            order.append(seconds)

        async with trio.open_nursery() as callers:
            callers.start_soon(run, 60)
            # The long job is decoding its first segment when the short one arrives.
            await trio.to_thread.run_sync(whisper.decoding.wait, 10)
            callers.start_soon(run, 1)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        # Segments take turns, so the 1-second clip finishes before the 60-second one.
        assert order == [1, 60]
        nursery.cancel_scope.cancel()


async def test_engine_errors_reach_the_caller_and_the_worker_lives() -> None:
    class Picky(FakeWhisper):
        def start(self, audio: Any, options: SttOptions) -> Any:
            if options.language == "xx":
                raise InvalidRequest("bad language", param="language")
            if options.language == "boom":
                raise RuntimeError("native crash")
            return super().start(audio, options)

    stt = SpeechToText(STT_INFO, Picky, queue_depth=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(stt.run)
        with pytest.raises(InvalidRequest):
            await stt.transcribe(audio(1), language="xx")
        with pytest.raises(InternalError):
            await stt.transcribe(audio(1), language="boom")
        assert (await stt.transcribe(audio(1))).text == "s0"
        nursery.cancel_scope.cancel()


async def test_load_failure_is_reported_to_each_request() -> None:
    def broken() -> FakeWhisper:
        raise OSError("model.bin is truncated")

    stt = SpeechToText(STT_INFO, broken, queue_depth=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(stt.run)
        for _ in range(2):
            with pytest.raises(InternalError, match="truncated"):
                await stt.transcribe(audio(1))
        nursery.cancel_scope.cancel()


class FakeVoice:
    """One chunk per sentence (split on '.'); counts what it synthesised."""

    def __init__(self) -> None:
        self.spoken: list[str] = []

    def synthesize(self, text: str, voice: str, speed: float) -> Iterator[bytes]:
        for sentence in filter(None, (s.strip() for s in text.split("."))):
            self.spoken.append(sentence)
            yield b"\x01\x00" * int(100 * len(sentence) / speed)


async def test_synthesize_yields_one_chunk_per_sentence() -> None:
    voice = FakeVoice()
    tts = TextToSpeech(TTS_INFO, lambda: voice, queue_depth=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(tts.run)
        chunks = [c async for c in tts.synthesize("One. Three. Seven.", voice="alloy", speed=2.0)]
        assert [len(c) for c in chunks] == [300, 500, 500]
        assert tts.queued == 0
        nursery.cancel_scope.cancel()


async def test_closing_the_consumer_stops_synthesis() -> None:
    voice = FakeVoice()
    tts = TextToSpeech(TTS_INFO, lambda: voice, queue_depth=2)
    text = ". ".join(f"Sentence {i}" for i in range(200))
    async with trio.open_nursery() as nursery:
        await nursery.start(tts.run)
        async with contextlib.aclosing(tts.synthesize(text)) as chunks:  # type: ignore[type-var]
            async for _ in chunks:
                break
        assert tts.queued == 0
        # Wanted an hour from now, this runs only once no job wanted sooner is left: the
        # abandoned one, had it gone on, would have said all 200 sentences by then.
        async for _ in tts.synthesize("Probe.", deadline=time.monotonic() + 3600):
            pass
        assert voice.spoken[-1] == "Probe"
        assert len(voice.spoken) < 50
        nursery.cancel_scope.cancel()


async def test_voice_and_speed_are_checked() -> None:
    tts = TextToSpeech(TTS_INFO, FakeVoice, queue_depth=1)
    assert tts.voice_for("shimmer") == "v"
    assert tts.voice_for(None) == "v"
    with pytest.raises(InvalidRequest) as caught:
        tts.voice_for("nobody")
    assert caught.value.param == "voice"
    with pytest.raises(InvalidRequest):
        tts.check_speed(4.5)
    with pytest.raises(InvalidRequest):
        tts.check_speed(float("nan"))


async def test_the_earliest_deadline_is_spoken_first() -> None:
    """A live answer's first piece (wanted now) goes ahead of another voice's piece that is
    needed only seconds later, and ahead of a long answer's later sentences."""
    gate = threading.Event()

    inside = threading.Event()

    class GatedVoice(FakeVoice):
        def synthesize(self, text: str, voice: str, speed: float) -> Iterator[bytes]:
            if text == "Hold.":
                inside.set()
                gate.wait(10)
            return super().synthesize(text, voice, speed)

    voice = GatedVoice()
    tts = TextToSpeech(TTS_INFO, lambda: voice, queue_depth=4)

    async def speak(text: str, deadline: float | None = None) -> None:
        async for _ in tts.synthesize(text, deadline=deadline):
            pass

    async with trio.open_nursery() as nursery:
        await nursery.start(tts.run)
        async with trio.open_nursery() as callers:
            callers.start_soon(speak, "Hold.")
            await trio.to_thread.run_sync(inside.wait, 10)  # the worker is inside "Hold." now
            now = time.monotonic()
            callers.start_soon(speak, "Later piece.", now + 5)
            # 60 sentences of 10 chars: ~0.125 s of audio each at 8 kHz, so its third sentence
            # is wanted ~0.25 s from now, before the 5 s piece but after a piece wanted now.
            callers.start_soon(speak, ". ".join(f"Long {i:05d}" for i in range(60)), now)
            callers.start_soon(speak, "First piece.", now + 0.1)
            await trio.testing.wait_all_tasks_blocked()  # all four are queued
            gate.set()
        spoken = voice.spoken
        assert spoken[:3] == ["Hold", "Long 00000", "First piece"]
        assert spoken.index("Later piece") > spoken.index("Long 00003")
        nursery.cancel_scope.cancel()


# --- a live voice turn waits for a place (``wait=True``); the HTTP routes are refused ---------


async def test_a_waiting_turn_gets_the_next_place_while_http_is_refused() -> None:
    gate = threading.Event()
    whisper = FakeWhisper(gate)
    waits: list[tuple[str, float]] = []
    stt = SpeechToText(
        STT_INFO,
        lambda: whisper,
        queue_depth=1,
        waited=lambda name, seconds: waits.append((name, seconds)),
    )
    finished: list[int] = []

    async def turn(seconds: int) -> None:
        result = await stt.transcribe(audio(seconds), wait=True)
        assert len(result.segments) == seconds
        finished.append(seconds)

    async with trio.open_nursery() as nursery:
        await nursery.start(stt.run)
        async with trio.open_nursery() as callers:
            callers.start_soon(turn, 1)
            await trio.to_thread.run_sync(whisper.decoding.wait, 10)
            for seconds in (2, 3):  # in line, in this order
                callers.start_soon(turn, seconds)
                await trio.testing.wait_all_tasks_blocked()
            assert stt.statistics().held == 1 and stt.statistics().waiting == 2
            # An HTTP transcription meets a full queue: 503 as before, counted.
            with pytest.raises(ServerBusy):
                await stt.transcribe(audio(1))
            assert stt.statistics().refused == 1
            gate.set()
        # Every turn answered, first come first served.
        assert finished == [1, 2, 3]
        assert whisper.started == [1, 2, 3]
        assert stt.statistics().held == 0 and stt.statistics().waiting == 0
        # The first had a place at once; the others waited for one.
        assert [name for name, _ in waits] == ["speech-to-text"] * 3
        assert waits[0][1] < waits[1][1] and waits[2][1] > 0
        nursery.cancel_scope.cancel()


async def test_a_turn_cancelled_in_line_leaves_no_job_behind() -> None:
    gate = threading.Event()
    whisper = FakeWhisper(gate)
    stt = SpeechToText(STT_INFO, lambda: whisper, queue_depth=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(stt.run)
        async with trio.open_nursery() as callers:
            callers.start_soon(stt.transcribe, audio(1))
            await trio.to_thread.run_sync(whisper.decoding.wait, 10)
            # A session closes while its turn waits in line.
            closes = trio.CancelScope()
            callers.start_soon(partial(_cancellable, closes, stt.transcribe, audio(7), wait=True))
            await trio.testing.wait_all_tasks_blocked()
            assert stt.statistics().waiting == 1
            closes.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert stt.statistics().waiting == 0 and stt.statistics().held == 1
            gate.set()
        assert stt.statistics().held == 0
        # The place it would have had is free: an HTTP request gets it at once.
        assert (await stt.transcribe(audio(2))).text == "s0 s1"
        # The 7-second clip was never queued, so never decoded.
        assert whisper.started == [1, 2]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("first", ["granted", "cancelled"])
async def test_a_place_granted_as_its_turn_leaves_goes_to_the_next(first: str) -> None:
    """The caller at the head of the line leaves in the same instant that a place frees up
    (either order): the place passes to the next in line, and none is lost or doubled."""
    worker = AudioWorker(lambda: None, name="speech-to-text", queue_depth=1)
    worker.admit_nowait(_NoJob())
    admitted: list[str] = []

    async def turn(name: str, scope: trio.CancelScope) -> None:
        with scope:
            await worker.admit(_NoJob(), timeout=60)
            admitted.append(name)
            try:
                await trio.sleep_forever()
            finally:
                worker.release()

    leaves, stays = trio.CancelScope(), trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn, "leaves", leaves)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(turn, "stays", stays)
        await trio.testing.wait_all_tasks_blocked()
        assert worker.statistics().waiting == 2
        if first == "granted":
            worker.release()
            leaves.cancel()
        else:
            leaves.cancel()
            worker.release()
        await trio.testing.wait_all_tasks_blocked()
        assert admitted[-1] == "stays"
        assert worker.statistics().held == 1 and worker.statistics().waiting == 0
        stays.cancel()
    assert worker.statistics().held == 0


async def test_the_wait_in_line_is_bounded(autojump_clock: trio.testing.MockClock) -> None:
    worker = AudioWorker(lambda: None, name="text-to-speech", queue_depth=1)
    worker.admit_nowait(_NoJob())
    with pytest.raises(Timeout, match="text-to-speech worker had no place within 5 s"):
        await worker.admit(_NoJob(), timeout=5)
    assert worker.statistics().waiting == 0 and worker.statistics().held == 1
    worker.release()
    await worker.admit(_NoJob(), timeout=5)  # no one in line: at once
    assert worker.statistics().held == 1


async def test_a_waiting_answer_speaks_once_the_voice_is_free() -> None:
    voice = FakeVoice()
    tts = TextToSpeech(TTS_INFO, lambda: voice, queue_depth=1)
    spoken: list[int] = []

    async def answer() -> None:
        async for chunk in tts.synthesize("Waited for.", wait=True):
            spoken.append(len(chunk))

    async with trio.open_nursery() as nursery:
        await nursery.start(tts.run)
        async with contextlib.aclosing(tts.synthesize("One. Two. Three.")) as http:  # type: ignore[type-var]
            await http.__anext__()  # an HTTP listener holds the only place
            async with trio.open_nursery() as callers:
                callers.start_soon(answer)
                await trio.testing.wait_all_tasks_blocked()
                assert tts.statistics().waiting == 1 and not spoken
                with pytest.raises(ServerBusy):  # the HTTP route: 503 as before
                    await tts.synthesize("Refused.").__anext__()
                await http.aclose()  # the listener goes: its place passes on
        assert spoken == [2000]
        assert tts.statistics().held == 0 and tts.statistics().waiting == 0
        nursery.cancel_scope.cancel()


class _NoJob:
    cancelled = False
    deadline = 0.0

    def step(self, backend: object) -> bool:
        return True

    def fail(self, error: object) -> None:
        pass

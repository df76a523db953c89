"""The text-to-speech actor: a Piper voice (or espeak-ng) on its own thread.

``synthesize`` yields 16-bit mono little-endian PCM at ``sample_rate``, one chunk per sentence,
so the first audio is out after the first sentence, not the whole text. Jobs advance a sentence
at a time, the one whose audio is needed soonest first (see ``worker.py``), so many voices can
speak at once.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Protocol

import attrs
import trio

from mlxcel.actors.audio.worker import AudioWorker
from mlxcel.runtime.errors import InvalidRequest, MlxcelError, Timeout
from mlxcel.runtime.messages import AudioWorkerStatistics

__all__ = ["TextToSpeech", "TtsBackend", "TtsInfo", "OPENAI_VOICES"]

# OpenAI's voice names; each is served by the installed voice, so clients written for OpenAI work.
OPENAI_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "nova",
    "onyx",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)

MIN_SPEED = 0.25
MAX_SPEED = 4.0


@attrs.frozen(kw_only=True)
class TtsInfo:
    """What is known about the voice without loading it."""

    model_id: str
    path: Path | None
    # "piper" or "espeak-ng".
    engine: str
    sample_rate: int
    # The installed voice's own names (the first is the default); OpenAI's names map to it.
    voices: tuple[str, ...]

    @property
    def capabilities(self) -> list[str]:
        return ["speech"]


class TtsBackend(Protocol):
    """Built and used only on the worker's thread."""

    def synthesize(self, text: str, voice: str, speed: float) -> Iterator[bytes]:
        """PCM16 mono little-endian at the voice's rate, one chunk per sentence (lazily)."""
        ...


class _SpeechJob:
    def __init__(
        self,
        text: str,
        voice: str,
        speed: float,
        send: trio.MemorySendChannel[bytes],
        *,
        deadline: float,
        sample_rate: int,
    ) -> None:
        self.text = text
        self.voice = voice
        self.speed = speed
        self.cancelled = False
        self.deadline = deadline
        self._bytes_per_second = 2 * sample_rate
        self.error: MlxcelError | None = None
        self._send = send
        self._chunks: Iterator[bytes] | None = None

    # -- worker thread --

    def step(self, backend: TtsBackend) -> bool:
        if self._chunks is None:
            self._chunks = backend.synthesize(self.text, self.voice, self.speed)
        chunk = next(self._chunks, None)
        if chunk is None:
            trio.from_thread.run_sync(self._send.close)
            return True
        # The next sentence is needed once this one has been played.
        self.deadline += len(chunk) / self._bytes_per_second
        try:
            # The channel is unbounded: a slow listener never stalls the thread; memory is
            # bounded by the input text's length.
            trio.from_thread.run_sync(self._send.send_nowait, chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return True  # the listener has gone
        return False

    def fail(self, error: MlxcelError) -> None:
        trio.from_thread.run_sync(self._fail, error)

    def _fail(self, error: MlxcelError) -> None:
        self.error = error
        self._send.close()


class TextToSpeech:
    """The text-to-speech worker actor (one thread, one voice, a bounded queue)."""

    def __init__(
        self,
        info: TtsInfo,
        build: Callable[[], TtsBackend],
        *,
        queue_depth: int = 8,
        timeout: float = 120.0,
        waited: Callable[[str, float], None] = lambda name, seconds: None,
    ) -> None:
        self.info = info
        self.timeout = timeout
        self._worker = AudioWorker(
            build, name="text-to-speech", queue_depth=queue_depth, waited=waited
        )

    @property
    def model_id(self) -> str:
        return self.info.model_id

    @property
    def sample_rate(self) -> int:
        return self.info.sample_rate

    @property
    def capabilities(self) -> list[str]:
        return self.info.capabilities

    @property
    def queued(self) -> int:
        return self._worker.held

    def statistics(self) -> AudioWorkerStatistics:
        return self._worker.statistics()

    def preload(self) -> None:
        """Build the voice now rather than on the first request (non-blocking)."""
        self._worker.preload()

    def voice_for(self, voice: str | None) -> str:
        """The installed voice that serves ``voice`` (None or an OpenAI name: the default)."""
        if voice is None or voice.lower() in OPENAI_VOICES:
            return self.info.voices[0]
        if voice in self.info.voices:
            return voice
        known = ", ".join((*OPENAI_VOICES, *self.info.voices))
        raise InvalidRequest(f"Unknown voice '{voice}'. Voices: {known}.", param="voice")

    @staticmethod
    def check_speed(speed: float) -> float:
        if not (math.isfinite(speed) and MIN_SPEED <= speed <= MAX_SPEED):
            raise InvalidRequest(
                f"speed must be between {MIN_SPEED} and {MAX_SPEED}", param="speed"
            )
        return speed

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ready at once (the voice loads on first use); serves until cancelled."""
        await self._worker.run(task_status=task_status)

    async def synthesize(
        self,
        text: str,
        *,
        voice: str | None = None,
        speed: float = 1.0,
        deadline: float | None = None,
        wait: bool = False,
    ) -> AsyncGenerator[bytes, None]:
        """Speak ``text``: PCM16 mono little-endian chunks at ``sample_rate``, one per sentence.

        ``voice`` is an OpenAI voice name or one of ``info.voices`` (InvalidRequest otherwise);
        ``speed`` is 0.25..4.0. Raises ServerBusy (503) on the first iteration when the queue
        is full, or with ``wait`` (a live voice answer) waits up to ``timeout`` for a place in
        line instead; Timeout (504) when the next sentence takes longer than ``timeout``.
        Closing or cancelling the consumer stops synthesis after the sentence in progress:
        iterate inside ``contextlib.aclosing`` (or a nursery that is cancelled) so the
        generator's cleanup runs promptly. ``deadline`` (``AudioWorker.now()`` clock; default
        now) is when the first audio is wanted: the worker serves the earliest deadline first.
        """
        job_voice = self.voice_for(voice)
        self.check_speed(speed)
        send, receive = trio.open_memory_channel[bytes](math.inf)
        job = _SpeechJob(
            text,
            job_voice,
            speed,
            send,
            deadline=AudioWorker.now() if deadline is None else deadline,
            sample_rate=self.sample_rate,
        )
        if wait:
            await self._worker.admit(job, timeout=self.timeout)
        else:
            self._worker.admit_nowait(job)
        try:
            async with receive:
                while True:
                    chunk: bytes | None = None
                    with trio.move_on_after(self.timeout):
                        try:
                            chunk = await receive.receive()
                        except trio.EndOfChannel:
                            break
                    if chunk is None:
                        raise Timeout(
                            f"The text-to-speech worker did not answer within {self.timeout:g} s "
                            "(see --audio-request-timeout-secs)."
                        )
                    yield chunk
            if job.error is not None:
                raise job.error
        finally:
            job.cancelled = True
            self._worker.release()

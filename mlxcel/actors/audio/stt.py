"""The speech-to-text actor: Whisper on its own thread, behind a bounded queue.

``transcribe`` is the whole public face: float32 mono 16 kHz samples in, a ``Transcription``
out. The model (faster-whisper on a CTranslate2 checkpoint) is built on the worker's thread on
first use; jobs advance one Whisper segment at a time, the most urgent first (see ``worker.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs
import trio

from mlxcel.actors.audio.worker import AudioWorker
from mlxcel.runtime.errors import MlxcelError, Timeout
from mlxcel.runtime.messages import AudioWorkerStatistics, Segment, Transcription, Word

__all__ = [
    "SpeechToText",
    "SttBackend",
    "SttInfo",
    "Segment",
    "Transcription",
    "Word",
    "SAMPLE_RATE",
]

# Whisper reads 16 kHz mono.
SAMPLE_RATE = 16_000

Task = Literal["transcribe", "translate"]


@attrs.frozen(kw_only=True)
class SttInfo:
    """What is known about the speech-to-text model without loading it."""

    model_id: str
    path: Path | None
    # "faster-whisper" (CTranslate2 checkpoints).
    engine: str
    # English-only checkpoints (*.en) transcribe English only; translation is then a no-op.
    multilingual: bool

    @property
    def capabilities(self) -> list[str]:
        return ["transcription", "translation"]


@attrs.frozen(kw_only=True)
class SttOptions:
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    task: Task = "transcribe"
    word_timestamps: bool = False
    # Greedy decoding without timestamps (beam 1): what a live voice turn wants, about twice
    # as fast as the beam of 5 that transcription requests get (faster-whisper's default).
    greedy: bool = False


class SttBackend(Protocol):
    """Built and used only on the worker's thread."""

    def start(self, audio: Any, options: SttOptions) -> tuple[Iterator[Segment], str, float]:
        """Begin decoding: (lazy segments, language, duration in seconds)."""
        ...


class _TranscribeJob:
    def __init__(self, audio: Any, options: SttOptions) -> None:
        self.audio = audio
        self.options = options
        self.cancelled = False
        self._admitted = AudioWorker.now()
        # Wanted now; after each segment, as far on as the audio it covered (see worker.py).
        self.deadline = self._admitted
        self.done = trio.Event()
        self.result: Transcription | None = None
        self.error: MlxcelError | None = None
        self._segments: Iterator[Segment] | None = None
        self._language = ""
        self._duration = 0.0
        self._collected: list[Segment] = []

    # -- worker thread --

    def step(self, backend: SttBackend) -> bool:
        if self._segments is None:
            # Feature extraction (and language detection) happen here: a step of its own.
            self._segments, self._language, self._duration = backend.start(self.audio, self.options)
            self.audio = None
            return False
        segment = next(self._segments, None)
        if segment is not None:
            self._collected.append(segment)
            self.deadline = self._admitted + segment.end
            return False
        segments = tuple(self._collected)
        result = Transcription(
            text="".join(s.text for s in segments).strip(),
            language=self._language,
            duration=self._duration,
            segments=segments,
        )
        trio.from_thread.run_sync(self._finish, result, None)
        return True

    def fail(self, error: MlxcelError) -> None:
        trio.from_thread.run_sync(self._finish, None, error)

    # -- Trio side --

    def _finish(self, result: Transcription | None, error: MlxcelError | None) -> None:
        self.result, self.error = result, error
        self.done.set()


class SpeechToText:
    """The speech-to-text worker actor (one thread, one model, a bounded queue)."""

    def __init__(
        self,
        info: SttInfo,
        build: Callable[[], SttBackend],
        *,
        queue_depth: int = 8,
        timeout: float = 120.0,
        waited: Callable[[str, float], None] = lambda name, seconds: None,
    ) -> None:
        self.info = info
        self.timeout = timeout
        self._worker = AudioWorker(
            build, name="speech-to-text", queue_depth=queue_depth, waited=waited
        )

    @property
    def model_id(self) -> str:
        return self.info.model_id

    @property
    def capabilities(self) -> list[str]:
        return self.info.capabilities

    @property
    def loaded(self) -> bool:
        return self._worker.loaded.is_set() and self._worker.load_error is None

    @property
    def queued(self) -> int:
        return self._worker.held

    def statistics(self) -> AudioWorkerStatistics:
        return self._worker.statistics()

    def preload(self) -> None:
        """Build the model now rather than on the first request (non-blocking)."""
        self._worker.preload()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ready at once (the model loads on first use); serves until cancelled."""
        await self._worker.run(task_status=task_status)

    async def transcribe(
        self,
        audio: Any,
        *,
        language: str | None = None,
        prompt: str | None = None,
        temperature: float = 0.0,
        task: Task = "transcribe",
        word_timestamps: bool = False,
        greedy: bool = False,
        wait: bool = False,
    ) -> Transcription:
        """Transcribe ``audio`` (float32 mono 16 kHz numpy samples), or translate it to English.

        ``temperature`` 0 means Whisper's fallback schedule (0, 0.2, ... 1.0, retried when a
        segment decodes badly), as OpenAI documents. Raises ServerBusy (503) when the queue is
        full, or with ``wait`` (a live voice turn) waits up to ``timeout`` for a place in line
        instead; Timeout (504) after ``timeout`` seconds of work (or of waiting);
        InvalidRequest (400) for a language the model does not know. On cancellation the job
        is dropped: it leaves the line if it waits for a place, is skipped if it is still
        queued, and stops after the segment being decoded otherwise.
        """
        options = SttOptions(
            language=language,
            prompt=prompt,
            temperature=temperature,
            task=task,
            word_timestamps=word_timestamps,
            greedy=greedy,
        )
        job = _TranscribeJob(audio, options)
        if wait:
            await self._worker.admit(job, timeout=self.timeout)
        else:
            self._worker.admit_nowait(job)
        try:
            with trio.move_on_after(self.timeout):
                await job.done.wait()
            if not job.done.is_set():
                raise Timeout(
                    f"The speech-to-text worker did not answer within {self.timeout:g} s "
                    "(see --audio-request-timeout-secs)."
                )
        finally:
            job.cancelled = True
            self._worker.release()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

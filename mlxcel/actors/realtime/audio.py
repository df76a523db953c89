"""Audio plumbing for realtime sessions: PCM16 decoding, resampling, the bounded input buffer.

Everything here is synchronous and cheap; it runs on the Trio thread inside a session's reader.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any

import numpy as np

# The speech-to-text model and the VAD work at 16 kHz.
STT_RATE = 16_000
# One native frame of the VoiceChat protocol: 80 ms at 16 kHz.
FRAME_SAMPLES = 1280


class AudioFormatError(ValueError):
    """An append whose audio cannot be decoded (bad base64, odd byte count, bad rate)."""


def decode_pcm16(audio: object) -> np.ndarray:
    """Base64 little-endian PCM16 mono -> int16 samples. Raises AudioFormatError."""
    if not isinstance(audio, str):
        raise AudioFormatError("'audio' must be a base64 string")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise AudioFormatError("'audio' is not valid base64") from None
    if len(raw) % 2:
        raise AudioFormatError(
            f"'audio' decodes to {len(raw)} bytes: PCM16 needs an even byte count"
        )
    return np.frombuffer(raw, dtype="<i2")


def encode_pcm16(samples: bytes) -> str:
    return base64.b64encode(samples).decode("ascii")


class Resampler:
    """Streaming mono PCM16 rate conversion through libswresample (PyAV).

    Keeps filter state between calls, so chunk boundaries leave no clicks; ``None`` when the
    rates are equal (callers skip it).
    """

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        import av

        self._src = src_rate
        self._dst = dst_rate
        self._av = av
        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=dst_rate)

    def push(self, pcm: np.ndarray) -> np.ndarray:
        """int16 samples at the source rate -> int16 samples at the target rate."""
        if pcm.size == 0:
            return np.zeros(0, dtype=np.int16)
        frame = self._av.AudioFrame.from_ndarray(
            np.ascontiguousarray(pcm, dtype=np.int16).reshape(1, -1), format="s16", layout="mono"
        )
        frame.sample_rate = self._src
        return self._collect(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        return self._collect(self._resampler.resample(None))

    @staticmethod
    def _collect(frames: Sequence[Any]) -> np.ndarray:
        if not frames:
            return np.zeros(0, dtype=np.int16)
        return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.int16)


def resample(pcm: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """One-shot conversion of a whole int16 clip."""
    if src_rate == dst_rate:
        return pcm
    r = Resampler(src_rate, dst_rate)
    return np.concatenate([r.push(pcm), r.flush()])


class InputBuffer:
    """Uncommitted user audio at 16 kHz (float32), with a hard cap in seconds.

    The cap is the per-session bound on buffered audio: an append beyond it is refused (the
    session reports an error and drops that audio), so a client that streams without ever
    committing cannot grow the server's memory.
    """

    def __init__(self, max_seconds: float) -> None:
        self.max_samples = int(max_seconds * STT_RATE)
        self._chunks: list[np.ndarray] = []
        self.samples = 0
        # Samples received over the whole session (the clock for audio_start_ms / frame_index).
        self.total_samples = 0

    def fits(self, n: int) -> bool:
        return self.samples + n <= self.max_samples

    def append(self, samples: np.ndarray) -> None:
        self._chunks.append(samples.astype(np.float32) / 32768.0)
        self.samples += samples.size
        self.total_samples += samples.size

    def take(self) -> np.ndarray:
        """Everything buffered; empties the buffer."""
        audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        self._chunks = []
        self.samples = 0
        return audio

    def peek(self) -> np.ndarray:
        """A copy of everything buffered; the buffer keeps it."""
        audio = self.take()
        self._chunks, self.samples = [audio], audio.size
        return audio.copy()

    def drop_front(self, n: int) -> None:
        """Forget the oldest ``n`` buffered samples (silence before speech)."""
        if n <= 0:
            return
        audio = self.take()
        self._chunks = [audio[n:]]
        self.samples = audio.size - min(n, audio.size)

    def clear(self) -> None:
        self._chunks = []
        self.samples = 0

    @property
    def start_sample(self) -> int:
        """Session-wide index of the first buffered sample."""
        return self.total_samples - self.samples


class InputPace:
    """How fast a session reads its client's audio: a burst of ``burst_seconds``, then at most
    ``speed`` times real time (a token bucket of audio seconds).

    Every audio message is decoded, and run through VAD, on the Trio thread, which all sessions
    and HTTP requests share: a client that sends audio as fast as its link allows took that
    thread from everyone (8 first answers of another session: median 0.59 -> 1.03 s to first
    audio). Past the pace the session waits before it reads the next message, so the client is
    slowed by TCP backpressure; a live microphone (1x) and a recording sent at ``speed`` are
    never held back, and the burst lets a client send a whole buffer's worth at once.
    """

    def __init__(self, speed: float, burst_seconds: float, now: float) -> None:
        self._speed = speed
        self._burst = burst_seconds
        self._credit = burst_seconds
        self._at = now

    def take(self, seconds: float, now: float) -> float:
        """Spend ``seconds`` of audio received at ``now``; how long to wait before reading on."""
        self._credit = min(self._burst, self._credit + (now - self._at) * self._speed)
        self._at = now
        self._credit -= seconds
        return max(0.0, -self._credit / self._speed)

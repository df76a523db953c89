"""Audio in and out of containers (PyAV), and 16-bit PCM helpers.

``decode_audio`` turns any file FFmpeg reads (wav, mp3, flac, ogg/opus, webm, m4a, ...) into the
float32 mono 16 kHz samples Whisper reads. ``Pcm16Resampler`` converts a stream of PCM16 chunks
between rates (22.05 kHz Piper output to the 24 kHz OpenAI clients expect, for example).
These are blocking CPU work: call them from a worker thread (``trio.to_thread.run_sync``).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from mlxcel.runtime.errors import InvalidRequest

# Whisper's input rate.
SAMPLE_RATE = 16_000
# Decoded audio longer than this is refused: a small, highly compressed upload could otherwise
# expand to gigabytes of samples.
MAX_AUDIO_SECONDS = 2 * 3600


def decode_audio(
    data: bytes, *, sample_rate: int = SAMPLE_RATE, max_seconds: float = MAX_AUDIO_SECONDS
) -> np.ndarray:
    """Decode ``data`` (any container FFmpeg knows) to float32 mono samples at ``sample_rate``.

    Raises InvalidRequest (param ``file``) when there is no decodable audio stream or the
    audio is longer than ``max_seconds``.
    """
    import av

    limit = int(max_seconds * sample_rate)
    chunks: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise InvalidRequest("The file has no audio stream.", param="file")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    total += chunks[-1].size
                if total > limit:
                    raise InvalidRequest(
                        f"The audio is longer than {max_seconds:g} seconds.", param="file"
                    )
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except av.FFmpegError as error:
        raise InvalidRequest(
            f"The file could not be decoded as audio ({error.strerror or error}). "
            "Supported: flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav, webm.",
            param="file",
        ) from None
    if not chunks:
        raise InvalidRequest("The file contains no audio.", param="file")
    return np.concatenate(chunks).astype(np.float32, copy=False)


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Little-endian 16-bit PCM -> float32 in [-1, 1)."""
    return np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2").astype(np.float32) / 32768.0


def float_to_pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] -> little-endian 16-bit PCM (clipped)."""
    scaled = np.clip(np.asarray(samples, dtype=np.float32) * 32767.0, -32768, 32767)
    return bytes(scaled.astype("<i2").tobytes())


class Pcm16Resampler:
    """Streaming PCM16 mono rate conversion: ``push`` chunks, then ``flush`` once."""

    def __init__(self, from_rate: int, to_rate: int) -> None:
        import av

        self.from_rate = from_rate
        self.to_rate = to_rate
        self._av = av
        self._resampler: Any = (
            av.AudioResampler(format="s16", layout="mono", rate=to_rate)
            if from_rate != to_rate
            else None
        )
        self._pts = 0

    def push(self, pcm: bytes) -> bytes:
        if self._resampler is None or not pcm:
            return pcm
        samples = np.frombuffer(pcm[: len(pcm) // 2 * 2], dtype="<i2").reshape(1, -1)
        frame = self._av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = self.from_rate
        frame.pts = self._pts
        self._pts += samples.shape[1]
        return b"".join(
            out.to_ndarray().astype("<i2").tobytes() for out in self._resampler.resample(frame)
        )

    def flush(self) -> bytes:
        if self._resampler is None:
            return b""
        return b"".join(
            out.to_ndarray().astype("<i2").tobytes() for out in self._resampler.resample(None)
        )

"""Streaming encoders for /v1/audio/speech: PCM16 chunks in, the bytes of a file out.

    wav    RIFF header (lengths unknown while streaming: the 0xFFFFFFFF placeholder), then PCM
    pcm    raw PCM16 little-endian at 24 kHz, as OpenAI documents its ``pcm`` format
    mp3, flac, opus (in Ogg), aac (ADTS)   encoded by FFmpeg through PyAV

Each encoder is plain synchronous code: ``push`` PCM at the voice's rate, get back whatever
bytes of the file are complete; ``finish`` once for the rest. Encoding is cheap next to
synthesis (milliseconds per sentence), so the route calls it on the event loop's thread.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np

from mlxcel.actors.audio.decode import Pcm16Resampler

# format -> (content type, PyAV container, codec, output rate or None for the voice's rate)
FORMATS: dict[str, tuple[str, str | None, str | None, int | None]] = {
    "mp3": ("audio/mpeg", "mp3", "libmp3lame", None),
    "opus": ("audio/ogg", "ogg", "libopus", 48_000),
    "aac": ("audio/aac", "adts", "aac", None),
    "flac": ("audio/flac", "flac", "flac", None),
    "wav": ("audio/wav", None, None, None),
    "pcm": ("audio/pcm", None, None, 24_000),
}

# OpenAI's pcm format is 24 kHz.
PCM_RATE = 24_000


def available_formats() -> tuple[str, ...]:
    """The formats this install can produce (FFmpeg builds may lack an encoder)."""
    import av

    out = []
    for name, (_, _, codec, _) in FORMATS.items():
        if codec is not None:
            try:
                av.codec.Codec(codec, "w")
            except Exception:  # noqa: BLE001 - PyAV raises different errors per version
                continue
        out.append(name)
    return tuple(out)


def content_type(fmt: str) -> str:
    return FORMATS[fmt][0]


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """A 44-byte PCM16 mono WAV header; ``None`` lengths mean "until the end of the stream"."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data)
    )


class _Sink(io.RawIOBase):
    """A write-only, non-seekable file for FFmpeg's muxer: bytes are taken as they come."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class SpeechEncoder:
    def __init__(self, fmt: str, sample_rate: int) -> None:
        self.format = fmt
        self.content_type, container, codec, rate = FORMATS[fmt]
        self.sample_rate = sample_rate
        self.output_rate = rate or sample_rate
        self._started = False
        self._pcm = Pcm16Resampler(sample_rate, self.output_rate) if fmt == "pcm" else None
        self._container: Any = None
        if container is not None:
            import av

            self._av = av
            self._sink = _Sink()
            self._container = av.open(self._sink, mode="w", format=container)
            stream = self._container.add_stream(codec, rate=self.output_rate)
            stream.layout = "mono"
            self._stream = stream
            ctx = stream.codec_context
            self._resampler = av.AudioResampler(
                format=ctx.format.name,
                layout="mono",
                rate=self.output_rate,
                frame_size=ctx.frame_size or None,
            )
            self._pts = 0

    def push(self, pcm: bytes) -> bytes:
        """Encode one chunk of PCM16 mono at ``sample_rate``; returns the finished bytes."""
        if self.format == "wav":
            head = b"" if self._started else wav_header(self.sample_rate)
            self._started = True
            return head + pcm
        if self._pcm is not None:
            return self._pcm.push(pcm)
        samples = np.frombuffer(pcm[: len(pcm) // 2 * 2], dtype="<i2").reshape(1, -1)
        frame = self._av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += samples.shape[1]
        return self._encode(self._resampler.resample(frame))

    def finish(self) -> bytes:
        """The rest of the file (flushes the encoder and closes the container)."""
        if self.format == "wav":
            return b"" if self._started else wav_header(self.sample_rate, 0)
        if self._pcm is not None:
            return self._pcm.flush()
        out = self._encode(self._resampler.resample(None))
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return out + self._sink.take()

    def close(self) -> None:
        """Release FFmpeg's state without finishing (the listener went away)."""
        if self._container is not None:
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - best effort on an abandoned stream
                pass

    def _encode(self, frames: list[Any]) -> bytes:
        for frame in frames:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        return self._sink.take()

"""Seeded noise as a WAV file: audio the tests can tell apart by seed and length."""

from __future__ import annotations

import io
import wave

import numpy as np


def noise_wav(seed: int, seconds: float = 1.0, rate: int = 16000) -> bytes:
    """``seconds`` of noise at ``rate``, 16-bit mono: what a microphone would send."""
    rng = np.random.default_rng(seed)
    pcm = (rng.standard_normal(int(rate * seconds)) * 3000).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(pcm.tobytes())
    return out.getvalue()

"""Server voice-activity detection: Silero VAD (v6, ONNX) as faster-whisper ships it.

One ``SileroModel`` (an onnxruntime session, thread-safe) serves every realtime session; each
session keeps its own ``VadStream`` (LSTM state, the 64-sample context, a partial window) and
feeds it 16 kHz audio as it arrives. The stream turns speech probabilities into start / stop
events with hysteresis: speech starts after ``start_windows`` windows at or above the threshold
(64 ms, so barge-in is quick) and stops after ``silence_ms`` below ``threshold - 0.15``. A
third of the way into that silence it reports a ``pause`` (the turn has probably ended: the
session starts transcribing early), and ``resume`` if speech comes back before the stop.
``feed`` does the model work, so sessions call it through ``trio.to_thread``.
"""

from __future__ import annotations

import functools
import os

import attrs
import numpy as np

WINDOW = 512  # samples per Silero window at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous window the v6 model sees


class SileroModel:
    def __init__(self) -> None:
        import onnxruntime
        from faster_whisper.utils import get_assets_path

        opts = onnxruntime.SessionOptions()
        # Tiny per-call work: extra threads only cost wake-ups.
        opts.inter_op_num_threads = 1
        opts.intra_op_num_threads = 1
        opts.log_severity_level = 4
        self._session = onnxruntime.InferenceSession(
            os.path.join(get_assets_path(), "silero_vad_v6.onnx"),
            providers=["CPUExecutionProvider"],
            sess_options=opts,
        )

    def run(
        self, windows: np.ndarray, h: np.ndarray, c: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Speech probabilities for consecutive (context + window) rows, and the new state."""
        probs, h, c = self._session.run(None, {"input": windows, "h": h, "c": c})
        return np.asarray(probs).reshape(-1), h, c


@functools.cache
def shared_model() -> SileroModel:
    return SileroModel()


@attrs.frozen
class VadEvent:
    kind: str  # "start" | "pause" | "resume" | "stop"
    # Session-wide sample index (16 kHz) where speech started or stopped.
    sample: int


class VadStream:
    def __init__(
        self,
        model: SileroModel,
        *,
        threshold: float = 0.5,
        silence_ms: int = 500,
        start_windows: int = 2,
        start: int = 0,
    ) -> None:
        self._model = model
        self.threshold = threshold
        self._neg = max(threshold - 0.15, 0.01)
        self._silence_windows = max(1, round(silence_ms * 16 / WINDOW))
        self._pause_windows = max(1, self._silence_windows // 3)
        self._start_windows = start_windows
        self._h = np.zeros((1, 1, 128), np.float32)
        self._c = np.zeros((1, 1, 128), np.float32)
        self._context = np.zeros(CONTEXT, np.float32)
        self._pending = np.zeros(0, np.float32)
        self._position = start  # session-wide sample index of the next window
        self.speaking = False
        self._run = 0  # consecutive windows above (or, while speaking, below) the thresholds
        self._speech_start = 0

    def feed(self, audio: np.ndarray) -> list[VadEvent]:
        """Process float32 16 kHz samples; return the start/stop events they complete."""
        buf = np.concatenate([self._pending, audio]) if self._pending.size else audio
        n = buf.size // WINDOW
        self._pending = buf[n * WINDOW :].copy()
        if n == 0:
            return []
        windows = buf[: n * WINDOW].reshape(n, WINDOW)
        contexts = np.concatenate([self._context[None, :], windows[:-1, -CONTEXT:]])
        self._context = windows[-1, -CONTEXT:].copy()
        probs, self._h, self._c = self._model.run(
            np.concatenate([contexts, windows], axis=1).astype(np.float32), self._h, self._c
        )
        events: list[VadEvent] = []
        for p in probs:
            at = self._position
            self._position += WINDOW
            if not self.speaking:
                self._run = self._run + 1 if p >= self.threshold else 0
                if self._run >= self._start_windows:
                    self.speaking, self._run = True, 0
                    self._speech_start = at - (self._start_windows - 1) * WINDOW
                    events.append(VadEvent("start", self._speech_start))
            else:
                paused = self._run >= self._pause_windows
                self._run = self._run + 1 if p < self._neg else 0
                if self._run == self._pause_windows < self._silence_windows:
                    events.append(VadEvent("pause", self._position - self._run * WINDOW))
                elif paused and self._run == 0:
                    events.append(VadEvent("resume", at))
                if self._run >= self._silence_windows:
                    self.speaking, self._run = False, 0
                    events.append(VadEvent("stop", self._position - self._silence_windows * WINDOW))
        return events

    def reset(self) -> None:
        """Forget speech in progress (after a manual commit or clear); keeps the clock."""
        self.speaking = False
        self._run = 0

"""The engines behind the audio workers; each is built and used only on its worker's thread.

FasterWhisper   Whisper on CTranslate2 (int8 on CPU), through faster-whisper
Piper           a Piper VITS voice on onnxruntime, through piper-tts (GPL: an optional extra)
Espeak          the espeak-ng program, one process per sentence (the small fallback voice)
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from typing import Any

from mlxcel.actors.audio.stt import SttInfo, SttOptions
from mlxcel.actors.audio.tts import TtsInfo
from mlxcel.models.audio import SttModel, TtsModel
from mlxcel.runtime.errors import InternalError, InvalidRequest
from mlxcel.runtime.messages import Segment, Word

# Whisper's default temperature fallback (also OpenAI's meaning of temperature 0).
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def stt_info(model: SttModel) -> SttInfo:
    return SttInfo(
        model_id=model.model_id,
        path=model.path,
        engine=model.engine,
        multilingual=model.multilingual,
    )


def tts_info(model: TtsModel) -> TtsInfo:
    return TtsInfo(
        model_id=model.model_id,
        path=model.path,
        engine=model.engine,
        sample_rate=model.sample_rate,
        voices=model.voices,
    )


GREEDY = {"beam_size": 1, "best_of": 1, "without_timestamps": True}


class FasterWhisper:
    # int8 is the fastest CPU kernel CTranslate2 has, and what faster-whisper suggests for CPU.
    COMPUTE_TYPE = "int8"

    def __init__(self, model: SttModel) -> None:
        from faster_whisper import WhisperModel  # type: ignore[import-untyped]
        from faster_whisper.tokenizer import _LANGUAGE_CODES  # type: ignore[import-untyped]

        self.model = WhisperModel(str(model.path), device="cpu", compute_type=self.COMPUTE_TYPE)
        self.multilingual = model.multilingual
        self.languages = frozenset(_LANGUAGE_CODES)

    def start(self, audio: Any, options: SttOptions) -> tuple[Iterator[Segment], str, float]:
        language = options.language
        if language is not None:
            language = language.lower()
            if not self.multilingual and language != "en":
                raise InvalidRequest(
                    f"This speech-to-text model is English-only; language '{language}' cannot "
                    "be transcribed. Leave language out or use 'en'.",
                    param="language",
                )
            if language not in self.languages:
                raise InvalidRequest(
                    f"Unknown language '{language}': use an ISO-639-1 code such as 'en'",
                    param="language",
                )
        temperature = FALLBACK_TEMPERATURES if options.temperature == 0 else (options.temperature,)
        segments, info = self.model.transcribe(
            audio,
            language=language,
            task=options.task if self.multilingual else "transcribe",
            initial_prompt=options.prompt or None,
            temperature=temperature,
            word_timestamps=options.word_timestamps,
            **(GREEDY if options.greedy else {}),
        )
        return _segments(segments), info.language, float(info.duration)


def _segments(raw: Iterator[Any]) -> Iterator[Segment]:
    # faster-whisper counts segments from 1; OpenAI's verbose_json counts from 0.
    for number, s in enumerate(raw):
        yield Segment(
            id=number,
            seek=int(s.seek),
            start=float(s.start),
            end=float(s.end),
            text=s.text,
            tokens=tuple(s.tokens),
            temperature=float(s.temperature or 0.0),
            avg_logprob=float(s.avg_logprob),
            compression_ratio=float(s.compression_ratio),
            no_speech_prob=float(s.no_speech_prob),
            words=tuple(
                Word(
                    word=w.word,
                    start=float(w.start),
                    end=float(w.end),
                    probability=float(w.probability),
                )
                for w in (s.words or ())
            ),
        )


class Piper:
    def __init__(self, model: TtsModel) -> None:
        from piper import PiperVoice, SynthesisConfig

        self.voice = PiperVoice.load(model.path, model.config_path)
        self.speakers = model.speakers
        self._config = SynthesisConfig

    def synthesize(self, text: str, voice: str, speed: float) -> Iterator[bytes]:
        base = self.voice.config.length_scale
        config = self._config(speaker_id=self.speakers.get(voice), length_scale=base / speed)
        for chunk in self.voice.synthesize(text, config):
            yield chunk.audio_int16_bytes


_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+|\n+")


class Espeak:
    # espeak-ng's default rate in words per minute; --speed scales it.
    WPM = 175

    def __init__(self, model: TtsModel) -> None:
        self.exe = str(model.path)
        self.sample_rate = model.sample_rate

    def synthesize(self, text: str, voice: str, speed: float) -> Iterator[bytes]:
        for sentence in _SENTENCE_END.split(text):
            if not sentence.strip():
                continue
            done = subprocess.run(
                [self.exe, "--stdout", "-v", voice, "-s", str(round(self.WPM * speed)), "--"]
                + [sentence],
                capture_output=True,
                timeout=120,
                check=False,
            )
            if done.returncode != 0:
                raise InternalError(
                    f"espeak-ng failed: {done.stderr.decode(errors='replace').strip()}"
                )
            yield wav_payload(done.stdout)


def wav_payload(data: bytes) -> bytes:
    """The samples of a PCM WAV file, whatever its header claims about lengths.

    Programs that write WAV to a pipe cannot seek back to fill in sizes, so the data chunk's
    length may be a placeholder: everything after its header is taken.
    """
    pos = 12
    while pos + 8 <= len(data):
        tag, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if tag == b"data":
            samples = data[pos + 8 : pos + 8 + size]
            return samples[: len(samples) // 2 * 2]
        pos += 8 + size + (size & 1)
    raise InternalError("espeak-ng produced no audio")

"""The engines behind the audio workers; each is built and used only on its worker's thread.

FasterWhisper   Whisper on CTranslate2 (int8 on CPU), through faster-whisper
Piper           a Piper VITS voice on onnxruntime, through piper-tts (GPL: an optional extra)
Espeak          the espeak-ng program, one process per sentence (the small fallback voice)
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import numpy as np

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

# Live turns read a short window instead of Whisper's fixed 30 s: the turn plus at least
# LIVE_PAD_SECONDS of silence, and at least LIVE_MIN_WINDOW_SECONDS in all. The encoder's cost
# grows with the window (0.03 s for 2 s of audio against 0.77 s for 30 s here), while the
# silence after the words is what lets Whisper end the text: with 3 s of it, tiny.en repeated
# most sentences until its length cap; short turns ("Yes.") loop even with 5 s, and 10 s kept
# 20 test sentences as the 30 s window reads them (within the run-to-run wording noise).
LIVE_PAD_SECONDS = 5
LIVE_MIN_WINDOW_SECONDS = 10
# Longer turns take the normal path (the window saving shrinks, the risk does not).
LIVE_MAX_SECONDS = 20.0
# Speech runs at 2-5 tokens a second; a decode that reaches this cap is looping.
LIVE_TOKENS_PER_SECOND = 6
LIVE_TOKENS_SLACK = 8
# Whisper's own thresholds for a decode worth keeping (faster-whisper's defaults).
COMPRESSION_RATIO_MAX = 2.4
AVG_LOGPROB_MIN = -1.0
NO_SPEECH_MIN = 0.6


class FasterWhisper:
    # int8 is the fastest CPU kernel CTranslate2 has, and what faster-whisper suggests for CPU.
    COMPUTE_TYPE = "int8"

    def __init__(self, model: SttModel) -> None:
        from faster_whisper import WhisperModel
        from faster_whisper.tokenizer import _LANGUAGE_CODES

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
        task = options.task if self.multilingual else "transcribe"
        if options.greedy and not options.word_timestamps:
            if (live := self._live(audio, language, task, options.prompt)) is not None:
                return live
        temperature = FALLBACK_TEMPERATURES if options.temperature == 0 else (options.temperature,)
        segments, info = self.model.transcribe(
            audio,
            language=language,
            task=task,
            initial_prompt=options.prompt or None,
            temperature=temperature,
            word_timestamps=options.word_timestamps,
            # Always given: faster-whisper's feature extractor keeps the last value it saw.
            chunk_length=self.model.feature_extractor.chunk_length,
            **(GREEDY if options.greedy else {}),
        )
        return _segments(segments), info.language, float(info.duration)

    def _live(
        self, audio: Any, language: str | None, task: str, prompt: str | None
    ) -> tuple[Iterator[Segment], str, float] | None:
        """A live turn, greedy on a short window; None when the normal path must decide.

        faster-whisper always pads the features to 30 s, so this drives CTranslate2 directly
        with faster-whisper's own tokenizer, prompt and quality checks. A decode that loops
        (reaches the token cap), compresses too well, or is unsure falls back to the 30 s
        window, which costs only the time already spent.
        """
        import ctranslate2
        from faster_whisper.tokenizer import Tokenizer
        from faster_whisper.transcribe import get_compression_ratio

        samples = np.asarray(audio, dtype=np.float32)
        rate = self.model.feature_extractor.sampling_rate
        duration = samples.size / rate
        if duration > LIVE_MAX_SECONDS or (language is None and self.multilingual):
            return None
        language = language or "en"
        seconds = max(LIVE_MIN_WINDOW_SECONDS, math.ceil(duration) + LIVE_PAD_SECONDS)
        window = np.zeros(seconds * rate, np.float32)
        window[: samples.size] = samples
        extractor = self.model.feature_extractor
        features = extractor(window, chunk_length=extractor.chunk_length)
        # The encoder's first convolution has stride 2.
        features = np.ascontiguousarray(features[None, :, : features.shape[-1] // 2 * 2])
        tokenizer = Tokenizer(
            self.model.hf_tokenizer, self.multilingual, task=task, language=language
        )
        previous = tokenizer.encode(" " + prompt.strip()) if prompt and prompt.strip() else []
        tokens_prompt = self.model.get_prompt(tokenizer, previous, without_timestamps=True)
        cap = int(duration * LIVE_TOKENS_PER_SECOND) + LIVE_TOKENS_SLACK
        result = self.model.model.generate(
            ctranslate2.StorageView.from_array(features),
            [tokens_prompt],
            beam_size=1,
            max_length=len(tokens_prompt) + cap,
            return_scores=True,
            return_no_speech_prob=True,
            suppress_blank=True,
            suppress_tokens=[-1],
        )[0]
        tokens = [t for t in result.sequences_ids[0] if t < tokenizer.eot]
        avg_logprob = result.scores[0] * len(tokens) / (len(tokens) + 1)
        text = tokenizer.decode(tokens)
        compression = float(get_compression_ratio(text.strip())) if text.strip() else 0.0
        if result.no_speech_prob > NO_SPEECH_MIN and avg_logprob < AVG_LOGPROB_MIN:
            text, tokens = "", []  # silence, as Whisper's segment loop would judge it
        elif (
            len(tokens) >= cap
            or _periodic(tokens)
            or compression > COMPRESSION_RATIO_MAX
            or avg_logprob < AVG_LOGPROB_MIN
        ):
            return None
        segment = Segment(
            id=0,
            seek=0,
            start=0.0,
            end=round(duration, 3),
            text=text,
            tokens=tuple(tokens),
            temperature=0.0,
            avg_logprob=float(avg_logprob),
            compression_ratio=compression,
            no_speech_prob=float(result.no_speech_prob),
            words=(),
        )
        return iter([segment] if text.strip() else []), language, duration


def _periodic(tokens: list[int]) -> bool:
    """True when the tokens repeat themselves from the start ("Yes. Yes. Yes.", "Can you hear
    me? Can you"): a short window's typical loop, which ordinary speech almost never is."""
    n = len(tokens)
    return any(tokens[p:] == tokens[: n - p] for p in range(1, n - 1))


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
        import onnxruntime
        from piper import PiperConfig, PiperVoice, SynthesisConfig

        # piper's own ``load`` with onnxruntime's defaults, except that the pool threads
        # sleep between ops instead of spinning: under load that spin is CPU the chat model
        # and the other sessions' speech need (docs/performance.md, realtime).
        options = onnxruntime.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        config = model.config_path or model.path.with_name(model.path.name + ".json")
        self.voice = PiperVoice(
            session=onnxruntime.InferenceSession(
                str(model.path), sess_options=options, providers=["CPUExecutionProvider"]
            ),
            config=PiperConfig.from_dict(json.loads(config.read_text(encoding="utf-8"))),
        )
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

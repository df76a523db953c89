"""Wire shapes of the audio routes: transcription response formats and request validation.

Response formats follow OpenAI's ``whisper-1``: ``json`` ``{"text", "usage"}``, ``text``,
``verbose_json`` (task, language name, duration, segments, words), ``srt`` and ``vtt``.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import Transcription

TRANSCRIPTION_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("word", "segment")
# OpenAI's upload limit for the transcription routes.
MAX_FILE_BYTES = 25 * 1024 * 1024
# OpenAI's limit on /v1/audio/speech input.
MAX_SPEECH_CHARS = 4096

# Model names OpenAI clients send; each is served by the loaded model of that kind.
OPENAI_STT_MODELS = frozenset(
    {"whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "gpt-4o-transcribe-diarize"}
)
OPENAI_TTS_MODELS = frozenset({"tts-1", "tts-1-hd", "gpt-4o-mini-tts"})

# Whisper's language codes and the names verbose_json reports.
LANGUAGE_NAMES = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian",
    "ko": "korean", "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish",
    "pl": "polish", "ca": "catalan", "nl": "dutch", "ar": "arabic", "sv": "swedish",
    "it": "italian", "id": "indonesian", "hi": "hindi", "fi": "finnish", "vi": "vietnamese",
    "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay", "cs": "czech",
    "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian",
    "la": "latin", "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak",
    "te": "telugu", "fa": "persian", "lv": "latvian", "bn": "bengali", "sr": "serbian",
    "az": "azerbaijani", "sl": "slovenian", "kn": "kannada", "et": "estonian",
    "mk": "macedonian", "br": "breton", "eu": "basque", "is": "icelandic", "hy": "armenian",
    "ne": "nepali", "mn": "mongolian", "bs": "bosnian", "kk": "kazakh", "sq": "albanian",
    "sw": "swahili", "gl": "galician", "mr": "marathi", "pa": "punjabi", "si": "sinhala",
    "km": "khmer", "sn": "shona", "yo": "yoruba", "so": "somali", "af": "afrikaans",
    "oc": "occitan", "ka": "georgian", "be": "belarusian", "tg": "tajik", "sd": "sindhi",
    "gu": "gujarati", "am": "amharic", "yi": "yiddish", "lo": "lao", "uz": "uzbek",
    "fo": "faroese", "ht": "haitian creole", "ps": "pashto", "tk": "turkmen",
    "nn": "nynorsk", "mt": "maltese", "sa": "sanskrit", "lb": "luxembourgish",
    "my": "myanmar", "bo": "tibetan", "tl": "tagalog", "mg": "malagasy", "as": "assamese",
    "tt": "tatar", "haw": "hawaiian", "ln": "lingala", "ha": "hausa", "ba": "bashkir",
    "jw": "javanese", "su": "sundanese", "yue": "cantonese",
}  # fmt: skip


@attrs.frozen(kw_only=True)
class SpeechBody:
    """/v1/audio/speech: OpenAI's fields (unknown ones are a 400 naming them)."""

    input: str
    model: str | None = None
    # A voice name, or OpenAI's {"id": ...} object for custom voices.
    voice: Any = None
    response_format: str | None = None
    speed: float | None = None
    instructions: str | None = None
    stream_format: str | None = None


def parse_float(value: str | None, field: str, low: float, high: float, default: float) -> float:
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise InvalidRequest(f"'{field}' must be a number", param=field) from None
    if not (math.isfinite(number) and low <= number <= high):
        raise InvalidRequest(f"'{field}' must be between {low:g} and {high:g}", param=field)
    return number


def choice(value: str | None, field: str, allowed: tuple[str, ...], default: str) -> str:
    if value is None or value == "":
        return default
    if value not in allowed:
        raise InvalidRequest(
            f"'{field}' must be one of {', '.join(allowed)}; got '{value}'", param=field
        )
    return value


def usage(result: Transcription) -> dict[str, Any]:
    # whisper-1 bills by the second, rounded up.
    return {"type": "duration", "seconds": math.ceil(result.duration)}


def verbose_json(
    result: Transcription, task: str, granularities: tuple[str, ...]
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "task": task,
        "language": LANGUAGE_NAMES.get(result.language, result.language),
        "duration": round(result.duration, 3),
        "text": result.text,
    }
    # OpenAI returns segments unless only words were asked for.
    if "segment" in granularities or not granularities:
        body["segments"] = [
            {
                "id": s.id,
                "seek": s.seek,
                "start": round(s.start, 3),
                "end": round(s.end, 3),
                "text": s.text,
                "tokens": list(s.tokens),
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            for s in result.segments
        ]
    if "word" in granularities:
        body["words"] = [
            {"word": w.word.strip(), "start": round(w.start, 3), "end": round(w.end, 3)}
            for s in result.segments
            for w in s.words
        ]
    body["usage"] = usage(result)
    return body


def _timestamp(seconds: float, sep: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{sep}{millis:03d}"


def srt(result: Transcription) -> str:
    blocks = [
        f"{n}\n{_timestamp(s.start, ',')} --> {_timestamp(s.end, ',')}\n{s.text.strip()}\n"
        for n, s in enumerate(result.segments, start=1)
    ]
    return "\n".join(blocks) + ("\n" if blocks else "")


def vtt(result: Transcription) -> str:
    blocks = [
        f"{_timestamp(s.start, '.')} --> {_timestamp(s.end, '.')}\n{s.text.strip()}\n"
        for s in result.segments
    ]
    return "WEBVTT\n\n" + "\n".join(blocks) + ("\n" if blocks else "")

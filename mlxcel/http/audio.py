"""OpenAI audio routes: /v1/audio/transcriptions, /v1/audio/translations, /v1/audio/speech.

Each route checks that its model kind is loaded (501 naming the flag otherwise), validates the
request (400 naming the field), then hands the work to the speech-to-text or text-to-speech
worker (``mlxcel.actors.audio``: a full queue is 503, no answer in time is 504). A client that
goes away cancels the handler, which drops its job from the worker.

Uploads to the transcription routes may be up to 25 MiB (413 beyond), whatever
``--max-request-bytes`` says for JSON bodies: ``AudioUploadRequest`` raises the body limit for
those two paths only, before any byte of the body is read.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Blueprint, Response, request
from quart_trio.wrappers.request import TrioRequest
from werkzeug.exceptions import RequestEntityTooLarge

from mlxcel.actors.audio.decode import decode_audio
from mlxcel.actors.audio.encode import SpeechEncoder, available_formats
from mlxcel.actors.audio.stt import SpeechToText
from mlxcel.actors.audio.tts import TextToSpeech
from mlxcel.actors.realtime.capacity import SessionCapacity
from mlxcel.http import audio_wire as wire
from mlxcel.http.context import ServerContext, read_json, server
from mlxcel.http.errors import error_response
from mlxcel.runtime.codec import structure
from mlxcel.runtime.errors import (
    InvalidRequest,
    NotFound,
    NotImplementedRoute,
    PayloadTooLarge,
    UnsupportedField,
)

bp = Blueprint("audio", __name__)

UPLOAD_PATHS = ("/audio/transcriptions", "/audio/translations")
# The file plus the other form fields and multipart framing.
MAX_UPLOAD_BODY = wire.MAX_FILE_BYTES + 1024 * 1024

TRANSCRIPTION_FIELDS = frozenset(
    {"model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]"}
)
TRANSLATION_FIELDS = frozenset({"model", "prompt", "response_format", "temperature"})


class AudioUploadRequest(TrioRequest):
    """The app's request class: the transcription routes get the 25 MiB upload limit."""

    def __init__(self, *args: Any, max_content_length: int | None = None, **kw: Any) -> None:
        path = args[2] if len(args) > 2 else kw.get("path", "")
        upload = isinstance(path, str) and path.rstrip("/").endswith(UPLOAD_PATHS)
        if upload and max_content_length is not None:
            max_content_length = max(max_content_length, MAX_UPLOAD_BODY)
        super().__init__(*args, max_content_length=max_content_length, **kw)
        if upload:
            self.max_content_length = max_content_length


@bp.errorhandler(RequestEntityTooLarge)
async def _too_large(error: RequestEntityTooLarge) -> Response:
    limit = request.max_content_length
    if request.path.rstrip("/").endswith(UPLOAD_PATHS):
        hint = f": audio files may be up to {wire.MAX_FILE_BYTES // (1024 * 1024)} MiB."
    else:
        # /v1/audio/speech takes JSON, held to --max-request-bytes like any other route.
        hint = " (see --max-request-bytes)"
    return error_response(PayloadTooLarge(f"Request body larger than {limit} bytes{hint}"))


# -- helpers ----------------------------------------------------------------------------------


async def _stt(ctx: ServerContext) -> SpeechToText:
    if ctx.stt is None:
        raise NotImplementedRoute(
            "audio model kind not loaded: stt. This server has no speech-to-text model; start "
            "it without --no-audio, with --stt-model <model>."
        )
    return ctx.stt


async def _tts(ctx: ServerContext) -> TextToSpeech:
    if ctx.tts is None:
        raise NotImplementedRoute(
            "audio model kind not loaded: tts. This server has no text-to-speech voice; start "
            "it without --no-audio, with --tts-model <voice> (or install piper-tts / espeak-ng)."
        )
    return ctx.tts


def _check_model(requested: str | None, model_id: str, openai_names: frozenset[str]) -> None:
    if requested in (None, "", model_id, "default") or requested in openai_names:
        return
    names = ", ".join(sorted(openai_names))
    raise NotFound(
        f"The model '{requested}' does not exist. This route is served by '{model_id}' "
        f"(also reachable as {names} or 'default').",
        param="model",
    )


async def _form(allowed: frozenset[str]) -> tuple[dict[str, list[str]], bytes, str]:
    """The multipart fields, the uploaded file's bytes and its name (400 / 413 as due)."""
    if request.mimetype != "multipart/form-data":
        raise InvalidRequest(
            "The body must be multipart/form-data with the audio in a 'file' part",
            param="file",
        )
    form = await request.form
    files = await request.files
    fields = {key: form.getlist(key) for key in form}
    unknown = sorted(set(fields) - allowed) + sorted(set(files) - {"file"})
    if unknown:
        raise UnsupportedField(unknown[0])
    upload = files.get("file")
    if upload is None:
        raise InvalidRequest("'file' is required: the audio file to transcribe", param="file")
    data = upload.read(wire.MAX_FILE_BYTES + 1)
    if len(data) > wire.MAX_FILE_BYTES:
        raise PayloadTooLarge(
            f"The audio file is larger than {wire.MAX_FILE_BYTES // (1024 * 1024)} MiB.",
        )
    if not data:
        raise InvalidRequest("'file' is empty", param="file")
    return fields, data, upload.filename or ""


def _one(fields: dict[str, list[str]], key: str) -> str | None:
    values = fields.get(key)
    if not values:
        return None
    if len(values) > 1:
        raise InvalidRequest(f"'{key}' was given more than once", param=key)
    return values[0]


def _text(body: str, content_type: str = "text/plain; charset=utf-8") -> Response:
    return Response(body, status=200, content_type=content_type)


def _json(obj: object) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), content_type="application/json")


# -- speech to text ---------------------------------------------------------------------------


async def _transcribe(task: str) -> Response:
    ctx = server()
    stt = await _stt(ctx)
    fields, data, _ = await _form(
        TRANSCRIPTION_FIELDS if task == "transcribe" else TRANSLATION_FIELDS
    )
    _check_model(_one(fields, "model"), stt.model_id, wire.OPENAI_STT_MODELS)
    fmt = wire.choice(
        _one(fields, "response_format"), "response_format", wire.TRANSCRIPTION_FORMATS, "json"
    )
    temperature = wire.parse_float(_one(fields, "temperature"), "temperature", 0.0, 1.0, 0.0)
    granularities = tuple(fields.get("timestamp_granularities[]", ()))
    for g in granularities:
        wire.choice(g, "timestamp_granularities", wire.GRANULARITIES, "segment")
    if granularities and fmt != "verbose_json":
        raise InvalidRequest(
            "timestamp_granularities needs response_format 'verbose_json'",
            param="timestamp_granularities",
        )
    language = _one(fields, "language") or None
    if language is not None and language.lower() not in wire.LANGUAGE_NAMES:
        raise InvalidRequest(
            f"Unknown language '{language}': use an ISO-639-1 code such as 'en'",
            param="language",
        )
    # Decoding is CPU work: off the event loop (it takes well under a second per minute).
    audio = await trio.to_thread.run_sync(decode_audio, data)
    result = await stt.transcribe(
        audio,
        language=language,
        prompt=_one(fields, "prompt") or None,
        temperature=temperature,
        task="translate" if task == "translate" else "transcribe",
        word_timestamps="word" in granularities,
    )
    if fmt == "text":
        return _text(result.text + "\n")
    if fmt == "srt":
        return _text(wire.srt(result))
    if fmt == "vtt":
        return _text(wire.vtt(result), "text/vtt; charset=utf-8")
    if fmt == "verbose_json":
        return _json(wire.verbose_json(result, task, granularities))
    return _json({"text": result.text, "usage": wire.usage(result)})


@bp.post("/v1/audio/transcriptions")
@bp.post("/audio/transcriptions")
async def transcriptions() -> Response:
    return await _transcribe("transcribe")


@bp.post("/v1/audio/translations")
@bp.post("/audio/translations")
async def translations() -> Response:
    return await _transcribe("translate")


# -- text to speech ---------------------------------------------------------------------------


def _speech_request(data: Any, tts: TextToSpeech) -> tuple[str, str, str, float]:
    body = structure(data, wire.SpeechBody)
    _check_model(body.model, tts.model_id, wire.OPENAI_TTS_MODELS)
    text = body.input
    if not text.strip():
        raise InvalidRequest("'input' must be a non-empty string", param="input")
    if len(text) > wire.MAX_SPEECH_CHARS:
        raise InvalidRequest(
            f"'input' is longer than {wire.MAX_SPEECH_CHARS} characters", param="input"
        )
    voice = body.voice
    if isinstance(voice, dict):
        voice = voice.get("id")
    if voice is not None and not isinstance(voice, str):
        raise InvalidRequest("'voice' must be a voice name", param="voice")
    voice = tts.voice_for(voice)
    if body.instructions:
        raise UnsupportedField("instructions", "this voice cannot be steered by instructions")
    if body.stream_format not in (None, "audio"):
        raise UnsupportedField("stream_format", "only 'audio' (the file, chunked) is supported")
    fmt = body.response_format or "mp3"
    formats = available_formats()
    if fmt not in formats:
        raise InvalidRequest(
            f"response_format must be one of {', '.join(formats)}; got {fmt!r}",
            param="response_format",
        )
    speed = 1.0 if body.speed is None else body.speed
    return text, voice, fmt, tts.check_speed(speed)


@bp.post("/v1/audio/speech")
@bp.post("/audio/speech")
async def speech() -> Response:
    ctx = server()
    tts = await _tts(ctx)
    text, voice, fmt, speed = _speech_request(await read_json(), tts)
    chunks = tts.synthesize(text, voice=voice, speed=speed)
    encoder = SpeechEncoder(fmt, tts.sample_rate)
    try:
        # The first sentence before the headers: a full queue or a timeout is still a status.
        first = await anext(chunks)
    except BaseException as error:
        encoder.close()
        await chunks.aclose()
        if isinstance(error, StopAsyncIteration):
            # Only control characters or symbols the voice has no sound for.
            raise InvalidRequest("'input' has nothing the voice can speak", param="input") from None
        raise

    async def body() -> AsyncIterator[bytes]:
        finished = False
        try:
            async with contextlib.aclosing(chunks):
                yield encoder.push(first)
                async for pcm in chunks:
                    out = encoder.push(pcm)
                    if out:
                        yield out
            tail = encoder.finish()
            finished = True
            if tail:
                yield tail
        finally:
            if not finished:
                encoder.close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return Response(body(), content_type=encoder.content_type, headers=headers)


# -- model listings ---------------------------------------------------------------------------


def audio_model_entries(ctx: ServerContext) -> list[dict[str, Any]]:
    """``/v1/models`` ``data[]`` entries for the speech-to-text and text-to-speech models."""
    entries = []
    if ctx.stt is not None:
        info = ctx.stt.info
        entries.append(
            {
                "id": info.model_id,
                "object": "model",
                "created": ctx.created,
                "owned_by": "mlxcel",
                "meta": {"engine": info.engine, "multilingual": info.multilingual},
                "capabilities": info.capabilities,
                "aliases": sorted(wire.OPENAI_STT_MODELS),
            }
        )
    if ctx.tts is not None:
        tinfo = ctx.tts.info
        entries.append(
            {
                "id": tinfo.model_id,
                "object": "model",
                "created": ctx.created,
                "owned_by": "mlxcel",
                "meta": {
                    "engine": tinfo.engine,
                    "sample_rate": tinfo.sample_rate,
                    "voices": list(tinfo.voices),
                },
                "capabilities": tinfo.capabilities,
                "aliases": sorted(wire.OPENAI_TTS_MODELS),
            }
        )
    return entries


def audio_capabilities(ctx: ServerContext) -> dict[str, Any]:
    """The audio part of ``GET /props`` ``capabilities`` (mlxcel extension)."""
    stt = ctx.stt
    tts = ctx.tts
    return {
        "speech_to_text": None
        if stt is None
        else {
            "model": stt.model_id,
            "engine": stt.info.engine,
            "multilingual": stt.info.multilingual,
            "loaded": stt.loaded,
        },
        "text_to_speech": None
        if tts is None
        else {
            "model": tts.model_id,
            "engine": tts.info.engine,
            "sample_rate": tts.sample_rate,
            "voices": list(tts.info.voices),
            "formats": list(available_formats()),
        },
        # The realtime voice WebSocket's session cap and what the server serves at real-time
        # pace (``actors/realtime/capacity.py``); None without it.
        "realtime": None
        if stt is None or tts is None or not ctx.generation
        else _realtime_props(ctx.realtime_capacity()),
    }


def _realtime_props(capacity: SessionCapacity) -> dict[str, Any]:
    return {
        "max_sessions": capacity.limit,
        "capacity": capacity.derived,
        "capacity_from": {
            "parallel": capacity.parallel,
            "audio_queue_depth": capacity.audio_queue_depth,
        },
    }

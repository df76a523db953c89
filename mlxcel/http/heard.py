"""Audio parts (issue 24): ``input_audio`` on chat completions and Responses.

A checkpoint with an audio tower (Gemma 3n / 4 through mlx-vlm: ``MediaProcessor.hears``)
hears the audio itself: each part is decoded here to the waveform its feature extractor reads
(16 kHz mono float32) and passed with the request, and the processor puts the audio's tokens
where the part was (``decode_parts``; the part's length is bounded by what the model's audio
tokens cover).

Any other model hears it through the speech-to-text worker (the one behind
``/v1/audio/transcriptions``): its transcript takes the part's place in the prompt, before
the request is submitted (``transcribe_parts``), and the answer is as good as the transcript.

``--no-audio-input`` turns both off, and audio parts are then refused ("audio input is not
supported"). A part that is not base64, not audio, or too long is a 400 naming it; the
request is not submitted.
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from mlxcel.actors.audio.decode import MAX_AUDIO_SECONDS, decode_audio
from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import ChatPrompt, GenerationRequest


def sniff_audio(data: str) -> str | None:
    """The audio container base64 ``data`` starts with (wav, mp3, flac, ogg), or None: how
    llama-server's ``multimodal_data`` tells audio from images, which carry no type."""
    try:
        head = base64.b64decode(data[:16], validate=True)
    except (binascii.Error, ValueError):
        return None  # not base64: the image reader names the part
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    return None


async def _samples(data: str, where: str, max_seconds: float = MAX_AUDIO_SECONDS) -> Any:
    """The part's audio as 16 kHz mono float32 samples (a 400 naming the part if it is not
    base64, not audio, or longer than ``max_seconds``)."""
    try:
        audio = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(
            f"{where}: input_audio.data is not valid base64", param=where
        ) from None
    try:
        return await trio.to_thread.run_sync(
            functools.partial(decode_audio, audio, max_seconds=max_seconds)
        )
    except InvalidRequest as error:
        raise InvalidRequest(f"{where}: {error.message}", param=where) from None


async def _transcript(stt: Any, data: str, where: str) -> str:
    heard = await stt.transcribe(await _samples(data, where))
    return str(heard.text).strip()


def hears_itself(media: Any) -> bool:
    """Whether the model whose processor is ``media`` (None: a text model) hears audio."""
    return media is not None and bool(media.hears)


def hearing(stt: Any, audio_input: bool, media: Any) -> tuple[bool, bool]:
    """Whether audio parts are taken (``--no-audio-input`` refuses them), and whether the
    model hears them itself (else through speech-to-text, when a speech model is loaded)."""
    native = hears_itself(media)
    return audio_input and (native or stt is not None), audio_input and native


async def hear(request: GenerationRequest, stt: Any, media: Any) -> GenerationRequest:
    """The request with its audio parts ready for the model: decoded for a model that hears
    audio itself (``media``: its ``MediaProcessor``), else transcribed into the prompt."""
    if hears_itself(media):
        return await decode_parts(request, media.max_audio_seconds)
    return await transcribe_parts(request, stt)


async def decode_parts(request: GenerationRequest, max_seconds: float) -> GenerationRequest:
    """The request with each audio reference replaced by its waveform."""
    if not request.audio:
        return request
    waves = [await _samples(ref.data, ref.where, max_seconds) for ref in request.audio]
    return attrs.evolve(request, audio=tuple(waves))


async def keep_items(items: list[dict[str, Any]], max_seconds: float) -> list[dict[str, Any]]:
    """Responses input items for a model that hears audio itself: each ``input_audio`` part
    checked (a 400 naming it, before anything is stored or submitted) and kept in OpenAI's
    shape, ``{"type": "input_audio", "input_audio": {"data", "format"}}``; the request
    decodes it again from there (``responses_wire.chat_audio``), as a chained one does."""

    async def kept(part: dict[str, Any]) -> dict[str, Any]:
        await _samples(part["data"], part["where"], max_seconds)
        return {
            "type": "input_audio",
            "input_audio": {"data": part["data"], "format": part["format"]},
        }

    return await _each_audio_part(items, kept)


async def transcribe_items(items: list[dict[str, Any]], stt: Any) -> list[dict[str, Any]]:
    """Responses input items with each ``input_audio`` part replaced by an ``input_text``
    part holding its transcript (what is stored: the audio itself is not kept)."""

    async def transcribed(part: dict[str, Any]) -> dict[str, Any]:
        return {"type": "input_text", "text": await _transcript(stt, part["data"], part["where"])}

    return await _each_audio_part(items, transcribed)


async def _each_audio_part(
    items: list[dict[str, Any]],
    replace: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
) -> list[dict[str, Any]]:
    """``items`` with each audio part the wire has just read (it names its place in the
    request: ``where``) replaced by ``await replace(part)``, in order."""
    out = []
    for item in items:
        content = item.get("content")
        if item.get("type") == "message" and isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "input_audio" and "where" in part:
                    part = await replace(part)
                parts.append(part)
            item = {**item, "content": parts}
        out.append(item)
    return out


async def transcribe_parts(request: GenerationRequest, stt: Any) -> GenerationRequest:
    """The request with each audio part's placeholder replaced by its transcript."""
    if not request.audio:
        return request
    if stt is None or not isinstance(request.prompt, ChatPrompt):  # the wire refuses first
        raise InvalidRequest("audio input is not supported", param=request.audio[0].where)
    heard = [(r.placeholder, await _transcript(stt, r.data, r.where)) for r in request.audio]
    texts = {placeholder: text for placeholder, text in heard if placeholder}
    # Audio kept as parts (a conversation stored by a model that hears audio, now answered
    # by one that does not) take their transcripts in order.
    in_parts = iter([text for placeholder, text in heard if not placeholder])

    def fill(text: str) -> str:
        for placeholder, transcript in texts.items():
            text = text.replace(placeholder, transcript)
        return text

    def part(p: Any) -> Any:
        if isinstance(p, dict) and p.get("type") == "audio":
            return {"type": "text", "text": next(in_parts, "")}
        return {**p, "text": fill(p["text"])} if isinstance(p, dict) and "text" in p else p

    messages = []
    for message in request.prompt.messages:
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": fill(content)}
        elif isinstance(content, list):
            parts = [part(p) for p in content]
            texts_only = all(isinstance(p, dict) and p.get("type") == "text" for p in parts)
            # All text now: one string, as a text model's template expects.
            joined = "\n".join(p["text"] for p in parts) if texts_only else parts
            message = {**message, "content": joined}
        messages.append(message)
    prompt = attrs.evolve(request.prompt, messages=tuple(messages))
    return attrs.evolve(request, prompt=prompt, audio=())

"""Audio parts heard by a text model (issue 24): ``input_audio`` on chat completions (and
Responses) is transcribed by the speech-to-text worker (the one behind
``/v1/audio/transcriptions``) and its text takes the part's place in the prompt, before the
request is submitted.

The model never sees audio, so the answer is as good as the transcript; ``--no-audio-input``
turns this off, and audio parts are then refused ("audio input is not supported"). A part
that is not base64, not audio, or longer than the transcription route allows is a 400 naming
it; the request is not submitted.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import attrs
import trio

from mlxcel.actors.audio.decode import decode_audio
from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import ChatPrompt, GenerationRequest


async def _transcript(stt: Any, data: str, where: str) -> str:
    try:
        audio = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(
            f"{where}: input_audio.data is not valid base64", param=where
        ) from None
    try:
        samples = await trio.to_thread.run_sync(decode_audio, audio)
    except InvalidRequest as error:
        raise InvalidRequest(f"{where}: {error.message}", param=where) from None
    heard = await stt.transcribe(samples)
    return str(heard.text).strip()


async def transcribe_items(items: list[dict[str, Any]], stt: Any) -> list[dict[str, Any]]:
    """Responses input items with each ``input_audio`` part replaced by an ``input_text``
    part holding its transcript (what is stored: the audio itself is not kept)."""
    out = []
    for item in items:
        content = item.get("content")
        if item.get("type") == "message" and isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "input_audio":
                    text = await _transcript(stt, part["data"], part["where"])
                    part = {"type": "input_text", "text": text}
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
    texts = {ref.placeholder: await _transcript(stt, ref.data, ref.where) for ref in request.audio}

    def fill(text: str) -> str:
        for placeholder, transcript in texts.items():
            text = text.replace(placeholder, transcript)
        return text

    messages = []
    for message in request.prompt.messages:
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": fill(content)}
        elif isinstance(content, list):
            parts = [
                {**p, "text": fill(p["text"])} if isinstance(p, dict) and "text" in p else p
                for p in content
            ]
            message = {**message, "content": parts}
        messages.append(message)
    prompt = attrs.evolve(request.prompt, messages=tuple(messages))
    return attrs.evolve(request, prompt=prompt, audio=())

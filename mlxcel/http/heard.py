"""Audio parts heard by a text model (issue 24): ``input_audio`` on chat completions is
transcribed by the speech-to-text worker (the one behind ``/v1/audio/transcriptions``) and its
text takes the part's place in the prompt, before the request is submitted.

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


async def transcribe_parts(request: GenerationRequest, stt: Any) -> GenerationRequest:
    """The request with each audio part's placeholder replaced by its transcript."""
    if not request.audio:
        return request
    if stt is None or not isinstance(request.prompt, ChatPrompt):  # the wire refuses first
        raise InvalidRequest("audio input is not supported", param=request.audio[0].where)
    texts: dict[str, str] = {}
    for ref in request.audio:
        try:
            data = base64.b64decode(ref.data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(
                f"{ref.where}: input_audio.data is not valid base64", param=ref.where
            ) from None
        try:
            samples = await trio.to_thread.run_sync(decode_audio, data)
        except InvalidRequest as error:
            raise InvalidRequest(f"{ref.where}: {error.message}", param=ref.where) from None
        heard = await stt.transcribe(samples)
        texts[ref.placeholder] = heard.text.strip()

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

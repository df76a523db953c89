"""A realtime session's wire: client events in (parsed into typed messages), server events out.

``RealtimeWire`` wraps the WebSocket and the session's vocabulary (``realtime_voicechat.py``
or ``realtime_openai.py``): ``receive`` turns each client frame into one
``actors/realtime/events.py`` client message, a frame that cannot be one into ``Refused`` (the
session's state machine decides which error it gets), and ``render`` turns a typed server event
into stamped payloads. The session never sees JSON.
"""

from __future__ import annotations

from typing import Any, Protocol

from mlxcel.actors.realtime import events as ev
from mlxcel.actors.realtime.audio import FRAME_SAMPLES, AudioFormatError, decode_pcm16
from mlxcel.actors.realtime.config import ProtocolError, SessionConfig, SessionPatch, new_id
from mlxcel.runtime import json_input
from mlxcel.runtime.errors import InvalidRequest


class Socket(Protocol):
    async def receive(self) -> str | bytes: ...
    async def send(self, data: str) -> None: ...
    async def close(self, code: int, reason: str) -> None: ...
    def hang_up(self) -> bool: ...


class Vocabulary(Protocol):
    name: str
    needs_configure: bool
    frame_index: bool

    def initial_config(self, model: str) -> SessionConfig: ...
    def parse_update(self, session: object) -> SessionPatch: ...
    def render(self, event: ev.ServerEvent) -> list[dict[str, Any]]: ...


class RealtimeWire:
    """What ``RealtimeSession`` reads, writes and closes (its ``Transport``)."""

    def __init__(self, socket: Socket, vocabulary: Vocabulary) -> None:
        self._socket = socket
        self._v = vocabulary
        self.name = vocabulary.name
        self.needs_configure = vocabulary.needs_configure

    def initial_config(self, model: str) -> SessionConfig:
        return self._v.initial_config(model)

    async def receive(self) -> ev.ClientMessage:
        return parse(await self._socket.receive(), self._v)

    def render(self, event: ev.ServerEvent, samples_in: int) -> list[dict[str, Any]]:
        payloads = []
        for p in self._v.render(event):
            p = {**p, "event_id": new_id("event")}
            if self._v.frame_index:
                p["frame_index"] = samples_in // FRAME_SAMPLES
            payloads.append(p)
        return payloads

    async def send(self, data: str) -> None:
        await self._socket.send(data)

    async def close(self, code: int, reason: str) -> None:
        await self._socket.close(code, reason)

    def hang_up(self) -> bool:
        return self._socket.hang_up()


def parse(message: str | bytes, vocabulary: Vocabulary) -> ev.ClientMessage:
    """One client frame as a typed message (``Refused`` when it cannot be one)."""
    if isinstance(message, bytes):
        return ev.Refused("message must be a JSON object")
    try:
        event = json_input.loads(message, where="the event")
    except InvalidRequest as error:  # not JSON, too deep, or a lone surrogate
        return ev.Refused(error.message, param=error.param)
    if not isinstance(event, dict):
        return ev.Refused("message must be a JSON object")
    kind = event.get("type")
    try:
        return _message(event, kind, vocabulary)
    except ProtocolError as error:
        name = kind if isinstance(kind, str) else None
        return ev.Refused(error.message, error.code, error.param, event=True, kind=name)


def _message(event: dict[str, Any], kind: object, vocabulary: Vocabulary) -> ev.ClientMessage:
    if kind == "session.update":
        return ev.UpdateSession(vocabulary.parse_update(event.get("session")))
    if kind == "session.ping":
        return ev.Ping()
    if kind == "session.cancel":
        return ev.CancelSession()
    if kind == "response.cancel":
        return ev.CancelResponse()
    if kind == "input_audio_buffer.append":
        return _append(event, vocabulary)
    if kind == "input_audio_buffer.commit":
        return ev.CommitAudio()
    if kind == "input_audio_buffer.clear":
        return ev.ClearAudio()
    if kind == "response.create":
        return _respond_job(event.get("response"))
    if kind == "conversation.item.create":
        return ev.CreateItem(_item(event.get("item")))
    raise ProtocolError(f"unsupported event type '{kind}'")


def _append(event: dict[str, Any], vocabulary: Vocabulary) -> ev.AppendAudio:
    # VoiceChat frames may name their rate (the session's input rate otherwise); OpenAI
    # Realtime audio is always at the session's rate.
    rate = None
    if vocabulary.name == "voicechat" and "sample_rate" in event:
        rate = event["sample_rate"]
        if isinstance(rate, bool) or not isinstance(rate, int) or not 8000 <= rate <= 48000:
            raise ProtocolError(
                "'sample_rate' must be an integer in 8000..48000", param="sample_rate"
            )
    try:
        pcm = decode_pcm16(event.get("audio"))
    except AudioFormatError as error:
        raise ProtocolError(str(error), code="inference_error", param="audio") from None
    return ev.AppendAudio(pcm, rate)


def _respond_job(response: object) -> ev.CreateResponse:
    if response is None:
        return ev.CreateResponse()
    if not isinstance(response, dict):
        raise ProtocolError("'response' must be an object", param="response")
    job: dict[str, Any] = {}
    for key, value in response.items():
        if key == "instructions" and isinstance(value, str):
            job["instructions"] = value
        elif key == "output_modalities" and value in (["audio"], ["text"]):
            job["output_audio"] = value == ["audio"]
        elif key == "max_output_tokens" and (value == "inf" or isinstance(value, int)):
            job["max_output_tokens"] = None if value == "inf" else value
        elif key in ("conversation",) and value == "auto":
            continue
        elif key == "metadata":
            continue
        else:
            raise ProtocolError(
                f"'response.{key}' is not supported by this server", param=f"response.{key}"
            )
    return ev.CreateResponse(**job)


def _item(item: object) -> ev.Item:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        raise ProtocolError("only message items can be created", param="item")
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        raise ProtocolError("'item.role' must be user, assistant or system", param="item.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise ProtocolError("'item.content' must be a non-empty list", param="item.content")
    texts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise ProtocolError(
                "only text content parts (input_text / output_text / text) are supported",
                param="item.content",
            )
        texts.append(part["text"])
    given = item.get("id")
    item_id = given if isinstance(given, str) else new_id("item")
    return ev.Item(item_id, role, "".join(texts))


__all__ = ["RealtimeWire", "Socket", "Vocabulary", "parse"]

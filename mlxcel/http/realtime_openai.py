"""The OpenAI Realtime (GA) vocabulary: what the official SDK's ``realtime.connect()`` speaks.

Audio is ``audio/pcm`` at 24 kHz both ways (the session resamples). Turn detection is
``server_vad`` by default, as OpenAI's is. Fields we cannot honour (tools, semantic VAD, other
audio formats, ...) are refused with an ``error`` naming them.
"""

from __future__ import annotations

from typing import Any

from mlxcel.actors.realtime.config import (
    MAX_SESSION_SECONDS,
    ProtocolError,
    ResponseState,
    SessionConfig,
    SessionPatch,
    TurnDetection,
)
from mlxcel.http.realtime_voicechat import (
    OPENAI_RATE,
    CommonEvents,
    Event,
    _common_field,
    _string,
    _td,
    truncation_wire,
)

# Keys of session.update that may be present with their "off" value.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "type": ("realtime",),
    "tools": ([],),
    "tool_choice": ("auto", "none"),
    "tracing": (None,),
    "include": (None, []),
    "parallel_tool_calls": (True, False),
}


class OpenAIRealtime(CommonEvents):
    name = "openai"
    needs_configure = False
    frame_index = False

    def initial_config(self, model: str) -> SessionConfig:
        return SessionConfig(
            model=model,
            multi_turn=True,
            turn_detection=TurnDetection(),
            input_rate=OPENAI_RATE,
            output_rate=OPENAI_RATE,
        )

    def apply_update(self, cfg: SessionConfig, session: object, *, first: bool) -> None:
        """Apply a ``session.update`` to ``cfg`` (the session itself gets ``parse_update``'s
        patch)."""
        self.parse_update(session).apply(cfg)

    def parse_update(self, session: object) -> SessionPatch:
        patch = SessionPatch()
        if not isinstance(session, dict):
            raise ProtocolError("'session' must be an object", param="session")
        for key, value in session.items():
            param = f"session.{key}"
            if key in _NEUTRAL:
                if value not in _NEUTRAL[key]:
                    raise ProtocolError(f"'{param}' is not supported by this server", param=param)
            elif key == "instructions":
                patch.set("instructions", _string(value, param))
            elif key == "output_modalities":
                if value not in (["audio"], ["text"]):
                    raise ProtocolError(f'\'{param}\' must be ["audio"] or ["text"]', param=param)
                patch.set("output_audio", value == ["audio"])
            elif key == "audio":
                self._audio(patch, value, param)
            elif not _common_field(patch, key, value, param):
                raise ProtocolError(f"'{param}' is not supported by this server", param=param)
        return patch

    def _audio(self, patch: SessionPatch, audio: object, param: str) -> None:
        if not isinstance(audio, dict):
            raise ProtocolError(f"'{param}' must be an object", param=param)
        for side, conf in audio.items():
            p = f"{param}.{side}"
            if side not in ("input", "output") or not isinstance(conf, dict):
                raise ProtocolError(f"'{p}' is not supported by this server", param=p)
            for key, value in conf.items():
                q = f"{p}.{key}"
                if key == "format":
                    if not isinstance(value, dict) or value.get("type", "audio/pcm") != "audio/pcm":
                        raise ProtocolError(f"'{q}' must be audio/pcm", param=q)
                    if value.get("rate", OPENAI_RATE) != OPENAI_RATE:
                        raise ProtocolError(f"'{q}.rate' must be 24000", param=q)
                elif side == "input" and key == "turn_detection":
                    _common_field(patch, key, value, q)
                elif side == "input" and key == "transcription":
                    self._transcription(patch, value, q)
                elif side == "input" and key == "noise_reduction" and value is None:
                    continue
                elif side == "output" and key in ("voice", "speed"):
                    _common_field(patch, key, value, q)
                else:
                    raise ProtocolError(f"'{q}' is not supported by this server", param=q)

    def _transcription(self, patch: SessionPatch, value: object, param: str) -> None:
        if value is None:
            return
        if not isinstance(value, dict):
            raise ProtocolError(f"'{param}' must be an object", param=param)
        for key, v in value.items():
            if key == "model":
                _string(v, f"{param}.model")  # the served Whisper model transcribes
            elif key == "language":
                patch.set("language", _string(v, f"{param}.language"))
            elif key == "prompt":
                patch.set("transcription_prompt", _string(v, f"{param}.prompt"))
            else:
                raise ProtocolError(f"'{param}.{key}' is not supported", param=f"{param}.{key}")

    def _session(self, sid: str, cfg: SessionConfig) -> dict[str, Any]:
        fmt = {"type": "audio/pcm", "rate": OPENAI_RATE}
        td = cfg.turn_detection
        return {
            "type": "realtime",
            "id": sid,
            "object": "realtime.session",
            "model": cfg.model,
            "output_modalities": ["audio"] if cfg.output_audio else ["text"],
            "instructions": cfg.instructions,
            "max_output_tokens": "inf" if cfg.max_output_tokens is None else cfg.max_output_tokens,
            "tools": [],
            "tool_choice": "auto",
            "tracing": None,
            "truncation": truncation_wire(cfg.truncation),
            "audio": {
                "input": {
                    "format": fmt,
                    "transcription": {"model": "whisper-1", "language": cfg.language},
                    "noise_reduction": None,
                    "turn_detection": None if td is None else {"type": "server_vad", **_td(td)},
                },
                "output": {"format": fmt, "voice": cfg.voice or "alloy", "speed": cfg.speed},
            },
            "expires_at": 0,
        }

    def session_created(self, sid: str, cfg: SessionConfig) -> list[Event]:
        return [{"type": "session.created", "session": self._session(sid, cfg)}]

    def session_updated(self, sid: str, cfg: SessionConfig) -> list[Event]:
        return [{"type": "session.updated", "session": self._session(sid, cfg)}]

    def committed(self, item_id: str, previous: str | None) -> list[Event]:
        return [
            {
                "type": "input_audio_buffer.committed",
                "item_id": item_id,
                "previous_item_id": previous,
            }
        ]

    def user_item(self, item_id: str, previous: str | None, text: str | None) -> list[Event]:
        """A user message entered the conversation (audio: transcript still to come)."""
        part = (
            {"type": "input_audio", "transcript": None}
            if text is None
            else {"type": "input_text", "text": text}
        )
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [part],
        }
        return [
            {"type": "conversation.item.added", "previous_item_id": previous, "item": item},
            {"type": "conversation.item.done", "previous_item_id": previous, "item": item},
        ]

    def transcript(self, item_id: str, text: str) -> list[Event]:
        return [
            {
                "type": "conversation.item.input_audio_transcription.delta",
                "item_id": item_id,
                "content_index": 0,
                "delta": text,
            },
            {
                "type": "conversation.item.input_audio_transcription.completed",
                "item_id": item_id,
                "content_index": 0,
                "transcript": text,
                "usage": {"type": "duration", "seconds": 0.0},
            },
        ]

    def _item(self, r: ResponseState) -> dict[str, Any]:
        part: dict[str, Any] = (
            {"type": "output_audio", "transcript": r.heard}
            if r.output_audio
            else {"type": "output_text", "text": r.text}
        )
        return {
            "id": r.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": "in_progress" if r.status == "in_progress" else "completed",
            "content": [part] if r.status != "in_progress" else [],
        }

    def _response(self, r: ResponseState) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": r.id,
            "object": "realtime.response",
            "status": r.status,
            "output_modalities": ["audio"] if r.output_audio else ["text"],
            "output": [self._item(r)] if r.status != "in_progress" else [],
            "usage": {
                "input_tokens": r.input_tokens,
                "output_tokens": r.output_tokens,
                "total_tokens": r.input_tokens + r.output_tokens,
            },
        }
        if r.status != "completed" and r.status != "in_progress":
            body["status_details"] = {"type": r.status, "reason": r.reason}
        return body

    def _where(self, r: ResponseState) -> dict[str, Any]:
        return {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}

    def response_created(self, r: ResponseState) -> list[Event]:
        kind = "audio" if r.output_audio else "text"
        item = self._item(r)
        return [
            {"type": "response.created", "response": self._response(r)},
            {
                "type": "response.output_item.added",
                "response_id": r.id,
                "output_index": 0,
                "item": item,
            },
            {"type": "conversation.item.added", "previous_item_id": None, "item": item},
            {
                "type": "response.content_part.added",
                **self._where(r),
                "part": {"type": kind, "transcript": ""}
                if r.output_audio
                else {"type": kind, "text": ""},
            },
        ]

    def text_delta(self, r: ResponseState, delta: str) -> list[Event]:
        if r.output_audio:
            return []  # the transcript follows the audio instead (see spoken)
        return [{"type": "response.output_text.delta", **self._where(r), "delta": delta}]

    def audio_delta(self, r: ResponseState, b64: str) -> list[Event]:
        return [{"type": "response.output_audio.delta", **self._where(r), "delta": b64}]

    def spoken(self, r: ResponseState, piece: str) -> list[Event]:
        # The deltas join into the final transcript, which puts a space between pieces.
        delta = piece if len(r.spoken_pieces) <= 1 else " " + piece
        return [
            {"type": "response.output_audio_transcript.delta", **self._where(r), "delta": delta}
        ]

    def response_done(self, r: ResponseState) -> list[Event]:
        w = self._where(r)
        item = self._item(r)
        if r.output_audio:
            ends: list[Event] = [
                {"type": "response.output_audio.done", **w},
                {"type": "response.output_audio_transcript.done", **w, "transcript": r.heard},
            ]
            part = {"type": "audio", "transcript": r.heard}
        else:
            ends = [{"type": "response.output_text.done", **w, "text": r.text}]
            part = {"type": "text", "text": r.text}
        return [
            *ends,
            {"type": "response.content_part.done", **w, "part": part},
            {
                "type": "response.output_item.done",
                "response_id": r.id,
                "output_index": 0,
                "item": item,
            },
            {"type": "conversation.item.done", "previous_item_id": None, "item": item},
            {"type": "response.done", "response": self._response(r)},
        ]

    def error(self, code: str, message: str, param: str | None) -> Event:
        kind = (
            "server_error"
            if code in ("inference_error", "server_busy", "server_shutting_down")
            else "invalid_request_error"
        )
        return {
            "type": "error",
            "error": {"type": kind, "code": code, "message": message, "param": param},
        }


__all__ = ["MAX_SESSION_SECONDS", "OpenAIRealtime"]

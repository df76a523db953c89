"""The two event vocabularies a realtime session speaks, chosen per session at the handshake.

``VoiceChat`` (here) is the seed's protocol (reference/mlxcel-surface.md §5) plus documented
additions; ``OpenAIRealtime`` (``realtime_openai.py``) is the OpenAI Realtime (GA) vocabulary,
enough for the official SDK's ``client.realtime.connect()``. Each parses ``session.update`` into
a ``SessionPatch`` and renders the session's typed server events (``actors/realtime/events.py``)
into the wire payloads of its vocabulary (``realtime_wire.py`` adds ``event_id``).
"""

from __future__ import annotations

import abc
from typing import Any, assert_never

from mlxcel.actors.realtime import events as ev
from mlxcel.actors.realtime.audio import FRAME_SAMPLES, encode_pcm16
from mlxcel.actors.realtime.config import (
    MAX_SESSION_SECONDS,
    ProtocolError,
    ResponseState,
    SessionConfig,
    SessionPatch,
    TurnDetection,
)
from mlxcel.runtime.truncation import Truncation

Event = dict[str, Any]

# OpenAI Realtime carries PCM16 at 24 kHz both ways.
OPENAI_RATE = 24_000


def _number(value: object, param: str, *, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"'{param}' must be a number", param=param)
    if not low <= value <= high:
        raise ProtocolError(f"'{param}' must be between {low:g} and {high:g}", param=param)
    return float(value)


def _tokens(value: object, param: str) -> int | None:
    if value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise ProtocolError(f"'{param}' must be an integer in 1..4096 or \"inf\"", param=param)
    return value


def _string(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"'{param}' must be a string", param=param)
    return value


def _turn_detection(value: object, param: str) -> TurnDetection | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(f"'{param}' must be an object or null", param=param)
    kind = value.get("type", "server_vad")
    if kind != "server_vad":
        raise ProtocolError(
            f"'{param}.type' {kind!r} is not supported (use server_vad)", param=param
        )
    td = TurnDetection()
    for key, v in value.items():
        p = f"{param}.{key}"
        if key == "type":
            continue
        elif key == "threshold":
            td.threshold = _number(v, p, low=0.05, high=0.95)
        elif key == "prefix_padding_ms":
            td.prefix_padding_ms = int(_number(v, p, low=0, high=2000))
        elif key == "silence_duration_ms":
            td.silence_duration_ms = int(_number(v, p, low=64, high=5000))
        elif key in ("create_response", "interrupt_response"):
            if not isinstance(v, bool):
                raise ProtocolError(f"'{p}' must be a boolean", param=p)
            setattr(td, key, v)
        elif key == "idle_timeout_ms" and v is None:
            continue
        else:
            raise ProtocolError(f"'{p}' is not supported by this server", param=p)
    return td


def _truncation(value: object, param: str) -> Truncation | None:
    """OpenAI Realtime's ``truncation``: "auto", "disabled" or a retention-ratio object."""
    if value == "auto":
        return Truncation()
    if value == "disabled":
        return None
    if not isinstance(value, dict) or value.get("type") != "retention_ratio":
        raise ProtocolError(
            f'\'{param}\' must be "auto", "disabled" or {{"type": "retention_ratio", ...}}',
            param=param,
        )
    if "retention_ratio" not in value:
        raise ProtocolError(
            f"'{param}.retention_ratio' is required", param=f"{param}.retention_ratio"
        )
    ratio = _number(value["retention_ratio"], f"{param}.retention_ratio", low=0.0, high=1.0)
    post = None
    for key, v in value.items():
        p = f"{param}.{key}"
        if key == "token_limits" and v is not None:
            if not isinstance(v, dict):
                raise ProtocolError(f"'{p}' must be an object", param=p)
            for name, limit in v.items():
                q = f"{p}.{name}"
                if name != "post_instructions":
                    raise ProtocolError(f"'{q}' is not supported by this server", param=q)
                if limit is not None:
                    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                        raise ProtocolError(f"'{q}' must be a positive integer", param=q)
                    post = limit
        elif key not in ("type", "retention_ratio", "token_limits"):
            raise ProtocolError(f"'{p}' is not supported by this server", param=p)
    return Truncation(retention_ratio=ratio, post_instructions=post)


def truncation_wire(truncation: Truncation | None) -> object:
    """``truncation`` as ``session.updated`` shows it."""
    if truncation is None:
        return "disabled"
    if truncation == Truncation():
        return "auto"
    limits = (
        None
        if truncation.post_instructions is None
        else {"post_instructions": truncation.post_instructions}
    )
    return {
        "type": "retention_ratio",
        "retention_ratio": truncation.retention_ratio,
        "token_limits": limits,
    }


def _common_field(patch: SessionPatch, key: str, value: object, param: str) -> bool:
    """Fields both vocabularies accept under the same name. False: not one of them."""
    if key == "model":
        _string(value, param)  # any name; the served model answers
    elif key == "temperature":
        patch.set("temperature", _number(value, param, low=0.0, high=2.0))
    elif key in ("max_output_tokens", "max_response_output_tokens"):
        patch.set("max_output_tokens", _tokens(value, param))
    elif key == "idle_timeout_s":
        patch.set("idle_timeout", _number(value, param, low=1.0, high=MAX_SESSION_SECONDS))
    elif key == "voice":
        patch.set("voice", _string(value, param))
    elif key == "speed":
        patch.set("speed", _number(value, param, low=0.25, high=4.0))
    elif key == "turn_detection":
        patch.set("turn_detection", _turn_detection(value, param))
    elif key == "truncation":
        patch.set("truncation", _truncation(value, param))
    else:
        return False
    return True


class CommonEvents(abc.ABC):
    """Events both vocabularies spell the same way, and the dispatch from a typed event; each
    vocabulary spells the abstract ones its own way."""

    def render(self, event: ev.ServerEvent) -> list[Event]:
        """The wire payloads of one server event (without ``event_id``)."""
        match event:
            case ev.SessionCreated(sid, cfg):
                return self.session_created(sid, cfg)
            case ev.SessionUpdated(sid, cfg):
                return self.session_updated(sid, cfg)
            case ev.SpeechStarted(item_id, ms):
                return self.speech_started(item_id, ms)
            case ev.SpeechStopped(item_id, ms):
                return self.speech_stopped(item_id, ms)
            case ev.Cleared():
                return self.cleared()
            case ev.Pong():
                return self.pong()
            case ev.Committed(item_id, previous):
                return self.committed(item_id, previous)
            case ev.UserItem(item_id, previous, text):
                return self.user_item(item_id, previous, text)
            case ev.Transcript(item_id, text):
                return self.transcript(item_id, text)
            case ev.ResponseCreated(r):
                return self.response_created(r)
            case ev.TextDelta(r, delta):
                return self.text_delta(r, delta)
            case ev.AudioDelta(r, pcm):
                return self.audio_delta(r, encode_pcm16(pcm))
            case ev.Spoken(r, piece):
                return self.spoken(r, piece)
            case ev.ResponseDone(r):
                return self.response_done(r)
            case ev.Error(code, message, param):
                return [self.error(code, message, param)]
            case _:
                assert_never(event)

    @abc.abstractmethod
    def session_created(self, sid: str, cfg: SessionConfig) -> list[Event]: ...

    @abc.abstractmethod
    def session_updated(self, sid: str, cfg: SessionConfig) -> list[Event]: ...

    @abc.abstractmethod
    def committed(self, item_id: str, previous: str | None) -> list[Event]: ...

    @abc.abstractmethod
    def user_item(self, item_id: str, previous: str | None, text: str | None) -> list[Event]: ...

    @abc.abstractmethod
    def transcript(self, item_id: str, text: str) -> list[Event]: ...

    @abc.abstractmethod
    def response_created(self, r: ResponseState) -> list[Event]: ...

    @abc.abstractmethod
    def text_delta(self, r: ResponseState, delta: str) -> list[Event]: ...

    @abc.abstractmethod
    def audio_delta(self, r: ResponseState, b64: str) -> list[Event]: ...

    @abc.abstractmethod
    def spoken(self, r: ResponseState, piece: str) -> list[Event]: ...

    @abc.abstractmethod
    def response_done(self, r: ResponseState) -> list[Event]: ...

    @abc.abstractmethod
    def error(self, code: str, message: str, param: str | None) -> Event: ...

    def speech_started(self, item_id: str, ms: int) -> list[Event]:
        return [
            {"type": "input_audio_buffer.speech_started", "audio_start_ms": ms, "item_id": item_id}
        ]

    def speech_stopped(self, item_id: str, ms: int) -> list[Event]:
        return [
            {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ms, "item_id": item_id}
        ]

    def cleared(self) -> list[Event]:
        return [{"type": "input_audio_buffer.cleared"}]

    def pong(self) -> list[Event]:
        return [{"type": "session.pong"}]


class VoiceChat(CommonEvents):
    """The seed's VoiceChat events; every server event also carries ``frame_index``."""

    name = "voicechat"
    needs_configure = True
    frame_index = True

    def __init__(self, output_rate: int) -> None:
        self.output_rate = output_rate

    def initial_config(self, model: str) -> SessionConfig:
        return SessionConfig(model=model, multi_turn=False, output_rate=self.output_rate)

    def apply_update(self, cfg: SessionConfig, session: object, *, first: bool) -> None:
        """Apply a ``session.update`` to ``cfg`` (the session itself gets ``parse_update``'s
        patch and refuses a second update in its state machine)."""
        if not first:
            raise ProtocolError(
                "the session is already configured", code="session_initialization_failed"
            )
        self.parse_update(session).apply(cfg)

    def parse_update(self, session: object) -> SessionPatch:
        if not isinstance(session, dict):
            raise ProtocolError("'session' must be an object", param="session")
        patch = SessionPatch()
        for key, value in session.items():
            param = f"session.{key}"
            if _common_field(patch, key, value, param):
                continue
            if key in ("system_prompt", "instructions"):
                patch.set("instructions", _string(value, param))
            elif key == "seed":
                patch.set("seed", _seed(value, param))
            elif key == "max_streaming_seconds":
                # Clamped, as the seed does.
                patch.set(
                    "max_seconds", min(_number(value, param, low=1, high=1e9), MAX_SESSION_SECONDS)
                )
            elif key == "multi_turn":
                if not isinstance(value, bool):
                    raise ProtocolError(f"'{param}' must be a boolean", param=param)
                patch.set("multi_turn", value)
            elif key == "language":
                patch.set("language", _string(value, param))
            else:
                raise ProtocolError(
                    f"'{param}' is not supported by this server",
                    code="session_initialization_failed",
                    param=param,
                )
        if patch.values.get("turn_detection") is not None:
            # Turns that end by themselves only make sense in a session that goes on (a
            # VoiceChat session is configured once, from a config without turn detection).
            patch.set("multi_turn", True)
        return patch

    def _session(self, sid: str, cfg: SessionConfig, state: str) -> dict[str, Any]:
        return {
            "id": sid,
            "state": state,
            "input_audio_format": {"type": "pcm16", "sample_rate": cfg.input_rate},
            "output_audio_format": {"type": "pcm16", "sample_rate": cfg.output_rate},
        }

    def session_created(self, sid: str, cfg: SessionConfig) -> list[Event]:
        return [{"type": "session.created", "session": self._session(sid, cfg, "configuring")}]

    def session_updated(self, sid: str, cfg: SessionConfig) -> list[Event]:
        td = cfg.turn_detection
        session = {
            **self._session(sid, cfg, "ready"),
            "model": cfg.model,
            "frame_samples": FRAME_SAMPLES,
            "formats": {"input": ["pcm16"], "output": ["pcm16"]},
            "system_prompt": cfg.instructions,
            "seed": cfg.seed,
            "max_streaming_seconds": cfg.max_seconds,
            "idle_timeout_s": cfg.idle_timeout,
            "multi_turn": cfg.multi_turn,
            "turn_detection": None if td is None else {"type": "server_vad", **_td(td)},
            "voice": cfg.voice,
            "truncation": truncation_wire(cfg.truncation),
        }
        return [{"type": "session.updated", "session": session}]

    def committed(self, item_id: str, previous: str | None) -> list[Event]:
        return [{"type": "input_audio_buffer.committed", "item_id": item_id}]

    def user_item(self, item_id: str, previous: str | None, text: str | None) -> list[Event]:
        return []

    def transcript(self, item_id: str, text: str) -> list[Event]:
        return [
            {
                "type": "conversation.item.input_audio_transcription.delta",
                "item_id": item_id,
                "delta": text,
                "transcript": text,
            },
            {
                "type": "conversation.item.input_audio_transcription.completed",
                "item_id": item_id,
                "transcript": text,
            },
        ]

    def response_created(self, r: ResponseState) -> list[Event]:
        return [{"type": "response.created", "response": {"id": r.id, "status": r.status}}]

    def text_delta(self, r: ResponseState, delta: str) -> list[Event]:
        return [{"type": "response.text.delta", "token_id": None, "delta": delta, "text": r.text}]

    def audio_delta(self, r: ResponseState, b64: str) -> list[Event]:
        return [
            {
                "type": "response.audio.delta",
                "delta": b64,
                "format": "pcm16",
                "sample_rate": self.output_rate,
                "channels": 1,
                "audio_codes": [],
            }
        ]

    def spoken(self, r: ResponseState, piece: str) -> list[Event]:
        return []

    def response_done(self, r: ResponseState) -> list[Event]:
        body = {
            "id": r.id,
            "status": r.status,
            "text": r.text,
            "spoken": r.spoken,
            "usage": {"input_tokens": r.input_tokens, "output_tokens": r.output_tokens},
        }
        if r.status == "cancelled":
            return [{"type": "response.cancelled", "response": body}]
        return [{"type": "response.done", "response": body}]

    def error(self, code: str, message: str, param: str | None) -> Event:
        return {"type": "error", "error": {"code": code, "message": message, "param": param}}


def _seed(value: object, param: str) -> int:
    # The seed accepts an integer, a whole float or a numeric string.
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ProtocolError(
        f"'{param}' must be a non-negative integer",
        code="session_initialization_failed",
        param=param,
    )


def _td(td: TurnDetection) -> dict[str, Any]:
    return {
        "threshold": td.threshold,
        "prefix_padding_ms": td.prefix_padding_ms,
        "silence_duration_ms": td.silence_duration_ms,
        "create_response": td.create_response,
        "interrupt_response": td.interrupt_response,
    }

"""``/v1/realtime``: the realtime voice WebSocket (one RealtimeSession actor per connection).

The handshake is checked before the upgrade is accepted, so failures are plain HTTP answers:
401 without a valid key (``Authorization: Bearer``, ``X-Api-Key``, or from a browser the
subprotocol ``openai-insecure-api-key.<key>`` next to ``realtime``; a key in the query
string is refused even when valid, because query strings end up in access logs), 501 when the
server has no chat model, speech-to-text or text-to-speech. A connection beyond the session
cap (``--realtime-max-sessions``, by default what the server serves at real-time pace:
``actors/realtime/capacity.py``) is accepted, told ``error{code:"server_busy"}`` and closed 1013.

Vocabulary: ``?protocol=openai`` or ``?protocol=voicechat`` chooses; without it a ``model``
query parameter (what the OpenAI SDK's ``realtime.connect(model=...)`` sends) selects OpenAI
Realtime, anything else the seed's VoiceChat protocol.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable
from typing import cast

import attrs
import trio
from quart import Blueprint, Quart, Response, current_app, websocket

from mlxcel.actors.realtime.capacity import SessionCapacity
from mlxcel.actors.realtime.config import new_id
from mlxcel.actors.realtime.vad import shared_model
from mlxcel.actors.realtime_voice import RealtimeSession, VoiceDeps
from mlxcel.http.context import ServerContext, server
from mlxcel.http.errors import envelope, error_response
from mlxcel.http.hangup import HANG_UP
from mlxcel.http.realtime_openai import OpenAIRealtime
from mlxcel.http.realtime_voicechat import VoiceChat
from mlxcel.http.realtime_wire import RealtimeWire, Vocabulary
from mlxcel.http.security import UNAUTHORIZED, key_ok
from mlxcel.models import blas
from mlxcel.runtime.errors import (
    AuthenticationFailed,
    InvalidRequest,
    MlxcelError,
    NotImplementedRoute,
    ShuttingDown,
)
from mlxcel.runtime.messages import RealtimeStatistics

log = logging.getLogger(__name__)

# While voice sessions are open, the chat model multiplies on 1/SPEECH_SHARE of OpenBLAS's
# threads.
SPEECH_SHARE = 2

bp = Blueprint("realtime", __name__)

# The subprotocol that carries a browser's API key ("openai-insecure-api-key.<key>"), offered
# next to "realtime", which the handshake then selects (a browser drops a connection that
# offered subprotocols and got none back).
KEY_SUBPROTOCOL = "openai-insecure-api-key."

# Query parameters that carry credentials in other products' WebSocket APIs.
KEY_PARAMS = frozenset(
    {"api_key", "apikey", "api-key", "key", "token", "access_token", "authorization", "x-api-key"}
)


@attrs.define
class SessionGate:
    """How many realtime sessions are open, against the cap; the open sessions themselves
    (their buffers, for /metrics) and those dropped for a slow client."""

    capacity: SessionCapacity
    open: int = 0
    vad_limiter: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(2))
    sessions: set[RealtimeSession] = attrs.field(factory=set)
    dropped: collections.Counter[str] = attrs.field(factory=collections.Counter)

    @property
    def limit(self) -> int:
        return self.capacity.limit

    def try_enter(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def leave(self) -> None:
        self.open -= 1

    def statistics(self) -> RealtimeStatistics:
        return RealtimeStatistics(
            open=self.open,
            limit=self.limit,
            capacity=self.capacity.derived,
            input_bytes=sum(s.input_bytes for s in self.sessions),
            output_bytes=sum(s.output_bytes for s in self.sessions),
            dropped=tuple(sorted(self.dropped.items())),
        )


def realtime_statistics(app: Quart, capacity: SessionCapacity) -> RealtimeStatistics:
    """The realtime sessions of ``app`` (the Quart app; its gate is made at the first)."""
    gate: SessionGate | None = app.config.get("MLXCEL_REALTIME")
    return gate.statistics() if gate is not None else SessionGate(capacity).statistics()


def _gate(ctx: ServerContext) -> SessionGate:
    gate: SessionGate | None = current_app.config.get("MLXCEL_REALTIME")
    if gate is None:
        gate = SessionGate(ctx.realtime_capacity())
        current_app.config["MLXCEL_REALTIME"] = gate
    return gate


def _subprotocols() -> list[str]:
    offered = websocket.headers.get("Sec-WebSocket-Protocol", "")
    return [p.strip() for p in offered.split(",") if p.strip()]


def _presented_key() -> str | None:
    auth = websocket.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    # A browser's WebSocket cannot set headers: it offers the key as a subprotocol, as
    # OpenAI's browser clients do (a header all the same, so it never reaches an access log).
    for offered in _subprotocols():
        if offered.startswith(KEY_SUBPROTOCOL):
            return offered.removeprefix(KEY_SUBPROTOCOL) or None
    return websocket.headers.get("X-Api-Key") or None


def _refusal() -> Response | None:
    """The HTTP answer that refuses this handshake, or None to go on."""
    ctx = server()
    if any(name.lower() in KEY_PARAMS for name in websocket.args):
        error: MlxcelError = AuthenticationFailed(
            "API keys are not accepted in the query string (they end up in logs): send "
            "'Authorization: Bearer <key>' or 'X-Api-Key: <key>'",
            param="query",
        )
        return Response(json.dumps(envelope(error)), status=401, content_type="application/json")
    if ctx.settings.api_keys and not key_ok(_presented_key(), ctx.settings.api_keys):
        return Response(UNAUTHORIZED, status=401, content_type="application/json")
    missing = (
        "a chat model (-m)"
        if not ctx.generation
        else "speech-to-text (--stt-model; not --no-audio)"
        if ctx.stt is None
        else "text-to-speech (--tts-model; not --no-audio)"
        if ctx.tts is None
        else None
    )
    if missing is not None:
        error = NotImplementedRoute(f"The realtime voice WebSocket needs {missing}.")
        return Response(json.dumps(envelope(error)), status=501, content_type="application/json")
    if ctx.models.draining:
        return error_response(ShuttingDown())
    protocol = websocket.args.get("protocol")
    if protocol not in (None, "openai", "voicechat"):
        error = InvalidRequest("protocol must be openai or voicechat", param="protocol")
        return Response(json.dumps(envelope(error)), status=400, content_type="application/json")
    return None


class _QuartSocket:
    async def receive(self) -> str | bytes:
        message: str | bytes = await websocket.receive()
        return message

    async def send(self, data: str) -> None:
        await websocket.send(data)

    async def close(self, code: int, reason: str) -> None:
        await websocket.close(code, reason)

    def hang_up(self) -> bool:
        hang_up = cast("Callable[[], None] | None", websocket.scope.get(HANG_UP))
        if hang_up is None:
            return False
        hang_up()
        return True


@bp.websocket("/v1/realtime")
async def realtime() -> Response | None:
    refusal = _refusal()
    if refusal is not None:
        return refusal
    ctx = server()
    assert ctx.stt is not None and ctx.tts is not None
    try:
        # ?model= names it (OpenAI's clients always send one): any name with one model, a
        # model of the list in router mode, leased for the whole session.
        model = await ctx.model(websocket.args.get("model"))
    except MlxcelError as error:
        return error_response(error)
    gate = _gate(ctx)
    await websocket.accept(subprotocol="realtime" if "realtime" in _subprotocols() else None)
    if not gate.try_enter():
        busy = {
            "type": "error",
            "event_id": new_id("event"),
            "error": {
                "type": "server_error",
                "code": "server_busy",
                "message": f"All {gate.limit} realtime sessions are in use. Try again later.",
            },
        }
        await websocket.send(json.dumps(busy))
        await websocket.close(1013, "server busy")
        return None
    session: RealtimeSession | None = None
    try:
        # The voices load on first use: start them now, while the client configures.
        ctx.stt.preload()
        ctx.tts.preload()
        protocol = websocket.args.get("protocol") or (
            "openai" if "model" in websocket.args else "voicechat"
        )
        dialect: Vocabulary = (
            OpenAIRealtime() if protocol == "openai" else VoiceChat(ctx.tts.sample_rate)
        )
        deps = VoiceDeps(
            generation=model.pipeline,
            stt=ctx.stt,
            tts=ctx.tts,
            sampling=ctx.settings.sampling,
            model_id=model.name,
            vad_model=shared_model,
            vad_limiter=gate.vad_limiter,
            count_tokens=model.pipeline.count_tokens,
            context_length=model.info.context_length,
            send_timeout=ctx.settings.realtime_send_timeout_secs,
        )
        session = RealtimeSession(RealtimeWire(_QuartSocket(), dialect), deps)
        gate.sessions.add(session)
        log.info("realtime %s opened (%s)", session.id, dialect.name)
        # While a voice session is open, its speech models (VAD every frame, Whisper, Piper)
        # run next to the chat model: OpenBLAS on half its threads leaves them the other
        # cores. On all of them, each matmul of a step waits for its slowest thread, and
        # that thread is the one sharing a core with Piper (8 sessions for 150 s on 2 cores:
        # 16 of 120 answers heard before the next question, 101 on half; performance.md).
        with blas.fewer_threads(SPEECH_SHARE), ctx.long_lived.hold(session.shut_down):
            await session.run()
        log.info("realtime %s closed", session.id)
    finally:
        if session is not None:
            gate.sessions.discard(session)
            if session.dropped is not None:
                gate.dropped[session.dropped] += 1
        gate.leave()
    return None


__all__ = ["bp"]

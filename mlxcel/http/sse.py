"""Server-sent events: framing and the keepalive comment."""

from __future__ import annotations

import json
import weakref
from collections.abc import AsyncIterator, Callable

from quart import Response, has_request_context, request

from mlxcel.actors.stream_sessions import KEEPALIVE
from mlxcel.http.context import server
from mlxcel.http.security import key_scope
from mlxcel.runtime.errors import InvalidRequest

__all__ = ["DONE", "HEADERS", "KEEPALIVE", "data", "event", "response"]

# A conversation id is a key and comes back in lookups: long ones are refused, not stored.
MAX_CONVERSATION_ID = 256
DONE = b"data: [DONE]\n\n"


def data(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def event(name: str, obj: object) -> bytes:
    return f"event: {name}\n".encode() + data(obj)


HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def response(body: AsyncIterator[bytes], on_drop: Callable[[], None]) -> Response:
    """The event-stream response for ``body``.

    A generator's ``finally`` only runs once the generator has started, and a client that
    leaves between the handler's return and the first byte never starts it: ``on_drop`` (which
    must be idempotent, e.g. ``slot.cancel``) also runs when the body is collected, so that
    case aborts the generation too.
    """
    conversation_id = conversation_id_header()
    if conversation_id is not None:
        return _resumable(conversation_id, body, on_drop)
    weakref.finalize(body, on_drop)
    return Response(body, content_type="text/event-stream", headers=HEADERS)


def conversation_id_header() -> str | None:
    """The request's ``X-Conversation-Id`` (None: absent or empty). Every request's header is
    checked before its handler runs (``check_conversation_id``), so none that started work
    can be refused here."""
    if not has_request_context():
        return None
    return request.headers.get("X-Conversation-Id", "").strip() or None


def check_conversation_id() -> None:
    """Refuse an over-long ``X-Conversation-Id`` before any work starts."""
    value = conversation_id_header()
    if value is not None and len(value) > MAX_CONVERSATION_ID:
        raise InvalidRequest(
            f"X-Conversation-Id is longer than {MAX_CONVERSATION_ID} characters",
            param="X-Conversation-Id",
        )


def _resumable(
    conversation_id: str, body: AsyncIterator[bytes], on_drop: Callable[[], None]
) -> Response:
    """With ``X-Conversation-Id`` the stream runs in the stream-sessions actor, and this
    client is its first reader: leaving does not stop the generation, and ``GET /v1/stream``
    picks it up again from any byte offset."""
    ctx = server()
    session = ctx.streams.attach(key_scope(ctx.settings), conversation_id, body, on_drop)
    return Response(
        session.follow(0, ctx.ping_interval), content_type="text/event-stream", headers=HEADERS
    )

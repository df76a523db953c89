"""Server-sent events: framing and the keepalive comment."""

from __future__ import annotations

import json
import weakref
from collections.abc import AsyncIterator, Callable

from quart import Response

KEEPALIVE = b": keepalive\n\n"
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
    weakref.finalize(body, on_drop)
    return Response(body, content_type="text/event-stream", headers=HEADERS)

"""Server-sent events: framing and the keepalive comment."""

from __future__ import annotations

import json

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

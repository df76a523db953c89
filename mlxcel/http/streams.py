"""Resumable-stream routes (llama-server b10621 #1444): replay, look up and stop the streams
that requests with ``X-Conversation-Id`` started (``actors/stream_sessions.py``).

Errors use the OpenAI envelope. Every route sees only the caller's key's sessions: another
key's id answers exactly as an unknown one (404, absent, 204).
"""

from __future__ import annotations

import json

from quart import Blueprint, Response, request

from mlxcel.http import sse
from mlxcel.http.context import read_json, server
from mlxcel.http.security import key_scope
from mlxcel.runtime.errors import InvalidRequest, NotFound, UnsupportedField

bp = Blueprint("streams", __name__)


def _conversation_id() -> str:
    conv_id: str = request.args.get("conv_id", "").strip()
    if not conv_id:
        raise InvalidRequest("Missing conversation id: pass ?conv_id=<id>", param="conv_id")
    return conv_id


def _offset() -> int:
    raw = request.args.get("from", "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise InvalidRequest("Invalid 'from' offset", param="from")
    return int(raw)


@bp.get("/v1/stream")
async def replay() -> Response:
    """The stream from byte ``from``: what is buffered, then live until it ends. The bytes are
    the stream's own SSE frames, so what a client got before it lost the connection plus this
    replay from that offset is exactly the whole stream. Leaving stops only this reader."""
    ctx = server()
    conv_id = _conversation_id()
    offset = _offset()
    session = ctx.streams.get(key_scope(ctx.settings), conv_id)
    if session is None:
        raise NotFound("Stream not found or expired", param="conv_id")
    if offset < session.dropped:
        raise InvalidRequest("Stream offset lost, please restart", param="from")
    return Response(
        session.follow(offset, ctx.ping_interval),
        content_type="text/event-stream",
        headers=sse.HEADERS,
    )


@bp.delete("/v1/stream")
async def stop() -> Response:
    """Stop the generation and forget its buffer; 204 whether or not there was one."""
    ctx = server()
    ctx.streams.evict(key_scope(ctx.settings), _conversation_id())
    return Response("", status=204)


# The lookup body's one key (also the OpenAPI document's).
LOOKUP_FIELDS = frozenset({"conversation_ids"})


@bp.post("/v1/streams/lookup")
async def lookup() -> Response:
    """``{"conversation_ids": [...]}`` -> the caller's sessions for those ids (and their
    ``<id>::<model>`` variants); ids with no session are simply absent."""
    ctx = server()
    body = await read_json()
    if isinstance(body, dict) and set(body) - LOOKUP_FIELDS:
        raise UnsupportedField(sorted(set(body) - LOOKUP_FIELDS)[0])
    ids = body.get("conversation_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise InvalidRequest("conversation_ids must be a list of strings", param="conversation_ids")
    found = ctx.streams.lookup(key_scope(ctx.settings), ids)
    return Response(
        json.dumps(
            [
                {
                    "conversation_id": s.conversation_id,
                    "is_done": s.done,
                    "total_bytes": s.total_bytes,
                    "started_at": s.started_at,
                    "completed_at": s.completed_at,
                }
                for s in found
            ]
        ),
        content_type="application/json",
    )

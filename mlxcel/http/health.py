"""Liveness: `/`, `/health`, `/v1/health` (public: no API key needed)."""

from __future__ import annotations

from quart import Blueprint, Response

from mlxcel.http.context import server
from mlxcel.http.errors import error_response
from mlxcel.runtime.errors import ShuttingDown, Unavailable

bp = Blueprint("health", __name__)


@bp.get("/health")
@bp.get("/v1/health")
@bp.get("/")
async def health() -> Response:
    # Liveness only: 503 while loading or draining (so a load balancer takes this replica
    # out of rotation), never because the server is busy.
    ctx = server()
    if not ctx.ready:
        return error_response(Unavailable("Loading model"), "native")
    if ctx.pipeline.draining:
        return error_response(ShuttingDown(), "native")
    return Response('{"status":"ok"}', content_type="application/json")

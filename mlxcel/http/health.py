"""Liveness: `/`, `/health`, `/v1/health` (public: no API key needed)."""

from __future__ import annotations

from quart import Blueprint, Response

from mlxcel.http.context import server
from mlxcel.http.errors import error_response
from mlxcel.runtime.errors import Unavailable

bp = Blueprint("health", __name__)


@bp.get("/health")
@bp.get("/v1/health")
@bp.get("/")
async def health() -> Response:
    # Liveness only: 503 while loading, never because the server is busy.
    if not server().ready:
        return error_response(Unavailable("Loading model"), "native")
    return Response('{"status":"ok"}', content_type="application/json")

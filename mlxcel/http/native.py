"""llama-server native routes (this issue: health; the native-routes issue adds the rest)."""

from __future__ import annotations

from quart import Blueprint, Response

from mlxcel.http.context import server
from mlxcel.http.errors import error_response
from mlxcel.runtime.errors import Unavailable

bp = Blueprint("native", __name__)


@bp.get("/health")
@bp.get("/v1/health")
@bp.get("/")
async def health() -> Response:
    # Liveness only: 503 while loading, never because the server is busy.
    if not server().ready:
        return error_response(Unavailable("Loading model"), "native")
    return Response('{"status":"ok"}', content_type="application/json")

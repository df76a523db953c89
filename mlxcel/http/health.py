"""Liveness: `/`, `/health`, `/v1/health` (public: no API key needed); a browser's `/` gets
the chat page instead (webui.py), unless the server runs with --no-webui."""

from __future__ import annotations

from quart import Blueprint, Response, current_app

from mlxcel.http import webui
from mlxcel.http.context import server
from mlxcel.http.errors import error_response
from mlxcel.runtime.errors import ShuttingDown, Unavailable

bp = Blueprint("health", __name__)


@bp.get("/")
async def root() -> Response:
    page: webui.Page | None = current_app.config.get("MLXCEL_WEBUI")
    # Served while the model loads too: the page says so itself until /health answers 200.
    if page is not None and webui.wanted():
        return webui.respond(page)
    response = await health()
    if page is not None:
        response.vary.add("Accept")  # a cache must not hand this to a browser
    return response


@bp.get("/health")
@bp.get("/v1/health")
async def health() -> Response:
    # Liveness only: 503 while loading or draining (so a load balancer takes this replica
    # out of rotation), never because the server is busy.
    ctx = server()
    if not ctx.ready:
        return error_response(Unavailable("Loading model"), "native")
    if ctx.models.draining:
        return error_response(ShuttingDown(), "native")
    return Response('{"status":"ok"}', content_type="application/json")

"""Builds the Quart-Trio app: blueprints, limits, and the error mapping for every route."""

from __future__ import annotations

import logging

from quart import Response, current_app, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from mlxcel.http import (
    anthropic,
    audio,
    completion,
    control,
    conversations,
    embeddings,
    health,
    media,
    models,
    native,
    openai,
    openapi,
    ops,
    responses,
    security,
    sse,
    streams,
    transport,
)
from mlxcel.http import realtime as realtime_ws
from mlxcel.http import webui as webui_page
from mlxcel.http.context import ServerContext
from mlxcel.http.errors import (
    Family,
    error_response,
    is_anthropic_path,
    unexpected,
)
from mlxcel.runtime.errors import InvalidRequest, MlxcelError, NotFound, PayloadTooLarge

log = logging.getLogger(__name__)


def _family() -> Family:
    if request.blueprint in ANTHROPIC_BLUEPRINTS or (
        request.blueprint is None and is_anthropic_path(request.path)
    ):
        return "anthropic"
    return "native" if request.blueprint in NATIVE_BLUEPRINTS else "openai"


NATIVE_BLUEPRINTS = frozenset({"native", "native_completion", "ops", "health", "public_health"})
ANTHROPIC_BLUEPRINTS = frozenset({"anthropic"})


async def _check_headers() -> None:
    sse.check_conversation_id()


def create_app(ctx: ServerContext, *, webui: bool = True) -> QuartTrio:
    app = QuartTrio("mlxcel")
    # Keep-alive connections survive answers sent before the body was read, and a body over the
    # limit gets its 413 and a closed connection (see transport.py).
    app.asgi_http_class = transport.Connection
    app.after_request(transport.settle_body)
    # The audio upload routes take 25 MiB bodies whatever --max-request-bytes says.
    app.request_class = audio.AudioUploadRequest
    app.config["MLXCEL"] = ctx
    # Streams last as long as generation does: Quart's 60 s response/body timeouts would cut
    # them silently. Idle sockets are Hypercorn's business (keep-alive timeout).
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = None
    # (A context built for the OpenAPI document alone has no model yet.)
    info = getattr(ctx, "info", None)
    vision = info is not None and info.media is not None
    app.config["MAX_CONTENT_LENGTH"] = media.body_limit(ctx.settings, vision=vision)
    prefix = ctx.settings.api_prefix.rstrip("/") or None
    if webui:
        app.config["MLXCEL_WEBUI"] = webui_page.build(
            api_prefix=prefix or "", keys=bool(ctx.settings.api_keys)
        )
    security.install(app, ctx.settings)
    app.before_request(_check_headers)
    app.register_blueprint(health.bp, url_prefix=prefix)
    if prefix:
        # The health routes stay reachable (and public) without the prefix too.
        app.register_blueprint(health.bp, name="public_health")
    app.register_blueprint(native.bp, url_prefix=prefix)
    app.register_blueprint(ops.bp, url_prefix=prefix)
    app.register_blueprint(models.bp, url_prefix=prefix)
    app.register_blueprint(completion.bp, url_prefix=prefix)
    app.register_blueprint(openai.bp, url_prefix=prefix)
    app.register_blueprint(control.bp, url_prefix=prefix)
    app.register_blueprint(embeddings.bp, url_prefix=prefix)
    app.register_blueprint(responses.bp, url_prefix=prefix)
    app.register_blueprint(conversations.bp, url_prefix=prefix)
    app.register_blueprint(anthropic.bp, url_prefix=prefix)
    app.register_blueprint(streams.bp, url_prefix=prefix)
    app.register_blueprint(audio.bp, url_prefix=prefix)
    app.register_blueprint(realtime_ws.bp, url_prefix=prefix)
    # At the root whatever --api-prefix says: the document lists the prefixed paths.
    app.register_blueprint(openapi.bp)

    @app.errorhandler(MlxcelError)
    async def _mlxcel(error: MlxcelError) -> Response:
        return error_response(error, _family())

    @app.errorhandler(HTTPException)
    async def _http(error: HTTPException) -> Response:
        code = error.code or 500
        mapped: MlxcelError
        if code == 404:
            mapped = NotFound(f"Route {request.method} {request.path} not found")
        elif code == 413:
            limit = current_app.config["MAX_CONTENT_LENGTH"]
            mapped = PayloadTooLarge(
                f"Request body larger than {limit} bytes (see --max-request-bytes)"
            )
        else:
            mapped = InvalidRequest(error.description or error.name)
            mapped.status = code
        return error_response(mapped, _family())

    @app.errorhandler(Exception)
    async def _other(error: Exception) -> Response:
        return error_response(unexpected(error), _family())

    return app

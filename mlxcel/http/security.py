"""API keys, CORS and the public routes, applied to every request before its handler.

Order matters: a CORS preflight (OPTIONS) is answered before authentication, since browsers
never send credentials on it; then every route except the public ones (health, the model
list) needs a key,
as `Authorization: Bearer <key>` or `X-Api-Key: <key>` (llama-server's lookup: the
Authorization header, else X-Api-Key, a "Bearer " prefix taken off either, then compared
exactly). Missing and wrong keys get the same 401, and keys never reach a log line.

CORS as llama-server answers it: an allowed Origin is echoed back (with "*" configured too,
so that credentials can be allowed), and a preflight's asked-for headers are allowed when
the configured list is "*": a literal "*" is no wildcard for a request with credentials, and
the official JS SDKs send their own ``x-stainless-*`` headers.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from quart import Quart, Response, request

from mlxcel.http.errors import error_response, is_anthropic_path
from mlxcel.runtime.errors import AuthenticationFailed
from mlxcel.runtime.settings import Settings

# llama-server's public endpoints: health, and the model list (clients probe it before they
# know they need a key); and the OpenAPI document, which describes routes, never data.
PUBLIC_PATHS = frozenset({"/", "/health", "/v1/health", "/models", "/v1/models", "/openapi.json"})
UNAUTHORIZED = json.dumps(
    {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}
)


def presented_key() -> str | None:
    value = request.headers.get("Authorization") or request.headers.get("X-Api-Key") or ""
    if value[:7].lower() == "bearer ":
        value = value[7:]
    return value or None


def key_scope(settings: Settings) -> str:
    """Whose resumable streams and controllable completions this request may reach: a digest
    of its key (the key itself is kept nowhere), or "" (everyone's) without keys."""
    key = presented_key() if settings.api_keys else None
    return hashlib.sha256(key.encode()).hexdigest() if key is not None else ""


def key_ok(key: str | None, keys: frozenset[str]) -> bool:
    if key is None:
        return False
    # Compare against every key so timing says nothing about which one nearly matched.
    return any([hmac.compare_digest(key.encode(), k.encode()) for k in keys])


def install(app: Quart, settings: Settings) -> None:
    origins = settings.cors_origins

    def allowed_origin() -> str | None:
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        return origin if "*" in origins or origin in origins else None

    def cors_headers(response: Response, origin: str) -> None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"
        if settings.cors_credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"

    @app.before_request
    async def _gate() -> Response | None:
        if request.method == "OPTIONS" and request.headers.get("Access-Control-Request-Method"):
            response = Response("", status=200)  # llama-server answers a preflight 200
            origin = allowed_origin()
            if origin is not None:
                cors_headers(response, origin)
                response.headers["Access-Control-Allow-Methods"] = settings.cors_methods
                asked = request.headers.get("Access-Control-Request-Headers")
                allow = settings.cors_headers
                if allow.strip() == "*" and asked:
                    allow = asked
                response.headers["Access-Control-Allow-Headers"] = allow
                response.headers["Access-Control-Max-Age"] = "600"
            return response
        if settings.api_keys and request.path not in PUBLIC_PATHS:
            if not key_ok(presented_key(), settings.api_keys):
                if request.blueprint == "anthropic" or is_anthropic_path(request.path):
                    # Anthropic SDKs read their own envelope: {"type": "error", "error": {...}}.
                    return error_response(AuthenticationFailed("Invalid API Key"), "anthropic")
                return Response(
                    UNAUTHORIZED, status=401, content_type="application/json; charset=utf-8"
                )
        return None

    @app.after_request
    async def _cors(response: Response) -> Response:
        origin = allowed_origin()
        if origin is not None:
            cors_headers(response, origin)
        return response

"""API keys, CORS and the public routes, applied to every request before its handler.

Order matters: a CORS preflight (OPTIONS) is answered before authentication, since browsers
never send credentials on it; then every route except the public health routes needs a key,
as `Authorization: Bearer <key>` or `X-Api-Key: <key>`. Missing and wrong keys get the same
401, and keys never reach a log line.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from quart import Quart, Response, request

from mlxcel.http.errors import drain_body, error_response
from mlxcel.runtime.errors import AuthenticationFailed
from mlxcel.runtime.settings import Settings

PUBLIC_PATHS = frozenset({"/", "/health", "/v1/health"})
UNAUTHORIZED = json.dumps(
    {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}
)
ALLOW_HEADERS = (
    "Authorization, Content-Type, X-Api-Key, X-Priority, X-Conversation-Id, Anthropic-Version, "
    "OpenAI-Beta, Anthropic-Beta, Anthropic-Dangerous-Direct-Browser-Access"
)
ALLOW_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS"


def presented_key() -> str | None:
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("X-Api-Key") or None


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
        if "*" in origins:
            return "*"
        return origin if origin in origins else None

    @app.before_request
    async def _gate() -> Response | None:
        if request.method == "OPTIONS" and request.headers.get("Access-Control-Request-Method"):
            response = Response("", status=204)
            origin = allowed_origin()
            if origin is not None:
                response.headers["Access-Control-Allow-Origin"] = origin
                response.headers["Access-Control-Allow-Methods"] = ALLOW_METHODS
                response.headers["Access-Control-Allow-Headers"] = ALLOW_HEADERS
                response.headers["Access-Control-Max-Age"] = "600"
            return response
        if settings.api_keys and request.path not in PUBLIC_PATHS:
            if not key_ok(presented_key(), settings.api_keys):
                await drain_body()
                if request.blueprint == "anthropic":
                    # Anthropic SDKs read their own envelope: {"type": "error", "error": {...}}.
                    return error_response(AuthenticationFailed("Invalid API Key"), "anthropic")
                return Response(UNAUTHORIZED, status=401, content_type="application/json")
        return None

    @app.after_request
    async def _cors(response: Response) -> Response:
        origin = allowed_origin()
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            if origin != "*":
                response.headers["Vary"] = "Origin"
        return response

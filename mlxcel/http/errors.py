"""The one place where errors become HTTP responses, in each API family's envelope."""

from __future__ import annotations

import json
import logging
import re
from typing import Literal

from quart import Response

from mlxcel.runtime.errors import ContextOverflow, InternalError, MlxcelError

log = logging.getLogger(__name__)

Family = Literal["openai", "native", "anthropic"]

_ANTHROPIC_PATH = re.compile(r"(?:^|/)v1/messages(?:/|$)")


def is_anthropic_path(path: str) -> bool:
    """An Anthropic SDK's path (under any --api-prefix), for errors raised before a route
    matched (an unknown method or sub-route): that client reads only its own envelope."""
    return _ANTHROPIC_PATH.search(path) is not None


# Anthropic's error `type` for each status; other statuses keep our own type string.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    # A full queue (and a draining server) is Anthropic's "overloaded"; we keep status 503,
    # as llama-server does, rather than Anthropic's own 529.
    503: "overloaded_error",
    504: "timeout_error",
}


def envelope(error: MlxcelError, family: Family = "openai") -> dict[str, object]:
    if family == "anthropic":
        # {"type": "error", "error": {"type", "message"}}: no `param`, so the message names
        # the field, as Anthropic's own messages do ("messages.0.content: ...").
        message = error.message
        if isinstance(error, ContextOverflow):
            # Anthropic's own words: clients (Claude Code among them) read "prompt is too
            # long" as the cue to compact the conversation and retry.
            message = f"prompt is too long: {error.n_prompt_tokens} tokens > {error.n_ctx} maximum"
        elif error.param and error.param not in message:
            message = f"{error.param}: {message}"
        kind = ANTHROPIC_TYPES.get(error.status, error.error_type)
        return {"type": "error", "error": {"type": kind, "message": message}}
    if family == "native":
        # llama-server's own shape: {"error": {"code", "message", "type"}}.
        body: dict[str, object] = {
            "code": error.status,
            "message": error.message,
            "type": error.error_type,
        }
    else:
        body = {"message": error.message, "type": error.error_type, "param": error.param}
        body["code"] = None
    if isinstance(error, ContextOverflow):
        if family == "openai":
            # OpenAI's code for it, which SDK users test; the type stays llama-server's.
            body["code"] = "context_length_exceeded"
        # llama-server adds the two sizes to the error object (both families).
        body["n_prompt_tokens"] = error.n_prompt_tokens
        body["n_ctx"] = error.n_ctx
    return {"error": body}


def error_response(error: MlxcelError, family: Family = "openai") -> Response:
    response = Response(
        json.dumps(envelope(error, family)),
        status=error.status,
        content_type="application/json",
    )
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(error.retry_after)
    return response


def unexpected(error: BaseException) -> MlxcelError:
    log.exception("unexpected error while serving a request", exc_info=error)
    return InternalError(f"Internal server error: {type(error).__name__}")

"""The one place where errors become HTTP responses, in each API family's envelope."""

from __future__ import annotations

import json
import logging
from typing import Literal

from quart import Response

from mlxcel.runtime.errors import InternalError, MlxcelError

log = logging.getLogger(__name__)

Family = Literal["openai", "native"]


def envelope(error: MlxcelError, family: Family = "openai") -> dict[str, object]:
    if family == "native":
        # llama-server's own shape: {"error": {"code", "message", "type"}}.
        return {"error": {"code": error.status, "message": error.message, "type": error.error_type}}
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": None,
        }
    }


def error_response(error: MlxcelError, family: Family = "openai") -> Response:
    return Response(
        json.dumps(envelope(error, family)),
        status=error.status,
        content_type="application/json",
    )


def unexpected(error: BaseException) -> MlxcelError:
    log.exception("unexpected error while serving a request", exc_info=error)
    return InternalError(f"Internal server error: {type(error).__name__}")

"""llama-server's router routes: load and unload a model by name (router mode only).

``GET /models`` (the list with each model's status) is the OpenAI listing in ``openai.py``.
"""

from __future__ import annotations

import json

from quart import Blueprint, Response

from mlxcel.http.context import read_json, server
from mlxcel.runtime.errors import InvalidRequest, UnsupportedField

bp = Blueprint("models", __name__)

# The load and unload body's one key (also the OpenAPI document's).
FIELDS = frozenset({"model"})


async def _name() -> str:
    body = await read_json()
    if isinstance(body, dict) and (unknown := sorted(set(body) - FIELDS)):
        raise UnsupportedField(unknown[0])
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequest('Name the model: {"model": "NAME"}', param="model")
    return name


def _success() -> Response:
    return Response(json.dumps({"success": True}), content_type="application/json")


@bp.post("/models/load")
async def load() -> Response:
    """Start loading (returns at once; ``GET /models`` shows it loading, then loaded)."""
    await server().models.load(await _name())
    return _success()


@bp.post("/models/unload")
async def unload() -> Response:
    """Unload once the requests it runs have finished; returns when it is unloaded.
    Cancellation (the client leaves) does not stop the unload."""
    ctx = server()
    name = await _name()
    await ctx.models.unload(name)
    return _success()

"""`POST /v1/chat/completions/control`: steer a running completion (llama-server b10621).

One action so far, ``reasoning_end``: the completion's thinking block is closed now (its end
marker is forced from the next token), so the answer starts. The completion must have been
sent with ``reasoning_control: true``; its id is the chat completion's ``id`` (a native
``/completion``'s is its ``/slots`` ``id_task``). With API keys, only the key that started it
may control it; another key gets what an unknown id gets. Errors use the OpenAI envelope.
"""

from __future__ import annotations

import json

from quart import Blueprint, Response

from mlxcel.http.context import read_json, server
from mlxcel.http.security import key_scope
from mlxcel.runtime.errors import InvalidRequest, UnsupportedField
from mlxcel.runtime.messages import EndReasoning

bp = Blueprint("control", __name__)

ACTIONS = ("reasoning_end",)
# The body's keys, both required (also the OpenAPI document's).
FIELDS = frozenset({"id", "action"})


def _answer(success: bool, message: str | None = None) -> Response:
    body: dict[str, object] = {"success": success}
    if message is not None:
        body["message"] = message
    return Response(json.dumps(body), content_type="application/json")


@bp.post("/v1/chat/completions/control")
@bp.post("/chat/completions/control")
async def control() -> Response:
    ctx = server()
    data = await read_json()
    if not isinstance(data, dict):
        raise InvalidRequest("The body must be a JSON object: {id, action}")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise UnsupportedField(unknown[0])
    completion_id = data.get("id")
    if not isinstance(completion_id, str) or not completion_id:
        raise InvalidRequest("missing completion id", param="id")
    if data.get("action") not in ACTIONS:
        raise InvalidRequest(
            f"unknown control action: expected one of {', '.join(ACTIONS)}", param="action"
        )
    loaded = ctx.models.loaded()
    if not any(m.pipeline.reasons for m in loaded):
        return _answer(False, "This model does not reason: its chat template has no thinking")
    # Whichever model runs it (router mode: completion ids are unique across models).
    for model in loaded:
        running = model.pipeline.statistics().running_request(completion_id)
        if running is not None and running.reasoning_control == key_scope(ctx.settings):
            await model.pipeline.control(EndReasoning(completion_id))
            return _answer(True)
    return _answer(
        False,
        "No running completion with this id has reasoning control enabled "
        "(send it with reasoning_control: true)",
    )

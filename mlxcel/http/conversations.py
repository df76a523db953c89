"""OpenAI Conversations routes: /v1/conversations create / retrieve / update / delete, and
their items (list, add, retrieve, delete).

A conversation is one document in the session store: ``{id, created_at, metadata, items}``.
Responses created with ``conversation`` read its items as history and append their input and
output items to it. An id first seen in a Responses ``conversation`` field starts an empty
conversation (clients of servers without these routes name their own ids).
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from mlxcel.http.context import read_json, server
from mlxcel.http.openai_wire import check_metadata
from mlxcel.http.responses import CONVERSATIONS_OFF, _json, new_conversation, page, store_of
from mlxcel.http.responses_wire import input_items, new_id
from mlxcel.runtime.errors import InvalidRequest, NotFound, UnsupportedField

bp = Blueprint("conversations", __name__)
MAX_NEW_ITEMS = 20


def _public(conv: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": conv["id"],
        "object": "conversation",
        "created_at": conv["created_at"],
        "metadata": conv["metadata"],
    }


# The keys each body may have (anything else is a 400 naming it); also the OpenAPI document's.
CREATE_FIELDS = frozenset({"items", "metadata"})
UPDATE_FIELDS = frozenset({"metadata"})
ADD_ITEMS_FIELDS = frozenset({"items"})


async def _load(cid: str) -> dict[str, Any]:
    store = store_of(server())
    if not store.enabled("conversations"):
        raise InvalidRequest(CONVERSATIONS_OFF)
    conv = await store.get("conversations", cid)
    if conv is None:
        raise NotFound(f"Conversation with id '{cid}' not found.")
    return conv


async def _body(allowed: frozenset[str]) -> dict[str, Any]:
    data = await read_json()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    for key in data:
        if key not in allowed:
            raise UnsupportedField(key)
    return data


def _new_items(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, list) and len(value) > MAX_NEW_ITEMS:
        raise InvalidRequest(f"at most {MAX_NEW_ITEMS} items at a time", param="items")
    return input_items(value, "items")


@bp.post("/v1/conversations")
async def create() -> Response:
    store = store_of(server())
    if not store.enabled("conversations"):
        raise InvalidRequest(CONVERSATIONS_OFF)
    data = await _body(CREATE_FIELDS)
    check_metadata(data.get("metadata"))
    conv = new_conversation(new_id("conv"), data.get("metadata") or {})
    conv["items"] = _new_items(data.get("items"))
    await store.put("conversations", conv["id"], conv)
    return _json(_public(conv))


@bp.get("/v1/conversations/<cid>")
async def retrieve(cid: str) -> Response:
    return _json(_public(await _load(cid)))


async def _change(cid: str, change: Any) -> dict[str, Any]:
    """Apply ``change`` to the stored conversation atomically; 404 when it is gone."""
    await _load(cid)  # 400 with conversations off, 404 when unknown

    def apply(conv: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if conv is None else change(conv)

    changed = await store_of(server()).update("conversations", cid, apply)
    if changed is None:
        raise NotFound(f"Conversation with id '{cid}' not found.")
    return changed


@bp.post("/v1/conversations/<cid>")
async def update(cid: str) -> Response:
    data = await _body(UPDATE_FIELDS)
    check_metadata(data.get("metadata"))
    conv = await _change(cid, lambda c: {**c, "metadata": data.get("metadata") or {}})
    return _json(_public(conv))


@bp.delete("/v1/conversations/<cid>")
async def delete(cid: str) -> Response:
    store = store_of(server())
    if not store.enabled("conversations"):
        raise InvalidRequest(CONVERSATIONS_OFF)
    deleted = await store.delete("conversations", cid)
    return _json({"id": cid, "object": "conversation.deleted", "deleted": deleted})


@bp.get("/v1/conversations/<cid>/items")
async def list_items(cid: str) -> Response:
    return _json(page(list((await _load(cid))["items"])))


@bp.post("/v1/conversations/<cid>/items")
async def add_items(cid: str) -> Response:
    data = await _body(ADD_ITEMS_FIELDS)
    added = _new_items(data.get("items"))
    if not added:
        raise InvalidRequest("items must be a non-empty list", param="items")
    await _change(cid, lambda c: {**c, "items": [*c["items"], *added]})
    return _json(
        {
            "object": "list",
            "data": added,
            "first_id": added[0]["id"],
            "last_id": added[-1]["id"],
            "has_more": False,
        }
    )


@bp.get("/v1/conversations/<cid>/items/<item_id>")
async def retrieve_item(cid: str, item_id: str) -> Response:
    for item in (await _load(cid))["items"]:
        if item["id"] == item_id:
            return _json(item)
    raise NotFound(f"Item with id '{item_id}' not found in conversation '{cid}'.")


@bp.delete("/v1/conversations/<cid>/items/<item_id>")
async def delete_item(cid: str, item_id: str) -> Response:
    conv = await _load(cid)
    if all(item["id"] != item_id for item in conv["items"]):
        raise NotFound(f"Item with id '{item_id}' not found in conversation '{cid}'.")
    conv = await _change(
        cid, lambda c: {**c, "items": [i for i in c["items"] if i["id"] != item_id]}
    )
    return _json(_public(conv))

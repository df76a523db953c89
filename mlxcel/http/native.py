"""llama-server native routes: tokenize, detokenize, apply-template, input token counts.

Shapes follow llama-server (mlxcel-surface.md §1.3); errors use its envelope.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import trio
from quart import Blueprint, Response

from mlxcel.actors.token_bytes import piece_for_json, token_bytes
from mlxcel.http.context import read_json, server
from mlxcel.http.openai import render_chat
from mlxcel.http.openai_wire import token_ids
from mlxcel.runtime.codec import structure
from mlxcel.runtime.errors import InvalidRequest, require_generation
from mlxcel.runtime.messages import ResetCache

bp = Blueprint("native", __name__)


def _json(obj: object) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), content_type="application/json")


@attrs.frozen(kw_only=True)
class TokenizeBody:
    content: str = ""
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    model: str | None = None


@attrs.frozen(kw_only=True)
class DetokenizeBody:
    tokens: Any = attrs.field(factory=list)
    model: str | None = None


async def _object_body() -> dict[str, Any]:
    body = await read_json()
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


@bp.post("/tokenize")
async def tokenize() -> Response:
    body = structure(await read_json(), TokenizeBody)
    ctx = server()
    ctx.check_model(body.model)  # as every other route: an unknown name is a 404
    tok = ctx.info.tokenizer

    def encode() -> list[int]:
        return list(
            tok.encode(
                body.content,
                add_special_tokens=body.add_special,
                split_special_tokens=not body.parse_special,
            )
        )

    ids = await trio.to_thread.run_sync(encode)
    if not body.with_pieces:
        return _json({"tokens": ids})
    special = set(getattr(tok, "all_special_ids", ()))
    pieces = [{"id": i, "piece": piece_for_json(token_bytes(tok, i, i in special))} for i in ids]
    return _json({"tokens": pieces})


@bp.post("/detokenize")
async def detokenize() -> Response:
    body = structure(await read_json(), DetokenizeBody)
    ctx = server()
    ctx.check_model(body.model)
    tok = ctx.info.tokenizer
    ids = list(token_ids(body.tokens, len(tok), "tokens"))
    text = await trio.to_thread.run_sync(lambda: tok.decode(ids, skip_special_tokens=False))
    return _json({"content": text})


@bp.post("/apply-template")
async def apply_template() -> Response:
    body = await _object_body()
    body.pop("model", None)  # optional here: the served model is implied
    prompt, _ = await render_chat(body)
    return _json({"prompt": prompt})


@bp.get("/v1/cache/stats")
async def cache_stats() -> Response:
    ctx = server()
    s = ctx.pipeline.statistics().cache
    lookups = s.hits + s.misses
    return _json(
        {
            "enabled": ctx.settings.cache_enabled and ctx.generation,
            "entries": s.entries,
            "bytes": s.nbytes,
            "max_bytes": ctx.settings.cache_ram_mib << 20 if ctx.settings.cache_enabled else 0,
            "hits": s.hits,
            "misses": s.misses,
            "evictions": s.evictions,
            "hit_rate": s.hits / lookups if lookups else 0.0,
        }
    )


@bp.post("/v1/cache/reset")
async def cache_reset() -> Response:
    ctx = server()
    require_generation(ctx.generation)  # no chat model: no prompt cache, no compute thread
    done = trio.Event()
    await ctx.pipeline.control(ResetCache(done))
    await done.wait()
    return _json({"success": True})

"""llama-server native routes: tokenize, detokenize, apply-template, input token counts.

Shapes follow llama-server (mlxcel-surface.md §1.3); errors use its envelope.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import trio
from quart import Blueprint, Response, request

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
    # As every other route: an unknown name is a 404 (router mode: this model's tokens).
    tok = (await server().model(body.model)).info.tokenizer

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
    tok = (await server().model(body.model)).info.tokenizer
    ids = list(token_ids(body.tokens, len(tok), "tokens"))
    text = await trio.to_thread.run_sync(lambda: tok.decode(ids, skip_special_tokens=False))
    return _json({"content": text})


@bp.post("/apply-template")
async def apply_template() -> Response:
    body = await _object_body()
    # Optional here with one model (any name is the served one); router mode: its template.
    model = await server().model(body.pop("model", None))
    prompt, _ = await render_chat(model, body)
    return _json({"prompt": prompt})


@bp.get("/v1/cache/stats")
async def cache_stats() -> Response:
    ctx = server()
    model = await ctx.model(request.args.get("model"))
    s = model.pipeline.statistics().cache
    lookups = s.hits + s.misses
    return _json(
        {
            "enabled": ctx.settings.cache_enabled and model.generation,
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
    model = await ctx.model(request.args.get("model"))
    require_generation(model.generation)  # no chat model: no prompt cache, no compute thread
    done = trio.Event()
    await model.pipeline.control(ResetCache(done))
    await done.wait()
    return _json({"success": True})

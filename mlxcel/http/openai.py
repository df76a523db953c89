"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models (and their aliases).

Every generation route follows the same shape: parse and validate (400 before any work),
``admission.submit`` (503 before any byte), wait until the prompt is tokenized (a too-long
prompt is still a clean 400), then either collect the output or stream it as SSE. Whatever
way the handler ends -- finished, failed, or cancelled because the client went away -- its
``finally`` cancels the slot, which aborts the generation at the next step boundary.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
from quart import Blueprint, Response, request

from mlxcel.actors.side_models import require_generation
from mlxcel.http import logprobs, sse
from mlxcel.http.audio import audio_model_entries
from mlxcel.http.chat_render import Collected, message, stream_choices
from mlxcel.http.context import ServerContext, server
from mlxcel.http.embeddings import side_model_entries
from mlxcel.http.errors import envelope, error_response
from mlxcel.http.openai_wire import StreamOptions, chat_request, completion_request
from mlxcel.runtime.errors import InvalidRequest, MlxcelError
from mlxcel.runtime.messages import GenerationRequest
from mlxcel.runtime.slot import OutputSlot, SlotUpdate

bp = Blueprint("openai", __name__)

# The streamed choices for one slot update, and the finishing choice for a finish reason.
RenderFn = Callable[[SlotUpdate], list[dict[str, Any]]]
FinishFn = Callable[[str], dict[str, Any]]


async def read_json() -> Any:
    raw = await request.get_data()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"Invalid JSON in request body: {error}") from None


def _usage(slot: OutputSlot, ctx: ServerContext) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": slot.prompt_tokens,
        "completion_tokens": slot.completion_tokens,
        "total_tokens": slot.prompt_tokens + slot.completion_tokens,
    }
    # Present only when the cache is on, so {"cached_tokens": 0} means "on, but cold".
    if ctx.settings.cache_enabled:
        usage["prompt_tokens_details"] = {"cached_tokens": slot.cached_tokens}
    return usage


PRIORITIES = {"high": 0, "normal": 1, "low": 2}


async def start_generation(ctx: ServerContext, gen: GenerationRequest) -> OutputSlot:
    """Submit (503 when the queue is full), then wait until the prompt is tokenized."""
    lane = request.headers.get("X-Priority", "normal").strip().lower()
    if lane not in PRIORITIES:
        raise InvalidRequest("X-Priority must be high, normal or low", param="X-Priority")
    gen = attrs.evolve(gen, priority=PRIORITIES[lane])
    slot = ctx.admission.submit(gen)
    try:
        await slot.wait_accepted()
    except BaseException:
        slot.cancel()
        raise
    return slot


async def _collect(slot: OutputSlot) -> Collected:
    try:
        collected = Collected()
        while True:
            update = await slot.next()
            assert update is not None  # no timeout given
            collected.add(update)
            if update.finish_reason is not None:
                return collected
    finally:
        slot.cancel()


def _stream(
    ctx: ServerContext,
    slot: OutputSlot,
    base: dict[str, Any],
    render: RenderFn,
    finish: FinishFn,
    first: dict[str, Any] | None,
    options: StreamOptions | None,
) -> Response:
    ping = ctx.settings.sse_ping_interval if ctx.settings.sse_ping_enabled else float("inf")

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse.data({**base, "choices": choices, **extra})

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield chunk([first])
            while True:
                try:
                    update = await slot.next(timeout=ping)
                except MlxcelError as error:
                    yield sse.data(envelope(error))
                    return
                if update is None:
                    yield sse.KEEPALIVE
                    continue
                for c in render(update):
                    yield chunk([c])
                if update.finish_reason is not None:
                    yield chunk([finish(update.finish_reason)])
                    break
            if options is not None and options.include_usage:
                yield chunk([], usage=_usage(slot, ctx))
            yield sse.DONE
        finally:
            slot.cancel()

    return Response(body(), content_type="text/event-stream", headers=sse.HEADERS)


@bp.post("/v1/chat/completions")
@bp.post("/chat/completions")
async def chat_completions() -> Response:
    ctx = server()
    require_generation(ctx.generation)
    body, gen = chat_request(await read_json(), ctx.settings.sampling, len(ctx.info.tokenizer))
    model = ctx.check_model(body.model)
    if gen.parse_tools and ctx.tool_format is None:
        raise InvalidRequest(
            "This model's chat template has no tool-call format, so it cannot call tools.",
            param="tools",
        )
    slot = await start_generation(ctx, gen)
    created = int(time.time())
    base = {"id": gen.request_id, "object": "chat.completion", "created": created, "model": model}
    tok = ctx.info.tokenizer
    wants_logprobs = gen.logprobs is not None
    if body.stream:
        base = {**base, "object": "chat.completion.chunk", "system_fingerprint": None}

        def finish_choice(reason: str) -> dict[str, Any]:
            return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}

        first = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return _stream(
            ctx,
            slot,
            base,
            lambda u: stream_choices(u, tok, wants_logprobs),
            finish_choice,
            first,
            body.stream_options,
        )
    c = await _collect(slot)
    scores = logprobs.chat(tok, c.logprobs) if wants_logprobs else None
    choice = {
        "index": 0,
        "message": message(c),
        "logprobs": scores,
        "finish_reason": c.finish_reason,
    }
    return _json(
        {
            **base,
            "system_fingerprint": None,
            "choices": [choice],
            "usage": _usage(slot, ctx),
        }
    )


@bp.post("/v1/completions")
async def completions() -> Response:
    ctx = server()
    require_generation(ctx.generation)
    body, gen = completion_request(
        await read_json(), ctx.settings.sampling, len(ctx.info.tokenizer)
    )
    model = ctx.check_model(body.model)
    slot = await start_generation(ctx, gen)
    base = {
        "id": gen.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    tok = ctx.info.tokenizer
    wants_logprobs = gen.logprobs is not None
    if body.stream:
        emitted = 0

        def render(update: SlotUpdate) -> list[dict[str, Any]]:
            nonlocal emitted
            if not update.text and not update.logprobs:
                return []
            scores = logprobs.legacy(tok, update.logprobs, emitted) if wants_logprobs else None
            emitted += len(update.text)
            return [{"index": 0, "text": update.text, "logprobs": scores, "finish_reason": None}]

        def finish_choice(reason: str) -> dict[str, Any]:
            return {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}

        return _stream(ctx, slot, base, render, finish_choice, None, body.stream_options)
    c = await _collect(slot)
    legacy_scores = logprobs.legacy(tok, c.logprobs) if wants_logprobs else None
    text = "".join(c.text)
    return _json(
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": legacy_scores,
                    "finish_reason": c.finish_reason,
                }
            ],
            "usage": _usage(slot, ctx),
        }
    )


@bp.get("/v1/models")
@bp.get("/models")
async def models() -> Response:
    ctx = server()
    entry = {
        "id": ctx.model_id,
        "object": "model",
        "created": ctx.created,
        "owned_by": "mlxcel",
        "meta": {"n_ctx": ctx.info.context_length, "description": ctx.info.description},
    }
    ollama = {"name": ctx.model_id, "model": ctx.model_id, "capabilities": ["completion"]}
    entry["capabilities"] = ollama["capabilities"]
    # Embedder / reranker entries follow; without a chat model only they are listed.
    data, listed = ([entry], [ollama]) if ctx.generation else ([], [])
    data += side_model_entries(ctx)
    data += audio_model_entries(ctx)
    listed += [
        {"name": e["id"], "model": e["id"], "capabilities": e["capabilities"]}
        for e in data[len(listed) :]
    ]
    return _json({"object": "list", "data": data, "models": listed})


def _json(obj: object, status: int = 200) -> Response:
    return Response(
        json.dumps(obj, ensure_ascii=False), status=status, content_type="application/json"
    )


__all__ = ["bp", "error_response"]

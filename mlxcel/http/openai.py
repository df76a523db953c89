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
from pathlib import Path
from typing import Any

import attrs
import trio
from quart import Blueprint, Response, request

from mlxcel.actors.side_models import require_generation
from mlxcel.http import logprobs, slot_wire, sse
from mlxcel.http.anthropic_blocks import model_page
from mlxcel.http.audio import audio_model_entries
from mlxcel.http.chat_render import Collected, message, stream_choices
from mlxcel.http.context import ServerContext, read_json, server
from mlxcel.http.embeddings import side_model_entries
from mlxcel.http.errors import envelope, error_response
from mlxcel.http.openai_wire import StreamOptions, chat_request, completion_request
from mlxcel.http.security import key_scope
from mlxcel.runtime.errors import InvalidRequest, MlxcelError
from mlxcel.runtime.messages import GenerationRequest
from mlxcel.runtime.slot import OutputSlot, SlotUpdate

bp = Blueprint("openai", __name__)

# The streamed choices for one slot update (each carrying ``update.index``), and the finishing
# choice for a finish reason (its index is set by the caller).
RenderFn = Callable[[SlotUpdate], list[dict[str, Any]]]
FinishFn = Callable[[str], dict[str, Any]]


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
    if gen.n > ctx.settings.parallel:
        # Each choice is a row of the batch, and all of a request's rows run together.
        raise InvalidRequest(
            f"n must be at most {ctx.settings.parallel} (this server's --parallel)", param="n"
        )
    gen = slot_wire.resolve(gen, parallel=ctx.settings.parallel, n_keep=ctx.settings.n_keep)
    slot = ctx.admission.submit(gen)
    try:
        await slot.wait_accepted()
    except BaseException:
        slot.cancel()
        raise
    return slot


async def _collect_choices(slot: OutputSlot) -> list[Collected]:
    """Every choice's whole answer, in index order."""
    try:
        collected = [Collected() for _ in range(slot.n)]
        while not slot.delivered:
            updates = await slot.next_choices()
            assert updates is not None  # no timeout given
            for update in updates:
                collected[update.index].add(update)
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
    ping = ctx.ping_interval

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse.data({**base, "choices": choices, **extra})

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                for index in range(slot.n):
                    yield chunk([{**first, "index": index}])
            while not slot.delivered:
                try:
                    updates = await slot.next_choices(timeout=ping)
                except MlxcelError as error:
                    yield sse.data(envelope(error))
                    return
                if updates is None:
                    yield sse.KEEPALIVE
                    continue
                # One choice per chunk, as OpenAI streams n > 1; clients merge by index.
                for update in updates:
                    for c in render(update):
                        yield chunk([c])
                    if update.finish_reason is not None:
                        yield chunk([{**finish(update.finish_reason), "index": update.index}])
            if options is not None and options.include_usage:
                yield chunk([], usage=_usage(slot, ctx))
            yield sse.DONE
        finally:
            slot.cancel()

    return sse.response(body(), slot.cancel)


@bp.post("/v1/chat/completions")
@bp.post("/chat/completions")
async def chat_completions() -> Response:
    ctx = server()
    require_generation(ctx.generation)
    body, gen = chat_request(
        await read_json(),
        ctx.settings.sampling,
        len(ctx.info.tokenizer),
        reasoning_budget=ctx.settings.reasoning_budget,
    )
    model = ctx.check_model(body.model)
    if body.reasoning_control:
        gen = attrs.evolve(gen, reasoning_control=key_scope(ctx.settings))
    ctx.check_tools(gen)
    slot = await start_generation(ctx, gen)
    created = int(time.time())
    base = {"id": gen.request_id, "object": "chat.completion", "created": created, "model": model}
    tok = ctx.info.tokenizer
    wants_logprobs = gen.logprobs is not None
    alias = ctx.settings.reasoning_alias_field != "none"
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
            lambda u: stream_choices(u, tok, wants_logprobs, alias),
            finish_choice,
            first,
            body.stream_options,
        )
    choices = [
        {
            "index": i,
            "message": message(c, alias),
            "logprobs": logprobs.chat(tok, c.logprobs) if wants_logprobs else None,
            "finish_reason": c.finish_reason,
        }
        for i, c in enumerate(await _collect_choices(slot))
    ]
    return _json(
        {
            **base,
            "system_fingerprint": None,
            "choices": choices,
            "usage": _usage(slot, ctx),
        }
    )


async def render_chat(body: dict[str, Any]) -> tuple[str, int]:
    """A chat request's prompt as the model will read it, and its length in tokens."""
    _, gen = chat_request(body, server().settings.sampling)
    actor = server().tokenizer
    text = await trio.to_thread.run_sync(actor.render, gen)
    n = len(await trio.to_thread.run_sync(actor.encode, gen))
    return text, n


@bp.post("/v1/chat/completions/input_tokens")
@bp.post("/chat/completions/input_tokens")
async def chat_input_tokens() -> Response:
    body = await read_json()
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    server().check_model(body.get("model") if isinstance(body.get("model"), str) else None)
    _, n = await render_chat(body)
    return _json({"input_tokens": n})


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
        emitted = [0] * gen.n  # text offsets, per choice

        def render(u: SlotUpdate) -> list[dict[str, Any]]:
            if not u.text and not u.logprobs:
                return []
            scores = logprobs.legacy(tok, u.logprobs, emitted[u.index]) if wants_logprobs else None
            emitted[u.index] += len(u.text)
            return [{"index": u.index, "text": u.text, "logprobs": scores, "finish_reason": None}]

        def finish_choice(reason: str) -> dict[str, Any]:
            return {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}

        return _stream(ctx, slot, base, render, finish_choice, None, body.stream_options)
    choices = [
        {
            "index": i,
            "text": "".join(c.text),
            "logprobs": logprobs.legacy(tok, c.logprobs) if wants_logprobs else None,
            "finish_reason": c.finish_reason,
        }
        for i, c in enumerate(await _collect_choices(slot))
    ]
    return _json({**base, "choices": choices, "usage": _usage(slot, ctx)})


@bp.get("/v1/models")
@bp.get("/models")
async def models() -> Response:
    ctx = server()
    if "anthropic-version" in request.headers and ctx.generation:
        return _json(model_page(ctx.model_id, ctx.created, ctx.info.context_length))
    info = ctx.info
    # llama-server's entry: created is the time of the request, and owned_by is its own.
    entry = {
        "id": ctx.model_id,
        "aliases": sorted(ctx.accepted_names - {ctx.model_id}),
        "tags": [],
        "object": "model",
        "created": int(time.time()),
        "owned_by": "llamacpp",
        "meta": {**info.meta, "n_ctx": info.context_length, "description": info.description},
    }
    ollama: dict[str, object] = {
        "name": ctx.model_id,
        "model": ctx.model_id,
        "capabilities": ["completion"],
        "details": {"format": weights_format(info.path)},
    }
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


def weights_format(path: Path | None) -> str:
    """Ollama's ``details.format``: what the weights were read from."""
    return "gguf" if path is not None and path.suffix == ".gguf" else "safetensors"


def _json(obj: object, status: int = 200) -> Response:
    return Response(
        json.dumps(obj, ensure_ascii=False), status=status, content_type="application/json"
    )


__all__ = ["bp", "error_response"]

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

from mlxcel.http import heard, logprobs, media, slot_wire, sse
from mlxcel.http.anthropic_blocks import model_page
from mlxcel.http.audio import audio_model_entries
from mlxcel.http.chat_render import Collected, message, stream_choices
from mlxcel.http.context import (
    Model,
    ServerContext,
    check_tools,
    read_json,
    require_chat,
    server,
)
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


def _ms(a: float | None, b: float | None) -> float:
    return (b - a) * 1000.0 if a is not None and b is not None else 0.0


def timings(slot: OutputSlot) -> dict[str, float]:
    """llama-server's `timings` object for a request so far (with its draft counts when
    speculation proposed tokens for it, as llama-server adds them)."""
    prompt_n = slot.prompt_tokens - slot.cached_tokens
    prompt_ms = _ms(slot.started_at, slot.first_token_at)
    end = slot.finished_at if slot.finished_at is not None else time.monotonic()
    predicted_ms = _ms(slot.first_token_at, end)
    n = slot.completion_tokens
    out = {
        "cache_n": slot.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n * 1000.0 / prompt_ms if prompt_ms else 0.0,
        "predicted_n": n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / n if n else 0.0,
        "predicted_per_second": n * 1000.0 / predicted_ms if predicted_ms else 0.0,
    }
    if slot.draft_n:
        out["draft_n"] = slot.draft_n
        out["draft_n_accepted"] = slot.draft_n_accepted
    return out


PRIORITIES = {"high": 0, "normal": 1, "low": 2}


async def start_generation(
    ctx: ServerContext, model: Model, gen: GenerationRequest, *, progress: bool = False
) -> OutputSlot:
    """Submit (503 when the queue is full), then wait until the prompt is tokenized.

    ``progress``: keep llama-server's prompt_progress reports for the stream to send."""
    lane = request.headers.get("X-Priority", "normal").strip().lower()
    if lane not in PRIORITIES:
        raise InvalidRequest("X-Priority must be high, normal or low", param="X-Priority")
    gen = attrs.evolve(gen, priority=PRIORITIES[lane])
    if gen.n > model.parallel:
        # Each choice is a row of the batch, and all of a request's rows run together.
        raise InvalidRequest(
            f"n must be at most {model.parallel} (this server's --parallel)", param="n"
        )
    gen = slot_wire.resolve(gen, parallel=model.parallel, n_keep=ctx.settings.n_keep)
    gen = await media.resolve(gen, ctx.settings)
    gen = await heard.hear(gen, ctx.stt, model.info.media)
    slot = model.pipeline.submit(gen)
    if progress:
        slot.track_progress()
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
    *,
    timed: bool = False,
    progress: dict[str, Any] | None = None,
) -> Response:
    """``timed``: llama-server's timings_per_token (every chunk after the first carries the
    timings so far); ``progress``: its return_progress, the empty choice that carries each
    `prompt_progress` report (one as the prompt starts, then one per prefill chunk). The last
    chunk carries the request's `timings`, as llama-server's does."""
    ping = ctx.ping_interval
    include_usage = options is not None and bool(options.include_usage)

    def chunk(choices: list[dict[str, Any]], *, last: bool = False, **extra: Any) -> bytes:
        if timed or last:
            extra["timings"] = timings(slot)
        return sse.data({**base, "choices": choices, **extra})

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                for index in range(slot.n):
                    yield sse.data({**base, "choices": [{**first, "index": index}]})
            while not slot.delivered:
                try:
                    updates = await slot.next_choices(timeout=ping)
                except MlxcelError as error:
                    yield sse.data(envelope(error))
                    return
                if progress is not None:
                    for report in slot.take_progress():
                        yield chunk([progress], prompt_progress=report)
                if updates is None:
                    yield sse.KEEPALIVE
                    continue
                # One choice per chunk, as OpenAI streams n > 1; clients merge by index.
                for update in updates:
                    for c in render(update):
                        yield chunk([c])
                    if update.finish_reason is not None:
                        last = slot.delivered and update is updates[-1] and not include_usage
                        choice = {**finish(update.finish_reason), "index": update.index}
                        yield chunk([choice], last=last)
            if include_usage:
                yield chunk([], last=True, usage=_usage(slot, ctx))
            yield sse.DONE
        finally:
            slot.cancel()

    return sse.response(body(), slot.cancel)


@bp.post("/v1/chat/completions")
@bp.post("/chat/completions")
async def chat_completions() -> Response:
    ctx = server()
    raw = await read_json()
    model = await ctx.model(raw)
    require_chat(model)
    hears, native_audio = heard.hearing(ctx.stt, ctx.settings.audio_input, model.info.media)
    body, gen = chat_request(
        raw,
        ctx.settings.sampling,
        len(model.info.tokenizer),
        reasoning_budget=ctx.settings.reasoning_budget,
        tokenizer=model.info.tokenizer,
        vision=model.info.media is not None,
        hears=hears,
        native_audio=native_audio,
    )
    if body.reasoning_control:
        gen = attrs.evolve(gen, reasoning_control=key_scope(ctx.settings))
    check_tools(model, gen)
    progress = bool(body.stream and body.return_progress)
    slot = await start_generation(ctx, model, gen, progress=progress)
    created = int(time.time())
    base = {
        "id": gen.request_id,
        "object": "chat.completion",
        "created": created,
        "model": model.name,
    }
    fingerprint = ctx.fingerprint(model)
    tok = model.info.tokenizer
    wants_logprobs = gen.logprobs is not None
    alias = ctx.settings.reasoning_alias_field != "none"
    greedy = gen.sampling.temperature == 0
    if body.stream:
        base = {**base, "object": "chat.completion.chunk", "system_fingerprint": fingerprint}

        def finish_choice(reason: str) -> dict[str, Any]:
            return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}

        first = {
            "index": 0,
            "delta": {"role": "assistant", "content": None},
            "logprobs": None,
            "finish_reason": None,
        }

        def render(u: SlotUpdate) -> list[dict[str, Any]]:
            choices = stream_choices(u, tok, wants_logprobs, alias)
            if body.post_sampling_probs:
                for c in choices:
                    if c["logprobs"] is not None:
                        c["logprobs"]["content"] = logprobs.as_probs(
                            c["logprobs"]["content"], greedy=greedy
                        )
            return choices

        return _stream(
            ctx,
            slot,
            base,
            render,
            finish_choice,
            first,
            body.stream_options,
            timed=bool(body.timings_per_token),
            progress={**first, "index": 0} if body.return_progress else None,
        )

    def scores(c: Collected) -> dict[str, Any] | None:
        if not wants_logprobs:
            return None
        out = logprobs.chat(tok, c.logprobs)
        if body.post_sampling_probs:
            out["content"] = logprobs.as_probs(out["content"], greedy=greedy)
        return out

    choices = [
        {
            "index": i,
            "message": message(c, alias),
            "logprobs": scores(c),
            "finish_reason": c.finish_reason,
        }
        for i, c in enumerate(await _collect_choices(slot))
    ]
    return _json(
        {
            **base,
            "system_fingerprint": fingerprint,
            "choices": choices,
            "usage": _usage(slot, ctx),
            "timings": timings(slot),
        }
    )


async def render_chat(model: Model, body: dict[str, Any]) -> tuple[str, int]:
    """A chat request's prompt as the model will read it, and its length in tokens."""
    ctx = server()
    hears, native_audio = heard.hearing(ctx.stt, ctx.settings.audio_input, model.info.media)
    _, gen = chat_request(
        body,
        ctx.settings.sampling,
        vision=model.info.media is not None,
        hears=hears,
        native_audio=native_audio,
    )
    text = await trio.to_thread.run_sync(model.pipeline.render, gen)
    return text, await count_prompt(ctx, model, gen)


async def count_prompt(ctx: ServerContext, model: Model, gen: GenerationRequest) -> int:
    """The prompt's length in tokens as generation counts it: its images and audio read
    (within the limits, as when it is submitted) and expanded by the model's processor, or
    audio transcribed for a model that does not hear it."""
    if gen.images or gen.audio:
        gen = await media.resolve(gen, ctx.settings)
        gen = await heard.hear(gen, ctx.stt, model.info.media)
    return await trio.to_thread.run_sync(model.pipeline.count_tokens, gen)


@bp.post("/v1/chat/completions/input_tokens")
@bp.post("/chat/completions/input_tokens")
async def chat_input_tokens() -> Response:
    body = await read_json()
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    _, n = await render_chat(await server().model(body), body)
    return _json({"input_tokens": n})


@bp.post("/v1/completions")
async def completions() -> Response:
    ctx = server()
    raw = await read_json()
    model = await ctx.model(raw)
    require_chat(model)
    tok = model.info.tokenizer
    body, gen = completion_request(raw, ctx.settings.sampling, len(tok), tok)
    slot = await start_generation(ctx, model, gen)
    base = {
        "id": gen.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model.name,
        "system_fingerprint": ctx.fingerprint(model),
    }
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
    return _json({**base, "choices": choices, "usage": _usage(slot, ctx), "timings": timings(slot)})


@bp.get("/v1/models")
@bp.get("/models")
async def models() -> Response:
    ctx = server()
    default = ctx.models.default()
    if "anthropic-version" in request.headers and ctx.models.router:
        lines = ctx.models.listing()
        chat = [(m.name, m.hosted.info.context_length if m.hosted else None) for m in lines]
        return _json(model_page(chat, ctx.created))
    if "anthropic-version" in request.headers and ctx.generation:
        assert default is not None
        return _json(model_page([(default.name, default.info.context_length)], ctx.created))
    data: list[dict[str, Any]] = []
    listed: list[dict[str, Any]] = []
    if ctx.models.router:
        for line in ctx.models.listing():
            entry, ollama = _model_entry(ctx, line.name, line.hosted)
            # llama-server's router: where each model stands.
            status: dict[str, Any] = {"value": _STATUS.get(line.status, line.status)}
            if line.hosted is not None:
                status["args"] = ["-m", line.source]
            if line.status == "failed":
                status.update(failed=True, error=line.error)
            entry["status"] = status
            data.append(entry)
            listed.append(ollama)
    elif ctx.generation:
        assert default is not None
        entry, ollama = _model_entry(ctx, default.name, default)
        data, listed = [entry], [ollama]
    # Embedder / reranker entries follow; without a chat model only they are listed.
    side = side_model_entries(ctx) + audio_model_entries(ctx)
    if ctx.models.router:
        # Served all along (router clients read every entry's status).
        side = [{**e, "status": {"value": "loaded"}} for e in side]
    data += side
    listed += [
        {"name": e["id"], "model": e["id"], "capabilities": e["capabilities"]}
        for e in data[len(listed) :]
    ]
    return _json({"object": "list", "data": data, "models": listed})


# llama-server's router reports three states; ours has two more on the way.
_STATUS = {"unloading": "loaded", "failed": "unloaded"}


def _model_entry(
    ctx: ServerContext, name: str, model: Model | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One model's OpenAI entry and its Ollama-style twin (facts only once it is loaded)."""
    # llama-server's entry: created is the time of the request, and owned_by is its own.
    entry: dict[str, Any] = {
        "id": name,
        "aliases": sorted(ctx.models.aliases(name) - {name}) if model is not None else [],
        "tags": [],
        "object": "model",
        "created": int(time.time()),
        "owned_by": "llamacpp",
    }
    ollama: dict[str, Any] = {"name": name, "model": name}
    if model is not None:
        info = model.info
        entry["meta"] = {
            **info.meta,
            "n_ctx": info.context_length,
            "description": info.description,
        }
        # Ollama's words: "completion", "vision" for a model that reads images and "audio" for
        # one that hears audio itself; router mode's embedding and reranking models say what
        # they serve.
        if model.embedder is not None or model.reranker is not None:
            ollama["capabilities"] = ["embedding"] if model.embedder is not None else ["rerank"]
        else:
            ollama["capabilities"] = [
                "completion",
                *(["vision"] if info.media else []),
                *(["audio"] if heard.hears_itself(info.media) else []),
            ]
        ollama["details"] = {"format": weights_format(info.path)}
        entry["capabilities"] = ollama["capabilities"]
    return entry, ollama


def weights_format(path: Path | None) -> str:
    """Ollama's ``details.format``: what the weights were read from."""
    return "gguf" if path is not None and path.suffix == ".gguf" else "safetensors"


def _json(obj: object, status: int = 200) -> Response:
    return Response(
        json.dumps(obj, ensure_ascii=False), status=status, content_type="application/json"
    )


__all__ = ["bp", "error_response"]

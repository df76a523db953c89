"""Anthropic Messages routes: /v1/messages and /v1/messages/count_tokens (and their aliases).

Same shape as the OpenAI routes: validate (400 before any work), submit (503
``overloaded_error`` before any byte), wait until the prompt is tokenized, then collect or
stream. Streams use named SSE events (message_start, content blocks, message_delta,
message_stop) with real ``ping`` events while the model is silent. Whatever way a handler ends --
finished, failed, or cancelled because the client went away -- its ``finally`` cancels the
slot, which aborts the generation at the next step boundary.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint, Response

from mlxcel.http import sse
from mlxcel.http.anthropic_blocks import BlockStream, content, stop_reason, usage
from mlxcel.http.anthropic_wire import MessagesRequest, messages_request
from mlxcel.http.chat_render import Collected
from mlxcel.http.context import (
    Model,
    ServerContext,
    check_tools,
    read_json,
    require_chat,
    server,
)
from mlxcel.http.errors import envelope
from mlxcel.http.openai import count_prompt, start_generation
from mlxcel.runtime.errors import InternalError, MlxcelError
from mlxcel.runtime.slot import OutputSlot

bp = Blueprint("anthropic", __name__)

PING = sse.event("ping", {"type": "ping"})


async def _parse(ctx: ServerContext) -> tuple[MessagesRequest, Model]:
    """The converted request and the model it names; 400 for what this model cannot do."""
    raw = await read_json()
    model = await ctx.model(raw)
    require_chat(model)
    tok = model.info.tokenizer
    req = messages_request(
        raw,
        ctx.settings.sampling,
        len(tok),
        ctx.settings.reasoning_budget,
        tok,
        vision=model.info.media is not None,
    )
    check_tools(model, req.generation)
    return req, model


@bp.post("/v1/messages")
@bp.post("/messages")
async def messages() -> Response:
    ctx = server()
    req, model = await _parse(ctx)
    slot = await start_generation(ctx, model, req.generation)
    message = {
        "id": req.generation.request_id,
        "type": "message",
        "role": "assistant",
        "model": model.name,
    }
    if req.body.stream:
        return _stream(ctx, slot, req, message)
    c = await _collect(slot)
    reason, sequence = stop_reason(
        c.finish_reason,
        slot.stop_word,
        slot.completion_tokens,
        req.body.max_tokens,
        interrupted=slot.interrupted,
    )
    body = {
        **message,
        "content": content(c, req.thinking),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(slot),
    }
    return Response(json.dumps(body, ensure_ascii=False), content_type="application/json")


@bp.post("/v1/messages/count_tokens")
@bp.post("/messages/count_tokens")
async def count_tokens() -> Response:
    """The prompt's token count, rendered and encoded exactly as generation would."""
    ctx = server()
    req, model = await _parse(ctx)
    n = await count_prompt(ctx, model, req.generation)
    return Response(json.dumps({"input_tokens": n}), content_type="application/json")


async def _collect(slot: OutputSlot) -> Collected:
    """Merge every update until the finish; a cancelled handler aborts the generation."""
    collected = Collected()
    try:
        while True:
            update = await slot.next()
            assert update is not None  # no timeout given
            collected.add(update)
            if update.finish_reason in ("abort", "error"):
                raise InternalError("The generation was aborted.")
            if update.finish_reason is not None:
                return collected
    finally:
        slot.cancel()


def _stream(
    ctx: ServerContext, slot: OutputSlot, req: MessagesRequest, message: dict[str, Any]
) -> Response:
    ping = ctx.ping_interval
    blocks = BlockStream(req.thinking)

    def start() -> bytes:
        # Sent once the request is in the batch: the prompt cache's share is known then, so
        # message_start splits input_tokens and cache_read_input_tokens as message_delta does.
        counts = {**usage(slot), "output_tokens": 0}
        started = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
        return sse.event(
            "message_start", {"type": "message_start", "message": {**started, "usage": counts}}
        )

    async def body() -> AsyncIterator[bytes]:
        try:
            while not await slot.wait_placed(ping):
                yield PING  # queued behind a full batch: keep the connection alive
            yield start()
            while True:
                try:
                    update = await slot.next(timeout=ping)
                    if update is not None and update.finish_reason in ("abort", "error"):
                        raise InternalError("The generation was aborted.")
                except MlxcelError as error:
                    # No message_stop after an error: the client must not take it as complete.
                    yield sse.event("error", envelope(error, "anthropic"))
                    return
                if update is None:
                    yield PING
                    continue
                for name, payload in blocks.feed(update):
                    yield sse.event(name, payload)
                if update.finish_reason is not None:
                    break
            for name, payload in blocks.close([]):
                yield sse.event(name, payload)
            reason, sequence = stop_reason(
                update.finish_reason,
                slot.stop_word,
                slot.completion_tokens,
                req.body.max_tokens,
                interrupted=slot.interrupted,
            )
            yield sse.event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(slot),
                },
            )
            yield sse.event("message_stop", {"type": "message_stop"})
        finally:
            slot.cancel()

    return sse.response(body(), slot.cancel)

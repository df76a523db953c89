"""OpenAI Responses routes: /v1/responses (+ alias), retrieve, delete, cancel, input_items,
input_tokens.

Create follows the chat route's shape: validate (400 before any work), load the history a
``previous_response_id`` or ``conversation`` names from the session store, submit (503 before
any byte), wait for tokenization, then collect or stream. The handler registers the response
as running, so ``/cancel`` can end it: cancel aborts the generation and wakes the handler,
which finishes the response as ``cancelled``. Whatever way the handler ends, its ``finally``
cancels the slot (a disconnect aborts the generation at the next step boundary) and removes
the running entry. A stored response is written before its last event is sent, so a client
that saw ``response.completed`` can retrieve it at once.

``background: true`` runs the same event stream in the background actor (a ``StreamSessions``
keyed by response id) instead of in the request: the response goes on without its client, is
polled and cancelled as any running one (on any replica of a shared store), and its events
can be followed again from a sequence number.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio
from quart import Blueprint, Response, request

from mlxcel.actors.session_store import Running, SessionStore
from mlxcel.actors.stream_sessions import CLOSE_GRACE_S, StreamSession
from mlxcel.http import heard, sse
from mlxcel.http.context import (
    Model,
    ServerContext,
    check_tools,
    read_json,
    require_chat,
    server,
)
from mlxcel.http.openai import count_prompt, start_generation
from mlxcel.http.responses_output import OutputBuilder, response_object, usage
from mlxcel.http.responses_wire import (
    ResponsesBody,
    conversation_id,
    generation_request,
    input_items,
    new_id,
    parse_body,
)
from mlxcel.runtime import truncation
from mlxcel.runtime.errors import (
    ContextOverflow,
    InternalError,
    InvalidRequest,
    MlxcelError,
    NotFound,
)
from mlxcel.runtime.messages import GenerationRequest
from mlxcel.runtime.slot import OutputSlot

bp = Blueprint("responses", __name__)
log = logging.getLogger(__name__)

STORE_OFF = (
    "Response storage is disabled on this server (--responses-store-max-entries 0): "
    "responses are not kept, so they cannot be retrieved, cancelled or chained."
)
CONVERSATIONS_OFF = (
    "Conversations are disabled on this server (--conversation-store-max-entries 0)."
)


def _json(obj: object, status: int = 200) -> Response:
    return Response(
        json.dumps(obj, ensure_ascii=False), status=status, content_type="application/json"
    )


def store_of(ctx: ServerContext) -> SessionStore:
    assert ctx.session_store is not None
    return ctx.session_store


# --- history ---------------------------------------------------------------------------------


async def load_history(
    store: SessionStore, body: ResponsesBody
) -> tuple[list[dict[str, Any]], str | None]:
    """Earlier turns as items, and the conversation this turn belongs to (if any)."""
    if body.previous_response_id is not None:
        if not store.enabled("responses"):
            raise InvalidRequest(STORE_OFF, param="previous_response_id")
        prev = await store.get("responses", body.previous_response_id)
        if prev is None:
            raise NotFound(
                f"Previous response with id '{body.previous_response_id}' not found.",
                param="previous_response_id",
            )
        return list(prev["context"]), None
    conv = conversation_id(body.conversation)
    if conv is None:
        return [], None
    if not store.enabled("conversations"):
        raise InvalidRequest(CONVERSATIONS_OFF, param="conversation")
    stored = await store.get("conversations", conv)
    return (list(stored["items"]) if stored else []), conv


async def _append_to_conversation(
    store: SessionStore, conv: str, items: list[dict[str, Any]]
) -> None:
    def append(stored: dict[str, Any] | None) -> dict[str, Any]:
        stored = stored or new_conversation(conv, {})
        return {**stored, "items": [*stored["items"], *items]}

    await store.update("conversations", conv, append)


def new_conversation(conv: str, metadata: dict[str, Any]) -> dict[str, Any]:
    # A conversation id first seen in a `conversation` field starts an empty conversation.
    return {"id": conv, "created_at": int(time.time()), "metadata": metadata, "items": []}


# --- create ----------------------------------------------------------------------------------


def _echo(
    ctx: ServerContext, body: ResponsesBody, rid: str, model: str, conv: str | None, stored: bool
) -> dict[str, Any]:
    defaults = ctx.settings.sampling
    tools = [
        {
            "type": "function",
            "name": t["name"],
            "description": t.get("description"),
            "parameters": t.get("parameters"),
            "strict": t.get("strict"),
        }
        for t in body.tools or []
    ]
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "instructions": body.instructions,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "max_tool_calls": body.max_tool_calls,
        "temperature": defaults.temperature if body.temperature is None else body.temperature,
        "top_p": defaults.top_p if body.top_p is None else body.top_p,
        "top_logprobs": body.top_logprobs,
        "tool_choice": body.tool_choice or "auto",
        "tools": tools,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "conversation": {"id": conv} if conv else None,
        "reasoning": body.reasoning,
        "text": body.text or {"format": {"type": "text"}},
        "truncation": body.truncation or "disabled",
        "store": stored,
        "background": bool(body.background),
        "user": body.user,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "service_tier": body.service_tier or "default",
    }


class _Turn:
    """One create request while it runs: builds events, the final object, and stores it."""

    def __init__(
        self,
        ctx: ServerContext,
        model: Model,
        body: ResponsesBody,
        gen: GenerationRequest,
        slot: OutputSlot,
        base: dict[str, Any],
        items: list[dict[str, Any]],
        history: list[dict[str, Any]],
        conv: str | None,
    ) -> None:
        self.ctx = ctx
        self.model = model
        self.slot = slot
        self.base = base
        self.items = items
        self.history = history
        self.conv = conv
        self.store = store_of(ctx)
        self.builder = OutputBuilder(
            model.info.tokenizer, gen.logprobs is not None, body.max_tool_calls
        )
        self.running = Running(self.snapshot, slot)
        self.background = bool(body.background)
        self.finished = False
        self._seq = 0

    def snapshot(self) -> dict[str, Any]:
        return response_object(self.base, "in_progress", self.builder.live_items())

    def event(self, event: dict[str, Any]) -> bytes:
        frame = {**event, "sequence_number": self._seq}
        self._seq += 1
        return sse.event(event["type"], frame)

    async def finish(self, finish_reason: str | None, error: MlxcelError | None) -> dict[str, Any]:
        """Close the output, build the final object, store it when asked; returns the object."""
        self.finished = True
        cut = finish_reason == "length"
        self.final_events = self.builder.finish(incomplete=cut)
        slot = self.slot
        if error is not None:
            status = "failed"
        elif self.running.cancel_requested or finish_reason == "abort":
            status = "cancelled"
        elif cut:
            status = "incomplete"
        else:
            status = "completed"
        reasoning = "".join(self.builder.reasoning_text)
        n_reasoning = 0
        if reasoning:
            tok = self.model.info.tokenizer
            n_reasoning = len(
                await trio.to_thread.run_sync(
                    lambda: tok.encode(reasoning, add_special_tokens=False)
                )
            )
        obj = response_object(
            self.base,
            status,
            self.builder.items,
            usage=usage(
                slot.prompt_tokens, slot.completion_tokens, slot.cached_tokens, n_reasoning
            ),
            error={"code": "server_error", "message": error.message} if error else None,
            incomplete_reason="max_output_tokens" if status == "incomplete" else None,
        )
        output = obj["output"]
        try:
            if self.base["store"]:
                context = [*self.history, *self.items, *output]
                await self.store.put(
                    "responses",
                    self.base["id"],
                    {"response": obj, "input_items": self.items, "context": context},
                )
            if self.conv is not None and status in ("completed", "incomplete"):
                await _append_to_conversation(self.store, self.conv, [*self.items, *output])
        except Exception:  # the client still gets its answer; the log says what was lost
            log.exception("storing response %s failed", self.base["id"])
        # Finished and stored: from here on GET and /cancel read the stored object.
        self.close()
        return obj

    def close(self) -> None:
        """Abort whatever is still running and leave the running registry. Idempotent."""
        self.slot.cancel()
        self.running.done.set()
        self.store.end_running(self.base["id"])


def _input(ctx: ServerContext, model: Model, value: Any) -> list[dict[str, Any]]:
    """The input items, reading images on a vision model and audio when the model or a
    speech-to-text model hears it (unless --no-audio-input)."""
    hears, _ = heard.hearing(ctx.stt, ctx.settings.audio_input, model.info.media)
    return input_items(value, vision=model.info.media is not None, hears=hears)


async def _heard(
    ctx: ServerContext, model: Model, items: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The items with their audio checked and kept (a model that hears it) or transcribed."""
    media = model.info.media
    if heard.hears_itself(media):
        return await heard.keep_items(items, media.max_audio_seconds)
    return await heard.transcribe_items(items, ctx.stt) if ctx.stt is not None else items


@bp.post("/v1/responses")
@bp.post("/responses")
async def create() -> Response:
    ctx = server()
    body = parse_body(await read_json())
    model = await ctx.model(body.model)
    require_chat(model)
    store = store_of(ctx)
    if body.background and not store.enabled("responses"):
        raise InvalidRequest(STORE_OFF, param="background")
    items = await _heard(ctx, model, _input(ctx, model, body.input))
    history, conv = await load_history(store, body)
    rid = new_id("resp")

    def build(context: list[dict[str, Any]]) -> GenerationRequest:
        return generation_request(
            body,
            rid,
            context,
            ctx.settings.sampling,
            len(model.info.tokenizer),
            ctx.settings.reasoning_budget,
            model.info.tokenizer,
        )

    gen = build([*history, *items])
    if body.truncation == "auto":
        gen = await trio.to_thread.run_sync(_truncated, model, gen, [*history, *items], build)
    check_tools(model, gen)
    stored = body.store is not False and store.enabled("responses")
    base = _echo(ctx, body, rid, model.name, conv, stored)
    try:
        slot = await start_generation(ctx, model, gen)
    except ContextOverflow as overflow:
        overflow.param = "input"  # Responses has no `messages`
        raise
    turn = _Turn(ctx, model, body, gen, slot, base, items, history, conv)
    store.begin_running(rid, turn.running)
    if body.background:
        return _background(ctx, turn, stream=bool(body.stream))
    if body.stream:
        return sse.response(_stream(turn), turn.close)
    try:
        finish, error = None, None
        try:
            while finish is None:
                update = await slot.next()
                assert update is not None  # no timeout given
                turn.builder.feed(update)
                finish = update.finish_reason
        except MlxcelError as failure:
            error = failure
        obj = await turn.finish(finish, error)
    finally:
        turn.close()
    return _json(obj)


def _truncated(
    model: Model,
    gen: GenerationRequest,
    context: list[dict[str, Any]],
    build: Callable[[list[dict[str, Any]]], GenerationRequest],
) -> GenerationRequest:
    """``truncation: "auto"``: when the prompt leaves the answer no room (its
    ``max_output_tokens``, else a quarter of the window), the oldest items go, whole turns at a
    time (a cut falls only before a user message, so a tool call keeps its output), until it
    fits. The last turn always stays; if it alone is too long, the usual 400 follows. Runs in
    a thread: it encodes the prompt once, and ~log2(turns) more times when it cuts."""
    limit = truncation.budget(
        truncation.Truncation(),
        context=model.info.context_length,
        instructions=0,
        max_output=gen.max_tokens,
    )
    starts = [i for i, item in enumerate(context) if _starts_turn(item)]
    count = model.pipeline.count_tokens
    if not starts or count(gen) <= limit:
        return gen
    first = truncation.first_kept(
        len(starts), 0, lambda k: count(build(context[starts[k] :])), limit, 1.0
    )
    log.info(
        "response %s: the model reads items %d.. of %d", gen.request_id, starts[first], len(context)
    )
    return build(context[starts[first] :])


def _starts_turn(item: dict[str, Any]) -> bool:
    return item.get("type", "message") == "message" and item.get("role") == "user"


def _background(ctx: ServerContext, turn: _Turn, *, stream: bool) -> Response:
    """``background: true``: the event stream runs in the background actor, not in this
    request, so the response goes on when the client leaves. Without ``stream`` the answer is
    the queued response, to be polled (GET) or cancelled; with it, the client follows the
    events, and ``GET ...?stream=true&starting_after=N`` picks them up again later."""
    session = ctx.background.attach("", turn.base["id"], _stream(turn), turn.close)
    if stream:
        return _follow(ctx, session, -1)
    return _json(response_object(turn.base, "queued", []))


def _follow(ctx: ServerContext, session: StreamSession, after: int) -> Response:
    offset = session.offset_after(after)
    if offset < session.dropped:
        raise InvalidRequest(
            f"the events after {after} are no longer kept: start again from a later one",
            param="starting_after",
        )
    return Response(
        session.follow(offset, ctx.ping_interval),
        content_type="text/event-stream",
        headers=sse.HEADERS,
    )


async def _stream(turn: _Turn) -> AsyncIterator[bytes]:
    """The typed event stream. Cancellation (the client went away) aborts the generation in
    the ``finally``; nothing is stored for a response nobody received, except a background
    one, which is stored as failed (a poller must not wait for it forever)."""
    ctx = turn.ctx
    ping = ctx.ping_interval
    try:
        start = turn.snapshot()
        created = {**start, "status": "queued"} if turn.background else start
        yield turn.event({"type": "response.created", "response": created})
        yield turn.event({"type": "response.in_progress", "response": start})
        finish, error = None, None
        while finish is None:
            try:
                update = await turn.slot.next(timeout=ping)
            except MlxcelError as failure:
                error = failure
                break
            if update is None:
                yield sse.KEEPALIVE
                continue
            for event in turn.builder.feed(update):
                yield turn.event(event)
            finish = update.finish_reason
        obj = await turn.finish(finish, error)
        for event in turn.final_events:
            yield turn.event(event)
        terminal = {
            "completed": "response.completed",
            "failed": "response.failed",
            "incomplete": "response.incomplete",
            # No event type means "cancelled"; the object's status says it.
            "cancelled": "response.incomplete",
        }[obj["status"]]
        yield turn.event({"type": terminal, "response": obj})
    finally:
        if turn.background and not turn.finished:
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_GRACE_S):
                await turn.finish(None, InternalError("the server stopped generating it"))
        turn.close()


# --- retrieve, delete, cancel, input items ---------------------------------------------------


async def _stored(rid: str) -> dict[str, Any]:
    store = store_of(server())
    if not store.enabled("responses"):
        raise InvalidRequest(STORE_OFF)
    found = await store.get("responses", rid)
    if found is None:
        raise NotFound(f"Response with id '{rid}' not found.")
    return found


@bp.get("/v1/responses/<rid>")
@bp.get("/responses/<rid>")
async def retrieve(rid: str) -> Response:
    store = store_of(server())
    if request.args.get("stream") in ("true", "1"):
        return _stream_again(rid)
    snapshot = store.running_snapshot(rid)
    if snapshot is not None:
        return _json(snapshot)
    try:
        return _json((await _stored(rid))["response"])
    except NotFound:
        # With a shared store another replica may be generating it: it shows as it started.
        if (elsewhere := await store.shared_running(rid)) is None:
            raise
        return _json(elsewhere)


def _stream_again(rid: str) -> Response:
    """A background response's events after ``starting_after`` (from the first without it),
    live until it ends: kept on the replica that runs it, for 5 minutes after it ends."""
    ctx = server()
    raw = request.args.get("starting_after", "").strip()
    if raw and not raw.isdigit():
        raise InvalidRequest(
            "starting_after must be an event's sequence_number", param="starting_after"
        )
    session = ctx.background.get("", rid)
    if session is None:
        raise InvalidRequest(
            "only a background response can be streamed again, from the replica that runs it "
            "and until 5 minutes after it ends",
            param="stream",
        )
    return _follow(ctx, session, int(raw) if raw else -1)


@bp.delete("/v1/responses/<rid>")
@bp.delete("/responses/<rid>")
async def delete(rid: str) -> Response:
    store = store_of(server())
    if not store.enabled("responses"):
        raise InvalidRequest(STORE_OFF)
    # A response still running (in the background) stops first: nothing is left generating
    # for a response that no longer exists.
    await store.cancel_running(rid)
    deleted = await store.delete("responses", rid)
    return _json({"id": rid, "object": "response.deleted", "deleted": deleted})


@bp.post("/v1/responses/<rid>/cancel")
@bp.post("/responses/<rid>/cancel")
async def cancel(rid: str) -> Response:
    store = store_of(server())
    # A message to the response's owner, the store: it stops the generation and waits for
    # the handler to store the cancelled response, so a GET right after this answer sees it.
    snapshot = await store.cancel_running(rid)
    if snapshot is not None:
        found = await store.get("responses", rid) if store.enabled("responses") else None
        return _json(found["response"] if found else {**snapshot, "status": "cancelled"})
    await _stored(rid)  # 400 with the store off, 404 when unknown

    def mark(found: dict[str, Any] | None) -> dict[str, Any] | None:
        if found is not None:
            found["response"]["status"] = "cancelled"
        return found

    marked = await store.update("responses", rid, mark)
    if marked is None:
        raise NotFound(f"Response with id '{rid}' not found.")
    return _json(marked["response"])


@bp.get("/v1/responses/<rid>/input_items")
@bp.get("/responses/<rid>/input_items")
async def list_input_items(rid: str) -> Response:
    return _json(page(list((await _stored(rid))["input_items"])))


def page(items: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's cursor list from the query string: limit (1..100, default 20), order (desc by
    default), after / before an item id."""
    args = request.args
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc", param="order")
    try:
        limit = int(args.get("limit", 20))
    except ValueError:
        raise InvalidRequest("limit must be an integer", param="limit") from None
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be between 1 and 100", param="limit")
    if order == "desc":
        items = items[::-1]
    ids = [item["id"] for item in items]
    for cursor, shift in (("after", 1), ("before", 0)):
        if (value := args.get(cursor)) is not None:
            if value not in ids:
                raise InvalidRequest(f"no item with id '{value}'", param=cursor)
            cut = ids.index(value)
            items = items[cut + 1 :] if shift else items[:cut]
            ids = [item["id"] for item in items]
    chosen = items[:limit]
    return {
        "object": "list",
        "data": chosen,
        "first_id": chosen[0]["id"] if chosen else "",
        "last_id": chosen[-1]["id"] if chosen else "",
        "has_more": len(items) > limit,
    }


@bp.post("/v1/responses/input_tokens")
@bp.post("/responses/input_tokens")
async def input_tokens() -> Response:
    ctx = server()
    body = parse_body(await read_json())
    model = await ctx.model(body.model)
    require_chat(model)
    history, _ = await load_history(store_of(ctx), body)
    items = (
        await _heard(ctx, model, _input(ctx, model, body.input)) if body.input is not None else []
    )
    gen = generation_request(
        body,
        new_id("resp"),
        [*history, *items],
        ctx.settings.sampling,
        tokenizer=model.info.tokenizer,
    )
    n = await count_prompt(ctx, model, gen)
    return _json({"object": "response.input_tokens", "input_tokens": n})

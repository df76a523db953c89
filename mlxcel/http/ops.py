"""Operations routes, llama-server style: /props, /slots, /metrics (each behind its flag)."""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Literal, cast

import attrs
import trio
from quart import Blueprint, Response, request

from mlxcel import __version__
from mlxcel.http import heard, slot_files
from mlxcel.http.audio import audio_capabilities
from mlxcel.http.context import ServerContext, read_json, server
from mlxcel.http.embeddings import capabilities_props
from mlxcel.http.errors import error_response
from mlxcel.runtime.errors import (
    FeatureDisabled,
    InternalError,
    InvalidRequest,
    NotImplementedRoute,
    ServiceError,
    UnsupportedField,
)
from mlxcel.runtime.lora import UNSAVABLE_SLOT
from mlxcel.runtime.messages import GenerationRequest, SamplingParams, SlotAction, SlotReply
from mlxcel.runtime.settings import Settings

bp = Blueprint("ops", __name__)


class NotSupported(NotImplementedRoute):
    error_type = "not_supported_error"


def _gated(what: str, flag: str) -> Response:
    return error_response(
        NotSupported(f"This server does not support {what}. Start it with `{flag}`"), "native"
    )


def _json(obj: object) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), content_type="application/json")


def _speculative(settings: Settings) -> dict[str, Any]:
    """/props ``speculative``: the draft model, if any, what proposes, and how far."""
    kind = settings.spec_kind
    model = settings.model_draft if kind == "draft" else None
    return {"model": model, "kind": kind, "n_max": settings.spec_max}


def generation_defaults(ctx: ServerContext) -> dict[str, Any]:
    """The settings a request gets when it names none (/props)."""
    return generation_settings(
        ctx.settings.sampling,
        n_predict=ctx.settings.n_predict,
        stop=(),
        ignore_eos=False,
        stream=False,
        cache_prompt=ctx.settings.cache_enabled,
        n_keep=ctx.settings.n_keep,
        lora=ctx.lora.current(),
    )


def request_settings(
    ctx: ServerContext, gen: GenerationRequest, *, n_predict: int, stream: bool
) -> dict[str, Any]:
    """llama-server's ``generation_settings`` of one request (/completion, /slots)."""
    return generation_settings(
        gen.sampling,
        n_predict=n_predict,
        stop=gen.stop,
        ignore_eos=gen.ignore_eos,
        stream=stream,
        cache_prompt=gen.cache_key is not None and ctx.settings.cache_enabled,
        n_probs=gen.logprobs or 0,
        n_keep=gen.n_keep if gen.n_keep is not None else ctx.settings.n_keep,
        n_discard=gen.n_discard,
        # None: not admitted yet (/completion fills it as it parses; /slots shows admitted ones).
        lora=gen.lora if gen.lora is not None else ctx.lora.current(),
    )


def generation_settings(
    s: SamplingParams,
    *,
    n_predict: int,
    stop: tuple[str, ...],
    ignore_eos: bool,
    stream: bool,
    cache_prompt: bool,
    n_probs: int = 0,
    n_keep: int = 0,
    n_discard: int = 0,
    lora: tuple[float, ...] = (),
) -> dict[str, Any]:
    """llama-server's ``generation_settings``: the settings one completion ran with."""
    return {
        "n_predict": n_predict,
        **{k: v for k, v in attrs.asdict(s).items() if k not in ("seed", "logit_bias")},
        "dry_sequence_breakers": list(s.dry_sequence_breakers),
        "logit_bias": [list(p) for p in s.logit_bias],
        "seed": -1 if s.seed is None else s.seed,
        "stop": list(stop),
        "ignore_eos": ignore_eos,
        "stream": stream,
        "cache_prompt": cache_prompt,
        "n_probs": n_probs,
        "n_keep": n_keep,
        "n_discard": n_discard,
        "lora": [{"id": i, "scale": scale} for i, scale in enumerate(lora)],
    }


@functools.lru_cache(maxsize=4)
def template_caps(tokenizer: Any, template: str | None) -> dict[str, bool]:
    """llama-server's ``chat_template_caps``, found as it finds them: by rendering probe
    conversations with the template and looking for what came through."""
    caps = dict.fromkeys(
        (
            "supports_system_role",
            "supports_tools",
            "supports_tool_calls",
            "supports_tool_responses",
            "supports_parallel_tool_calls",
        ),
        False,
    )
    if not template:
        return caps

    def render(messages: list[dict[str, Any]], **kw: Any) -> str:
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, chat_template=template, **kw
            )
        except Exception:  # a template raises what it likes for what it refuses
            return ""
        return text if isinstance(text, str) else ""

    user: dict[str, Any] = {"role": "user", "content": "hi"}
    fn = {"name": "probe_tool_fn", "description": "d", "parameters": {"type": "object"}}
    call: dict[str, Any] = {
        "id": "call_probe",
        "type": "function",
        "function": {"name": "probe_call_fn", "arguments": {"a": 1}},
    }
    second: dict[str, Any] = {
        "id": "call_probe2",
        "type": "function",
        "function": {"name": "probe_call_two", "arguments": {"b": 2}},
    }
    turns: list[dict[str, Any]] = [
        user,
        {"role": "assistant", "content": None, "tool_calls": [call, second]},
        {"role": "tool", "tool_call_id": "call_probe", "content": "TOOL_RESULT_PROBE"},
    ]
    with_calls = render(turns)
    if not with_calls:
        # Some templates take the arguments as JSON text (DeepSeek V3.1's concatenates them);
        # the tokenizer actor gives them text when the object is refused, so the caps do too.
        as_text = [
            {
                **c,
                "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])},
            }
            for c in (call, second)
        ]
        with_calls = render([user, {**turns[1], "tool_calls": as_text}, turns[2]])
    caps["supports_system_role"] = "SYSTEM_PROBE" in render(
        [{"role": "system", "content": "SYSTEM_PROBE"}, user]
    )
    caps["supports_tools"] = "probe_tool_fn" in render(
        [user], tools=[{"type": "function", "function": fn}]
    )
    caps["supports_tool_calls"] = "probe_call_fn" in with_calls
    caps["supports_tool_responses"] = "TOOL_RESULT_PROBE" in with_calls
    caps["supports_parallel_tool_calls"] = "probe_call_two" in with_calls
    return caps


@bp.get("/props")
async def props() -> Response:
    ctx = server()
    named = request.args.get("model")
    if ctx.models.router and named is None:
        # llama-server's router answers for itself; ?model=NAME gives that model's props.
        return _json(
            {
                "role": "router",
                "max_instances": ctx.models.max_loaded,
                "models_autoload": ctx.models.autoload,
                "build_info": f"mlxcel-{__version__}",
                # mlxcel extension, as in a model's props: the side and speech models served.
                "capabilities": capabilities_props(ctx) | audio_capabilities(ctx),
            }
        )
    model = await ctx.model(named)
    info = model.info
    tok = info.tokenizer
    return _json(
        {
            "default_generation_settings": {
                "id": 0,
                "n_ctx": info.context_length,
                "params": generation_defaults(ctx),
            },
            "total_slots": model.parallel,
            "model_alias": model.name,
            "model_path": str(info.path) if info.path else "",
            "model_ftype": info.meta.get("ftype", ""),
            "chat_template": info.chat_template or "",
            "chat_template_caps": template_caps(tok, info.chat_template),
            "bos_token": getattr(tok, "bos_token", None) or "",
            "eos_token": getattr(tok, "eos_token", None) or "",
            # What the chat model reads itself (images: a vision model; audio: one with an
            # audio tower); audio heard through speech-to-text and the audio routes are in
            # capabilities.
            "modalities": {
                "vision": info.media is not None,
                "video": False,
                "audio": heard.hears_itself(info.media),
            },
            "build_info": f"mlxcel-{__version__}",
            # mlxcel extension: where the chat model computes ("cpu", "gpu (cuda: NVIDIA H200)").
            "device": info.device,
            # The KV cache is kept in the model's own precision: no KV quantisation here.
            "kv_cache_mode": "full",
            "kv_bits": None,
            "speculative": _speculative(ctx.settings),
            "geometry": {
                "n_batch": ctx.settings.prefill_chunk_size,
                "n_ubatch": ctx.settings.prefill_chunk_size,
                "n_batch_decode": model.parallel,
                "n_kv_max": info.context_length,
            },
            "endpoint_slots": ctx.settings.slots_endpoint,
            "endpoint_props": ctx.settings.props_endpoint,
            "endpoint_metrics": ctx.settings.metrics_endpoint,
            "is_sleeping": False,
            # Which kinds of model are served, and how /rerank scores (cross-encoder, or
            # embedding cosine when only an embedder is loaded).
            "capabilities": capabilities_props(ctx) | audio_capabilities(ctx),
        }
    )


@bp.post("/props")
async def set_props() -> Response:
    if not server().settings.props_endpoint:
        return _gated("changing props", "--props")
    return _json({"success": True})


@bp.get("/slots")
async def slots() -> Response:
    ctx = server()
    if not ctx.settings.slots_endpoint:
        return _gated("slots endpoint", "--slots")
    model = await ctx.model(request.args.get("model"))
    items = model.pipeline.statistics().slots
    if request.args.get("fail_on_no_slot") in ("1", "true") and all(items):
        return error_response(ServiceError("no slot available"), "native")
    debug = bool(os.environ.get("LLAMA_SERVER_SLOTS_DEBUG"))
    out = []
    for i, item in enumerate(items):
        entry: dict[str, Any] = {
            "id": i,
            "n_ctx": model.info.context_length,
            "is_processing": item is not None,
            "speculative": ctx.settings.speculating,
            "id_task": -1,
            # A busy slot shows the settings its request runs with, as llama-server's do.
            # (stream is not known past the route; llama-server's slots show it.)
            "params": generation_defaults(ctx)
            if item is None
            else request_settings(ctx, item.request, n_predict=item.max_tokens, stream=False),
            "prompt": "",
            "next_token": {"has_next_token": False, "n_remain": -1, "n_decoded": 0},
        }
        if item is not None:
            entry["id_task"] = item.request.request_id
            entry["n_prompt_tokens"] = item.prompt_tokens
            entry["n_prompt_tokens_cached"] = item.cached_tokens
            # A request with n choices fills n slots, one per choice, with its own count.
            entry["n_choice"] = item.choice
            decoded = item.decoded_tokens
            entry["next_token"] = {
                "has_next_token": True,
                "n_remain": item.max_tokens - decoded,
                "n_decoded": decoded,
            }
            if debug:  # prompts are users' data: shown only when explicitly asked for
                entry["prompt"] = model.pipeline.render(item.request)
        out.append(entry)
    return _json(out)


@bp.get("/metrics")
async def metrics() -> Response:
    ctx = server()
    if not ctx.settings.metrics_endpoint:
        return _gated("metrics endpoint", "--metrics")
    return Response(ctx.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")


SLOT_ACTIONS = ("save", "restore", "erase")
# The save and restore body's one key (also the OpenAPI document's).
SLOT_FIELDS = frozenset({"filename"})
SlotKind = Literal["save", "restore", "erase"]
RESTORE_FAILED = "Unable to restore slot, no available space in KV cache or invalid slot save file"


@bp.post("/slots/<slot_id>")
async def slot_action(slot_id: str) -> Response:
    """llama-server's slot save, restore and erase (`--slot-save-path`). A slot's cache is the
    prompt-cache entry its last sequence left (actors/model_runner/slots.py). The KV state is
    copied out of (or into) mlx between two steps; the file is written and read here, on a
    worker thread, so the other slots' decoding waits only for the copy.

    Cancellation (the client leaves) after the action reached the scheduler does not undo it.
    """
    ctx = server()
    if ctx.settings.slot_save_path is None:
        return _gated("slots action", "--slot-save-path")
    try:
        slot = int(slot_id)
    except ValueError:
        raise InvalidRequest("Invalid slot ID", param="id_slot") from None
    action = request.args.get("action", "")
    if action not in SLOT_ACTIONS:
        raise InvalidRequest(
            f"Invalid action {action!r}: expected one of {', '.join(SLOT_ACTIONS)}", param="action"
        )
    model = await ctx.model(request.args.get("model"))
    if not 0 <= slot < model.parallel:
        raise InvalidRequest(f"Invalid slot ID {slot}", param="id_slot")
    path = None
    if action != "erase":
        body = await read_json()
        if isinstance(body, dict) and set(body) - SLOT_FIELDS:
            raise UnsupportedField(sorted(set(body) - SLOT_FIELDS)[0])
        filename = body.get("filename") if isinstance(body, dict) else None
        if not slot_files.valid_filename(filename):
            raise InvalidRequest("Invalid filename", param="filename")
        path = ctx.settings.slot_save_path / str(filename)
    if model.pipeline.statistics().slots[slot] is not None:
        return error_response(ServiceError("Requested slot is processing"), "native")
    tic = time.perf_counter()
    state = None
    n_read = 0
    if action == "restore":
        assert path is not None
        try:
            state, n_read = await trio.to_thread.run_sync(
                slot_files.read, path, model.info.description
            )
        except slot_files.SlotFileError as error:
            raise InvalidRequest(f"{RESTORE_FAILED}: {error}") from None
        if len(state.tokens) > model.info.context_length:
            raise InvalidRequest("Restored prompt does not fit in the slot context")
    reply = SlotReply(trio.Event())
    kind = cast(SlotKind, action)  # one of SLOT_ACTIONS, checked above
    await model.pipeline.control(SlotAction(kind, slot, reply, state))
    await reply.done.wait()
    if reply.error is not None:
        if action == "restore":
            raise InvalidRequest(f"{RESTORE_FAILED}: {reply.error}")
        if reply.error.endswith(UNSAVABLE_SLOT):
            raise InvalidRequest(f"Unable to save slot: {UNSAVABLE_SLOT}")
        raise InternalError(f"Unable to {action} slot: {reply.error}")
    if action == "erase":
        return _json({"id_slot": slot, "n_erased": reply.n_tokens})
    if action == "restore":
        return _json(
            {
                "id_slot": slot,
                "filename": path.name if path else "",
                "n_restored": reply.n_tokens,
                "n_read": n_read,
                "timings": {"restore_ms": (time.perf_counter() - tic) * 1000.0},
            }
        )
    assert path is not None and reply.state is not None
    n_written = await trio.to_thread.run_sync(
        slot_files.write, path, reply.state, model.info.description
    )
    return _json(
        {
            "id_slot": slot,
            "filename": path.name,
            "n_saved": reply.n_tokens,
            "n_written": n_written,
            "timings": {"save_ms": (time.perf_counter() - tic) * 1000.0},
        }
    )


@bp.get("/lora-adapters")
async def lora_adapters() -> Response:
    """The --lora adapters by id, with their global scales (empty without --lora)."""
    return _json(server().lora.listing())


@bp.post("/lora-adapters")
async def set_lora_adapters() -> Response:
    """Set the global scales, as llama-server: adapters not listed drop to 0; only requests
    admitted afterwards use them (each request keeps the scales it was admitted with)."""
    table = server().lora
    table.set(table.parse(await read_json(), "lora"))
    return _json({"success": True})


@bp.route("/tools", methods=["GET", "POST"])
@bp.route("/cors-proxy", methods=["GET", "POST"])
async def disabled_feature() -> Response:
    """llama-server's web-UI helpers (MCP tools, a CORS proxy): never offered here."""
    raise FeatureDisabled(f"{request.path} is disabled on this server")

"""llama-server's native completion routes: `/completion`, `/completions` (no /v1), `/infill`.

The native shape, not OpenAI's: `content`, `stop`, `stop_type`, `stopping_word`,
`tokens_predicted`, `tokens_evaluated`, `tokens_cached`, `generation_settings`, `timings`.
A stream sends `data:` frames and ends with the full final object; there is no `[DONE]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs
from quart import Blueprint, Response

from mlxcel.http import logprobs, sse, structured_wire
from mlxcel.http.context import ServerContext, read_json, server
from mlxcel.http.errors import envelope
from mlxcel.http.openai import start_generation
from mlxcel.http.openai_wire import new_id, token_ids
from mlxcel.http.ops import NotSupported, request_settings
from mlxcel.http.sampling_wire import SamplingFields, sampling_params
from mlxcel.http.security import key_scope
from mlxcel.http.slot_wire import SlotFields, slot_options
from mlxcel.runtime.codec import structure
from mlxcel.runtime.errors import InvalidRequest, MlxcelError
from mlxcel.runtime.messages import (
    GenerationRequest,
    Prompt,
    TextPrompt,
    TokensPrompt,
)
from mlxcel.runtime.slot import OutputSlot, TokenLogprob

bp = Blueprint("native_completion", __name__)

FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
)


INT32_MAX = 2**31 - 1


@attrs.frozen(kw_only=True)
class NativeCompletionBody(SamplingFields, SlotFields):
    prompt: Any = ""
    # n_predict, else max_tokens, else max_completion_tokens (llama-server's order).
    n_predict: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: list[str] | None = None
    stream: bool | None = None
    # Usage is always in the final frame here; only its shape is checked.
    stream_options: Any = None
    # Every streamed frame carries the timings so far.
    timings_per_token: bool | None = None
    # The final object projected to these "a/b" paths, keyed by the whole path.
    response_fields: Any = None
    # Seconds between keep-alive comments on this stream (0: none); the server's by default.
    sse_ping_interval: float | None = None
    cache_prompt: bool | None = None
    ignore_eos: bool | None = None
    n_probs: int | None = None
    logprobs: int | None = None  # llama-server's alias of n_probs
    model: str | None = None
    json_schema: Any = None
    grammar: Any = None
    thinking_budget_tokens: Any = None
    reasoning_budget_tokens: Any = None
    thinking_token_budget: Any = None
    thinking_budget: Any = None
    # Arms /v1/chat/completions/control for this completion (its id: /slots `id_task`).
    reasoning_control: bool | None = None
    # llama-server fields accepted only at their defaults, which ask for nothing (_refuse).
    n_indent: Any = None
    n: Any = None
    n_cmpl: Any = None
    t_max_predict_ms: Any = None
    return_tokens: Any = None
    return_progress: Any = None
    verbose: Any = None


@attrs.frozen(kw_only=True)
class InfillBody(NativeCompletionBody):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[dict[str, str]] | None = None


def _prompt(value: Any, vocab: int) -> Prompt:
    """llama-server's one prompt: a string or token ids, either alone or as the only element
    of a list (one level: a deeper nesting is not a prompt)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return TextPrompt(text=value)
    if isinstance(value, list):
        return TokensPrompt(tokens=token_ids(value, vocab, "prompt"))
    raise InvalidRequest("prompt must be a string or a list of token ids", param="prompt")


def _n_predict(body: NativeCompletionBody) -> int | None:
    """The length asked for; None when the request names none (the server's --n-predict)."""
    for name in ("n_predict", "max_tokens", "max_completion_tokens"):
        value = getattr(body, name)
        if value is not None:
            if not -1 <= value <= INT32_MAX:
                raise InvalidRequest(f"{name} must be between -1 and {INT32_MAX}", param=name)
            return int(value)
    return None


def _refuse(body: NativeCompletionBody) -> None:
    """A 400 naming the first field that asks for what this route does not do."""
    if body.n_indent not in (None, 0):
        raise InvalidRequest("n_indent is not supported (only 0)", param="n_indent")
    for name in ("n", "n_cmpl"):
        if getattr(body, name) not in (None, 1):
            raise InvalidRequest(
                f"{name}: one completion per request on this route; "
                "/v1/completions and /v1/chat/completions take n",
                param=name,
            )
    if body.t_max_predict_ms not in (None, 0):
        raise InvalidRequest("t_max_predict_ms is not supported", param="t_max_predict_ms")
    for name in ("return_tokens", "return_progress", "verbose"):
        if getattr(body, name) not in (None, False):
            raise InvalidRequest(f"{name} is not supported", param=name)
    options = body.stream_options
    if isinstance(options, dict) and not isinstance(options.get("include_usage", False), bool):
        raise InvalidRequest(
            "stream_options.include_usage must be a boolean", param="stream_options.include_usage"
        )
    fields = body.response_fields
    if fields is not None and not (
        isinstance(fields, list) and all(isinstance(f, str) for f in fields)
    ):
        raise InvalidRequest("response_fields must be a list of strings", param="response_fields")
    if body.sse_ping_interval is not None and body.sse_ping_interval < 0:
        raise InvalidRequest("sse_ping_interval must be 0 or more", param="sse_ping_interval")


def _request(
    body: NativeCompletionBody, prompt: Prompt, n_predict: int | None
) -> GenerationRequest:
    _refuse(body)
    n_probs = body.n_probs if body.n_probs is not None else body.logprobs
    n_probs_param = "n_probs" if body.n_probs is not None else "logprobs"
    if n_probs is not None and not 0 <= n_probs <= 20:
        raise InvalidRequest(f"{n_probs_param} must be between 0 and 20", param=n_probs_param)
    ctx = server()
    return GenerationRequest(
        request_id=new_id("cmpl"),
        prompt=prompt,
        sampling=sampling_params(body, ctx.settings.sampling, len(ctx.info.tokenizer)),
        # llama-server: -1 means "until end of sequence or context"; 0 reads the prompt and,
        # as llama-server does, still emits one token.
        max_tokens=None if n_predict is None or n_predict < 0 else max(n_predict, 1),
        stop=tuple(body.stop or ()),
        ignore_eos=bool(body.ignore_eos),
        cache_key=None if body.cache_prompt is False else "",
        logprobs=n_probs if n_probs else None,
        constraint=structured_wire.native_constraint(body.json_schema, body.grammar),
        thinking_budget=structured_wire.thinking_budget(
            {f: getattr(body, f) for f in structured_wire.BUDGET_FIELDS},
            ctx.settings.reasoning_budget,
        ),
        reasoning_control=key_scope(ctx.settings) if body.reasoning_control else None,
        **slot_options(body),
    )


def _ms(a: float | None, b: float | None) -> float:
    return (b - a) * 1000.0 if a is not None and b is not None else 0.0


def _timings(slot: OutputSlot) -> dict[str, float]:
    prompt_n = slot.prompt_tokens - slot.cached_tokens
    prompt_ms = _ms(slot.started_at, slot.first_token_at)
    end = slot.finished_at if slot.finished_at is not None else time.monotonic()
    predicted_ms = _ms(slot.first_token_at, end)
    n = slot.completion_tokens
    return {
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


@attrs.frozen
class _Call:
    """One completion as asked: what its responses echo and how they are shaped."""

    body: NativeCompletionBody
    gen: GenerationRequest
    prompt_text: str
    # The length as generation_settings reports it (the server's --n-predict when unnamed).
    n_predict: int

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)


def final_object(ctx: ServerContext, call: _Call, slot: OutputSlot, text: str, finish: str) -> Any:
    stop_type = {"length": "limit"}.get(finish, "word" if slot.stop_word is not None else "eos")
    settings = request_settings(ctx, call.gen, n_predict=call.n_predict, stream=call.stream)
    # Key order as llama-server writes it.
    obj: dict[str, Any] = {
        "index": 0,
        "content": text,
        "tokens": [],
        "id_slot": slot.id_slot,
        "stop": True,
        "model": ctx.model_id,
        "tokens_predicted": slot.completion_tokens,
        "tokens_evaluated": slot.prompt_tokens,
        "generation_settings": {"n_ctx": ctx.info.context_length, **settings},
        "prompt": call.prompt_text,
        "has_new_line": "\n" in text,
        "truncated": slot.context_shifted,
        "stop_type": stop_type,
        "stopping_word": slot.stop_word or "",
        "tokens_cached": slot.cached_tokens,
        "timings": _timings(slot),
    }
    return obj


def _project(obj: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
    """llama-server's ``response_fields``: each "a/b" path found, keyed by the whole path."""
    if not fields:
        return obj
    out: dict[str, Any] = {}
    for path in fields:
        node: Any = obj
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out


def _prompt_text(prompt: Prompt) -> str:
    if isinstance(prompt, TextPrompt):
        return prompt.text
    tok = server().info.tokenizer
    return str(tok.decode(list(prompt.tokens))) if isinstance(prompt, TokensPrompt) else ""


async def _run(body: NativeCompletionBody, prompt: Prompt) -> Response:
    ctx = server()
    ctx.check_model(body.model)
    asked = _n_predict(body)
    gen = _request(body, prompt, asked)
    reported = asked if asked is not None else ctx.settings.n_predict
    call = _Call(body, gen, _prompt_text(prompt), reported)
    slot = await start_generation(ctx, call.gen)
    if body.stream:
        return _stream(ctx, call, slot)
    try:
        parts = []
        lps: list[TokenLogprob] = []
        while True:
            update = await slot.next()
            assert update is not None
            parts.append(update.text)
            lps.extend(update.logprobs)
            if update.finish_reason is not None:
                break
    finally:
        slot.cancel()
    obj = final_object(ctx, call, slot, "".join(parts), update.finish_reason)
    if call.gen.logprobs is not None:
        obj["completion_probabilities"] = logprobs.native(ctx.info.tokenizer, lps)
    obj = _project(obj, body.response_fields)
    return Response(json.dumps(obj, ensure_ascii=False), content_type="application/json")


def _stream(ctx: ServerContext, call: _Call, slot: OutputSlot) -> Response:
    ping = ctx.ping_interval
    if call.body.sse_ping_interval is not None:
        ping = call.body.sse_ping_interval or float("inf")

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                try:
                    update = await slot.next(timeout=ping)
                except MlxcelError as error:
                    yield sse.data(envelope(error, "native"))
                    return
                if update is None:
                    yield sse.KEEPALIVE
                    continue
                if update.text or update.logprobs:
                    frame: dict[str, Any] = {
                        "index": 0,
                        "content": update.text,
                        "tokens": [],
                        "stop": False,
                        "id_slot": slot.id_slot,
                        "tokens_predicted": slot.completion_tokens,
                        "tokens_evaluated": slot.prompt_tokens,
                    }
                    if call.body.timings_per_token:
                        frame["timings"] = _timings(slot)
                    if update.logprobs:
                        frame["completion_probabilities"] = logprobs.native(
                            ctx.info.tokenizer, update.logprobs
                        )
                    yield sse.data(frame)
                if update.finish_reason is not None:
                    final = final_object(ctx, call, slot, "", update.finish_reason)
                    yield sse.data(_project(final, call.body.response_fields))
                    return
        finally:
            slot.cancel()

    return sse.response(body(), slot.cancel)


@bp.post("/completion")
@bp.post("/completions")
async def completion() -> Response:
    body = structure(await read_json(), NativeCompletionBody)
    return await _run(body, _prompt(body.prompt, len(server().info.tokenizer)))


@bp.post("/infill")
async def infill() -> Response:
    body = structure(await read_json(), InfillBody)
    tok = server().info.tokenizer
    vocab = tok.get_vocab()
    fim = next((names for names in FIM_TOKENS if all(n in vocab for n in names)), None)
    if fim is None:
        raise NotSupported(
            "This model has no fill-in-the-middle tokens, so /infill is not supported."
        )
    pre, suf, mid = (vocab[n] for n in fim)
    extra = "".join(f"{e.get('filename', '')}\n{e.get('text', '')}" for e in body.input_extra or [])
    ids = [pre, *tok.encode(extra + body.input_prefix, add_special_tokens=False), suf]
    ids += [*tok.encode(body.input_suffix, add_special_tokens=False), mid]
    prompt_text = body.prompt if isinstance(body.prompt, str) else ""
    ids += tok.encode(prompt_text, add_special_tokens=False)
    return await _run(body, TokensPrompt(tokens=tuple(ids)))

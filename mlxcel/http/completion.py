"""llama-server's native completion routes: `/completion`, `/completions` (no /v1), `/infill`.

The native shape, not OpenAI's: `content`, `stop`, `stop_type`, `stopping_word`,
`tokens_predicted`, `tokens_evaluated`, `tokens_cached`, `generation_settings`, `timings`.
A stream sends `data:` frames and ends with the full final object; there is no `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
from quart import Blueprint, Response

from mlxcel.http import logprobs, sse, structured_wire
from mlxcel.http.context import ServerContext, server
from mlxcel.http.errors import envelope
from mlxcel.http.openai import read_json, start_generation
from mlxcel.http.openai_wire import new_id
from mlxcel.http.ops import NotSupported, generation_defaults
from mlxcel.http.sampling_wire import SamplingFields, sampling_params
from mlxcel.http.security import key_scope
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


@attrs.frozen(kw_only=True)
class NativeCompletionBody(SamplingFields):
    prompt: Any = ""
    n_predict: int | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    stream: bool | None = None
    cache_prompt: bool | None = None
    ignore_eos: bool | None = None
    return_tokens: bool | None = None
    n_probs: int | None = None
    id_slot: int | None = None
    model: str | None = None
    json_schema: Any = None
    grammar: Any = None
    thinking_budget_tokens: Any = None
    reasoning_budget_tokens: Any = None
    thinking_token_budget: Any = None
    thinking_budget: Any = None
    # Arms /v1/chat/completions/control for this completion (its id: /slots `id_task`).
    reasoning_control: bool | None = None


@attrs.frozen(kw_only=True)
class InfillBody(NativeCompletionBody):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[dict[str, str]] | None = None


def _prompt(value: Any) -> Prompt:
    if isinstance(value, str):
        return TextPrompt(text=value)
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return TokensPrompt(tokens=tuple(value))
    if isinstance(value, list) and len(value) == 1:
        return _prompt(value[0])
    raise InvalidRequest("prompt must be a string or a list of token ids", param="prompt")


def _request(body: NativeCompletionBody, prompt: Prompt) -> GenerationRequest:
    if body.n_probs is not None and not 0 <= body.n_probs <= 20:
        raise InvalidRequest("n_probs must be between 0 and 20", param="n_probs")
    if body.id_slot not in (None, -1):
        raise InvalidRequest("choosing a slot is not supported; use id_slot -1", param="id_slot")
    ctx = server()
    n_predict = body.n_predict if body.n_predict is not None else body.max_tokens
    return GenerationRequest(
        request_id=new_id("cmpl"),
        prompt=prompt,
        sampling=sampling_params(body, ctx.settings.sampling, len(ctx.info.tokenizer)),
        # llama-server: n_predict -1 means "until end of sequence or context".
        max_tokens=None if n_predict is None or n_predict < 0 else n_predict,
        stop=tuple(body.stop or ()),
        ignore_eos=bool(body.ignore_eos),
        cache_key=None if body.cache_prompt is False else "",
        logprobs=body.n_probs if body.n_probs else None,
        constraint=structured_wire.native_constraint(body.json_schema, body.grammar),
        thinking_budget=structured_wire.thinking_budget(
            {f: getattr(body, f) for f in structured_wire.BUDGET_FIELDS},
            ctx.settings.reasoning_budget,
        ),
        reasoning_control=key_scope(ctx.settings) if body.reasoning_control else None,
    )


def _ms(a: float | None, b: float | None) -> float:
    return (b - a) * 1000.0 if a is not None and b is not None else 0.0


def final_object(ctx: ServerContext, slot: OutputSlot, text: str, finish: str) -> dict[str, Any]:
    prompt_n = slot.prompt_tokens - slot.cached_tokens
    prompt_ms = _ms(slot.started_at, slot.first_token_at)
    predicted_ms = _ms(slot.first_token_at, slot.finished_at)
    n = slot.completion_tokens
    stop_type = {"length": "limit"}.get(finish, "word" if slot.stop_word is not None else "eos")
    return {
        "index": 0,
        "content": text,
        "tokens": [],
        "id_slot": -1,
        "stop": True,
        "model": ctx.model_id,
        "tokens_predicted": n,
        "tokens_evaluated": slot.prompt_tokens,
        "tokens_cached": slot.cached_tokens,
        "generation_settings": {"n_ctx": ctx.info.context_length, **generation_defaults(ctx)},
        "has_new_line": "\n" in text,
        "truncated": False,
        "stop_type": stop_type,
        "stopping_word": slot.stop_word or "",
        "timings": {
            "cache_n": slot.cached_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n * 1000.0 / prompt_ms if prompt_ms else 0.0,
            "predicted_n": n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n if n else 0.0,
            "predicted_per_second": n * 1000.0 / predicted_ms if predicted_ms else 0.0,
        },
    }


async def _run(body: NativeCompletionBody, prompt: Prompt) -> Response:
    ctx = server()
    ctx.check_model(body.model)
    gen = _request(body, prompt)
    slot = await start_generation(ctx, gen)
    if body.stream:
        return _stream(ctx, slot)
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
    obj = final_object(ctx, slot, "".join(parts), update.finish_reason)
    if gen.logprobs is not None:
        obj["completion_probabilities"] = logprobs.native(ctx.info.tokenizer, lps)
    return Response(json.dumps(obj, ensure_ascii=False), content_type="application/json")


def _stream(ctx: ServerContext, slot: OutputSlot) -> Response:
    ping = ctx.ping_interval

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
                    frame = {
                        "index": 0,
                        "content": update.text,
                        "tokens": [],
                        "stop": False,
                        "id_slot": -1,
                        "tokens_predicted": slot.completion_tokens,
                        "tokens_evaluated": slot.prompt_tokens,
                    }
                    if update.logprobs:
                        frame["completion_probabilities"] = logprobs.native(
                            ctx.info.tokenizer, update.logprobs
                        )
                    yield sse.data(frame)
                if update.finish_reason is not None:
                    yield sse.data(final_object(ctx, slot, "", update.finish_reason))
                    return
        finally:
            slot.cancel()

    return sse.response(body(), slot.cancel)


@bp.post("/completion")
@bp.post("/completions")
async def completion() -> Response:
    body = structure(await read_json(), NativeCompletionBody)
    return await _run(body, _prompt(body.prompt))


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

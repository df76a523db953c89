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

from mlxcel.http import heard, logprobs, sse, structured_wire
from mlxcel.http.context import Model, ServerContext, read_json, require_chat, server
from mlxcel.http.errors import envelope
from mlxcel.http.openai import start_generation, timings
from mlxcel.http.openai_wire import new_id, token_ids
from mlxcel.http.ops import NotSupported, request_settings
from mlxcel.http.prompt_forms import encode_mixed, is_int, is_mixed
from mlxcel.http.sampling_wire import SamplingFields, sampling_params
from mlxcel.http.security import key_scope
from mlxcel.http.slot_wire import SlotFields, slot_options
from mlxcel.runtime.codec import structure
from mlxcel.runtime.errors import InvalidRequest, MlxcelError
from mlxcel.runtime.messages import (
    AudioRef,
    GenerationRequest,
    ImageRef,
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
    verbose: Any = None
    # The generated ids in the final object (a stream's frames always carry theirs).
    return_tokens: Any = None
    # A stream's first frame carries `prompt_progress`.
    return_progress: Any = None
    # Probabilities (`prob`, `top_probs`) instead of log-probabilities in n_probs output.
    post_sampling_probs: Any = None


@attrs.frozen(kw_only=True)
class InfillBody(NativeCompletionBody):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Any = None


def _input_extra(value: Any) -> list[tuple[str, str]]:
    """llama-server's `input_extra`: a list of {"text": string, "filename"?: string}."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(
            'input_extra must be an array of {"filename": string, "text": string}',
            param="input_extra",
        )
    out = []
    for i, chunk in enumerate(value):
        at = f"input_extra[{i}]"
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise InvalidRequest(f'{at} must contain a "text" field with a string value', param=at)
        name = chunk.get("filename", "")
        if not isinstance(name, str):
            raise InvalidRequest(f"{at}.filename must be a string", param=at)
        out.append((name, chunk["text"]))
    return out


# Prompts in one request (each is a generation of its own, run side by side).
MAX_PROMPTS = 64


# A prompt and the images (and audio) its media markers stand for.
Prompted = tuple[Prompt, tuple[ImageRef | AudioRef, ...]]
# llama.cpp's default media marker (mtmd): one per image in a prompt string.
MEDIA_MARKER = "<__media__>"


def _prompts(value: Any, tok: Any, media: Any = None, hears: bool = False) -> list[Prompted]:
    """llama-server's prompt forms: one prompt (a string, token ids, or ids mixed with
    strings, or ``{prompt_string, multimodal_data}``), or a list of such prompts, one result
    each. ``media``: a vision model's processor (None: images are refused); ``hears``: it
    takes audio (a model that hears audio itself, without --no-audio-input)."""
    if isinstance(value, list) and value and not all(is_int(v) for v in value):
        if not is_mixed(value):
            if len(value) > MAX_PROMPTS:
                raise InvalidRequest(f"prompt takes at most {MAX_PROMPTS} prompts", param="prompt")
            return [_one_prompt(v, tok, f"prompt[{i}]", media, hears) for i, v in enumerate(value)]
    return [_one_prompt(value, tok, "prompt", media, hears)]


def _multimodal(value: dict[str, Any], where: str, media: Any, hears: bool) -> Prompted:
    """``{prompt_string, multimodal_data}``: each ``<__media__>`` in the string is one entry
    of ``multimodal_data`` (base64), in order, as in llama-server: audio (told by its file's
    first bytes: wav, mp3, flac, ogg) on a model that hears audio itself, else an image; the
    marker becomes what the model's chat template writes for one."""
    text, data = value.get("prompt_string"), value.get("multimodal_data")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.prompt_string must be a string", param="prompt")
    if media is None:
        raise InvalidRequest(
            f"{where}.multimodal_data: image input is not supported", param="prompt"
        )
    if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        raise InvalidRequest(
            f"{where}.multimodal_data must be a list of base64 strings", param="prompt"
        )
    if text.count(MEDIA_MARKER) != len(data):
        raise InvalidRequest(
            f"{where}: {len(data)} multimodal_data entries but {text.count(MEDIA_MARKER)} "
            f"{MEDIA_MARKER} markers in prompt_string: each image needs its marker",
            param="prompt",
        )
    refs: list[ImageRef | AudioRef] = []
    markers = []
    for i, d in enumerate(data):
        at = f"{where}.multimodal_data[{i}]"
        kind = heard.sniff_audio(d)
        if kind is not None and not hears:
            raise InvalidRequest(f"{at}: audio input is not supported", param="prompt")
        if kind is not None:
            refs.append(AudioRef(at, d, kind, ""))
            markers.append(media.audio_marker)
        else:
            refs.append(ImageRef(at, f"data:application/octet-stream;base64,{d}"))
            markers.append(media.image_marker)
    pieces = text.split(MEDIA_MARKER)
    joined = pieces[0] + "".join(m + p for m, p in zip(markers, pieces[1:], strict=True))
    return TextPrompt(text=joined), tuple(refs)


def _one_prompt(
    value: Any, tok: Any, where: str, media: Any = None, hears: bool = False
) -> Prompted:
    if isinstance(value, dict):
        if value.get("multimodal_data"):
            return _multimodal(value, where, media, hears)
        value = value.get("prompt_string")
        if not isinstance(value, str):
            raise InvalidRequest(f"{where}.prompt_string must be a string", param="prompt")
    if isinstance(value, str):
        return TextPrompt(text=value), ()
    if isinstance(value, list):
        ids = encode_mixed(value, tok) if is_mixed(value) else value
        return TokensPrompt(tokens=token_ids(ids, len(tok), "prompt")), ()
    raise InvalidRequest(
        f"{where} must be a string or a list of token ids (strings may be mixed in)",
        param="prompt",
    )


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
    if body.verbose not in (None, False):
        raise InvalidRequest("verbose is not supported", param="verbose")
    for name in ("return_tokens", "return_progress", "post_sampling_probs"):
        if not isinstance(getattr(body, name), (bool, type(None))):
            raise InvalidRequest(f"{name} must be a boolean", param=name)
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
    model: Model, body: NativeCompletionBody, prompt: Prompt, n_predict: int | None
) -> GenerationRequest:
    _refuse(body)
    n_probs = body.n_probs if body.n_probs is not None else body.logprobs
    n_probs_param = "n_probs" if body.n_probs is not None else "logprobs"
    if n_probs is not None and not 0 <= n_probs <= 20:
        raise InvalidRequest(f"{n_probs_param} must be between 0 and 20", param=n_probs_param)
    ctx = server()
    gen = GenerationRequest(
        request_id=new_id("cmpl"),
        prompt=prompt,
        sampling=sampling_params(
            body, ctx.settings.sampling, len(model.info.tokenizer), model.info.tokenizer
        ),
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
    # The global adapter scales now, as admission would take them a moment later: the final
    # object's generation_settings shows what the request ran with, whatever is POSTed since.
    return gen if gen.lora is not None else attrs.evolve(gen, lora=ctx.lora.current())


@attrs.frozen
class _Call:
    """One completion as asked: what its responses echo and how they are shaped."""

    model: Model
    body: NativeCompletionBody
    gen: GenerationRequest
    prompt_text: str
    # The length as generation_settings reports it (the server's --n-predict when unnamed).
    n_predict: int

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)


def final_object(
    ctx: ServerContext,
    call: _Call,
    slot: OutputSlot,
    text: str,
    finish: str,
    *,
    index: int = 0,
    tokens: list[int] | None = None,
) -> Any:
    stop_type = {"length": "limit"}.get(finish, "word" if slot.stop_word is not None else "eos")
    settings = request_settings(ctx, call.gen, n_predict=call.n_predict, stream=call.stream)
    # Key order as llama-server writes it.
    obj: dict[str, Any] = {
        "index": index,
        "content": text,
        "tokens": tokens or [],
        "id_slot": slot.id_slot,
        "stop": True,
        "model": call.model.name,
        "tokens_predicted": slot.completion_tokens,
        "tokens_evaluated": slot.prompt_tokens,
        "generation_settings": {"n_ctx": call.model.info.context_length, **settings},
        "prompt": call.prompt_text,
        "has_new_line": "\n" in text,
        # Generation stopped because the context was full (llama-server's meaning), or the
        # context shifted under it (--context-shift).
        "truncated": slot.context_shifted
        or (
            finish == "length"
            and slot.prompt_tokens + slot.completion_tokens >= call.model.info.context_length
        ),
        "stop_type": stop_type,
        "stopping_word": slot.stop_word or "",
        "tokens_cached": slot.cached_tokens,
        "timings": timings(slot),
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


def _prompt_text(model: Model, prompt: Prompt) -> str:
    if isinstance(prompt, TextPrompt):
        return prompt.text
    tok = model.info.tokenizer
    return str(tok.decode(list(prompt.tokens))) if isinstance(prompt, TokensPrompt) else ""


async def _run(model: Model, body: NativeCompletionBody, prompts: list[Prompted]) -> Response:
    ctx = server()
    asked = _n_predict(body)
    cap = ctx.settings.n_predict
    reported = cap if asked is None or asked < 0 else min(asked, cap) if cap > 0 else asked
    calls = [
        _Call(
            model,
            body,
            attrs.evolve(
                _request(model, body, p, asked),
                images=tuple(r for r in media if isinstance(r, ImageRef)),
                audio=tuple(r for r in media if isinstance(r, AudioRef)),
            ),
            _prompt_text(model, p),
            reported,
        )
        for p, media in prompts
    ]
    # Each prompt is its own generation, all submitted before any is read (a slot keeps its
    # output until read); results come in prompt order, each with its index.
    slots: list[OutputSlot] = []
    try:
        for call in calls:
            progress = bool(call.body.stream and call.body.return_progress)
            slots.append(await start_generation(ctx, model, call.gen, progress=progress))
    except BaseException:
        for slot in slots:
            slot.cancel()
        raise
    runs = list(zip(calls, slots, strict=True))
    if body.stream:
        return _stream(ctx, runs)
    try:
        results = [await _collect(ctx, call, slot, i) for i, (call, slot) in enumerate(runs)]
    finally:
        for slot in slots:
            slot.cancel()
    return _json(results[0] if len(results) == 1 else results)


async def _collect(ctx: ServerContext, call: _Call, slot: OutputSlot, index: int) -> Any:
    """One prompt's final object. Cancellation: the slot is cancelled (the work aborted)."""
    try:
        parts = []
        lps: list[TokenLogprob] = []
        ids: list[int] = []
        while True:
            update = await slot.next()
            assert update is not None
            parts.append(update.text)
            lps.extend(update.logprobs)
            ids.extend(update.token_ids)
            if update.finish_reason is not None:
                break
    finally:
        slot.cancel()
    tokens = ids if call.body.return_tokens else None
    obj = final_object(
        ctx, call, slot, "".join(parts), update.finish_reason, index=index, tokens=tokens
    )
    if call.gen.logprobs is not None:
        obj["completion_probabilities"] = _probs(ctx, call, lps)
    return _project(obj, call.body.response_fields)


def _probs(ctx: ServerContext, call: _Call, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    scored = logprobs.native(call.model.info.tokenizer, lps)
    if not call.body.post_sampling_probs:
        return scored
    return logprobs.as_probs(scored, greedy=call.gen.sampling.temperature == 0)


def _json(obj: Any) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), content_type="application/json")


def _stream(ctx: ServerContext, runs: list[tuple[_Call, OutputSlot]]) -> Response:
    """Every prompt's frames in turn, each ending with its final object (llama-server tags
    them with the prompt's index); the others keep generating meanwhile."""
    body0 = runs[0][0].body
    ping = ctx.ping_interval
    if body0.sse_ping_interval is not None:
        ping = body0.sse_ping_interval or float("inf")

    def cancel() -> None:
        for _, slot in runs:
            slot.cancel()

    async def body() -> AsyncIterator[bytes]:
        try:
            for index, (call, slot) in enumerate(runs):
                while True:
                    try:
                        update = await slot.next(timeout=ping)
                    except MlxcelError as error:
                        yield sse.data(envelope(error, "native"))
                        return
                    for report in slot.take_progress():
                        # llama-server's progress frame: no text, the report, as it reads.
                        yield sse.data(
                            {
                                "index": index,
                                "content": "",
                                "tokens": [],
                                "stop": False,
                                "id_slot": slot.id_slot,
                                "tokens_predicted": slot.completion_tokens,
                                "tokens_evaluated": slot.prompt_tokens,
                                "prompt_progress": report,
                            }
                        )
                    if update is None:
                        yield sse.KEEPALIVE
                        continue
                    if update.text or update.logprobs or update.token_ids:
                        frame: dict[str, Any] = {
                            "index": index,
                            "content": update.text,
                            "tokens": list(update.token_ids),
                            "stop": False,
                            "id_slot": slot.id_slot,
                            "tokens_predicted": slot.completion_tokens,
                            "tokens_evaluated": slot.prompt_tokens,
                        }
                        if call.body.timings_per_token:
                            frame["timings"] = timings(slot)
                        if update.logprobs:
                            frame["completion_probabilities"] = _probs(
                                ctx, call, list(update.logprobs)
                            )
                        yield sse.data(frame)
                    if update.finish_reason is not None:
                        final = final_object(ctx, call, slot, "", update.finish_reason, index=index)
                        yield sse.data(_project(final, call.body.response_fields))
                        break
        finally:
            cancel()

    return sse.response(body(), cancel)


@bp.post("/completion")
@bp.post("/completions")
async def completion() -> Response:
    raw = await read_json()
    body = structure(raw, NativeCompletionBody)
    ctx = server()
    model = await ctx.model(raw)
    require_chat(model)
    info = model.info
    _, hears = heard.hearing(ctx.stt, ctx.settings.audio_input, info.media)
    return await _run(model, body, _prompts(body.prompt, info.tokenizer, info.media, hears))


@bp.post("/infill")
async def infill() -> Response:
    raw = await read_json()
    body = structure(raw, InfillBody)
    # The request is checked before the model: a malformed one is a 400 on any model.
    extra_chunks = _input_extra(body.input_extra)
    model = await server().model(raw)
    require_chat(model)
    tok = model.info.tokenizer
    vocab = tok.get_vocab()
    fim = next((names for names in FIM_TOKENS if all(n in vocab for n in names)), None)
    if fim is None:
        raise NotSupported(
            "This model has no fill-in-the-middle tokens, so /infill is not supported."
        )
    pre, suf, mid = (vocab[n] for n in fim)
    extra = "".join(f"{name}\n{text}" for name, text in extra_chunks)
    ids = [pre, *tok.encode(extra + body.input_prefix, add_special_tokens=False), suf]
    ids += [*tok.encode(body.input_suffix, add_special_tokens=False), mid]
    prompt_text = body.prompt if isinstance(body.prompt, str) else ""
    ids += tok.encode(prompt_text, add_special_tokens=False)
    return await _run(model, body, [(TokensPrompt(tokens=tuple(ids)), ())])

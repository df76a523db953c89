"""OpenAI request bodies (wire types) and their conversion into GenerationRequest."""

from __future__ import annotations

import json
import uuid
from typing import Any

import attrs

from mlxcel.http import structured_wire
from mlxcel.http.sampling_wire import SamplingFields, sampling_params
from mlxcel.http.slot_wire import SlotFields, slot_options
from mlxcel.runtime import json_input
from mlxcel.runtime.codec import structure
from mlxcel.runtime.errors import InvalidRequest, UnsupportedField
from mlxcel.runtime.messages import (
    AudioRef,
    ChatPrompt,
    ForcedToolCall,
    GenerationRequest,
    ImageRef,
    LoopLimit,
    Prompt,
    SamplingParams,
    TextPrompt,
)

ROLES = {"system", "user", "assistant", "tool", "developer"}
# Message keys passed on to the chat template as they are.
MESSAGE_KEYS = {
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "reasoning_content",
    "reasoning",
}
# Keys the official SDKs echo back from earlier responses; harmless when null.
NULLABLE_ECHO_KEYS = {"refusal", "annotations", "audio", "function_call"}
MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "video_url": "video", "file": "file"}


@attrs.frozen(kw_only=True)
class StreamOptions:
    include_usage: bool | None = None


@attrs.frozen(kw_only=True)
class ChatCompletionBody(SamplingFields, SlotFields):
    messages: Any
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n_predict: int | None = None
    stop: Any = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    cache_prompt: bool | None = None
    prompt_cache_key: str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: Any = None
    response_format: Any = None
    # llama-server's own constraints on chat: a JSON schema object, or a GBNF grammar.
    json_schema: Any = None
    grammar: Any = None
    # llama-server's stream extras: timings on every chunk, token ids (return_tokens), and
    # prompt progress; post_sampling_probs reports probabilities instead of logprobs.
    timings_per_token: bool | None = None
    return_tokens: bool | None = None
    return_progress: bool | None = None
    post_sampling_probs: bool | None = None
    # vLLM's n-gram loop breaker (loop_limit).
    max_pattern_size: int | None = None
    min_pattern_size: int | None = None
    min_count: int | None = None
    thinking_budget_tokens: Any = None
    reasoning_budget_tokens: Any = None
    thinking_token_budget: Any = None
    thinking_budget: Any = None
    # Arms /v1/chat/completions/control for this completion (llama-server b10621).
    reasoning_control: bool | None = None
    # OpenAI fields the SDKs and agent frameworks send at values that ask for nothing here;
    # any other value is a 400 naming the field (_check_openai_extras).
    store: bool | None = None
    metadata: Any = None
    modalities: Any = None
    service_tier: str | None = None
    verbosity: str | None = None
    safety_identifier: str | None = None


@attrs.frozen(kw_only=True)
class CompletionBody(SamplingFields, SlotFields):
    prompt: Any
    model: str | None = None
    max_tokens: int | None = None
    n_predict: int | None = None
    stop: Any = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    cache_prompt: bool | None = None
    prompt_cache_key: str | None = None
    logprobs: int | None = None
    response_format: Any = None
    # vLLM's n-gram loop breaker (loop_limit).
    max_pattern_size: int | None = None
    min_pattern_size: int | None = None
    min_count: int | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise InvalidRequest("stop must be a string or a list of strings", param="stop")


def token_ids(value: Any, vocab: int, param: str) -> tuple[int, ...]:
    """A list of token ids, each in [0, vocab): a 400 naming ``param`` before any work, so an
    id no tokenizer or embedding row has never reaches one."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise InvalidRequest(f"{param} must be a list of token ids (integers)", param=param)
    if any(not 0 <= t < vocab for t in value):
        raise InvalidRequest(f"{param}: token ids must be in [0, {vocab})", param=param)
    return tuple(value)


MAX_METADATA = 16


def check_metadata(value: Any) -> None:
    """OpenAI's metadata: at most 16 string pairs (chat, Responses, Conversations)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise InvalidRequest("metadata must be an object", param="metadata")
    if len(value) > MAX_METADATA:
        raise InvalidRequest(f"metadata takes at most {MAX_METADATA} entries", param="metadata")
    for key, val in value.items():
        if len(key) > 64 or not isinstance(val, str) or len(val) > 512:
            raise InvalidRequest(
                "metadata keys are at most 64 characters and values strings of at most 512",
                param="metadata",
            )


def _check_openai_extras(body: ChatCompletionBody) -> None:
    """Accept what asks for nothing we do not do: ``store: false`` (chat completions are
    never stored here), text-only ``modalities``, ``metadata`` (it only labels a stored
    completion, so without storage it changes nothing, as at OpenAI), the default service
    tier and verbosity."""
    if body.store:
        raise InvalidRequest(
            "store: chat completions are not stored on this server; /v1/responses stores responses",
            param="store",
        )
    if body.modalities is not None and body.modalities != ["text"]:
        raise InvalidRequest('modalities: only ["text"] is served', param="modalities")
    check_metadata(body.metadata)
    if body.service_tier not in (None, "auto", "default"):
        raise InvalidRequest(
            f"service_tier {body.service_tier!r} is not offered; use auto or default "
            "(X-Priority sets a request's priority here)",
            param="service_tier",
        )
    if body.verbosity not in (None, "medium"):
        raise InvalidRequest(
            "verbosity other than medium is not supported (ask for brevity in the prompt)",
            param="verbosity",
        )


# OpenAI's own bound; the server's --parallel (rows in the batch) caps it further.
MAX_N = 128


def _n(value: int | None) -> int:
    if value is None:
        return 1
    if not 1 <= value <= MAX_N:
        raise InvalidRequest(f"n must be between 1 and {MAX_N}", param="n")
    return value


def cache_key(body: ChatCompletionBody | CompletionBody) -> str | None:
    """The prompt-cache tenant: `prompt_cache_key`, else `user`; None opts out."""
    if body.cache_prompt is False:
        return None
    return body.prompt_cache_key or body.user or ""


@attrs.define
class Media:
    """What a chat request's parts may carry, and what they carried: images for a vision
    model (None: refused), audio for a server that transcribes it (None: refused)."""

    images: list[ImageRef] | None = None
    audio: list[AudioRef] | None = None
    # The model hears audio itself: an audio part stays a part ({"type": "audio"}) where the
    # template puts the model's audio marker, instead of its transcript's placeholder.
    native_audio: bool = False


def _audio_part(part: dict[str, Any], at: str, audio: list[AudioRef]) -> str:
    """An ``input_audio`` part: its reference, and the placeholder its transcript replaces."""
    value = part.get("input_audio")
    data = value.get("data") if isinstance(value, dict) else None
    fmt = value.get("format", "wav") if isinstance(value, dict) else None
    if not isinstance(data, str) or not data:
        raise InvalidRequest(f"{at}.input_audio.data must be base64 audio", param=at)
    if fmt not in ("wav", "mp3", "flac", "ogg", "webm", "m4a"):
        raise InvalidRequest(
            f"{at}.input_audio.format must be wav, mp3, flac, ogg, webm or m4a", param=at
        )
    placeholder = f"\ue000audio{len(audio)}\ue000"
    audio.append(AudioRef(at, data, fmt, placeholder))
    return placeholder


def _content(
    content: Any, where: str, media: Media | None = None
) -> str | list[dict[str, str]] | None:
    """The message's text. With ``media.images`` (a vision model; None refuses image parts
    before anything is read) a message with images becomes the parts a VLM chat template
    renders, text and ``{"type": "image"}`` in order, each image's reference added to the
    list; with ``media.audio`` an audio part becomes its transcript's placeholder."""
    media = media or Media()
    images = media.images
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{where} must be a string, a list of content parts, or null", param=where
        )
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise InvalidRequest(f"{at}.type must be a string", param=f"{at}.type")
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and images is not None:
            images.append(ImageRef(at, _image_url(part, at)))
            parts.append({"type": "image"})
        elif kind == "input_audio" and media.audio is not None:
            placeholder = _audio_part(part, at, media.audio)
            parts.append(
                {"type": "audio"} if media.native_audio else {"type": "text", "text": placeholder}
            )
        elif kind in MEDIA_PARTS:
            raise InvalidRequest(f"{MEDIA_PARTS[kind]} input is not supported", param=at)
        else:
            raise InvalidRequest(f"{at} must be a content part with type 'text'", param=at)
    if any(p["type"] in ("image", "audio") for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _image_url(part: dict[str, Any], at: str) -> str:
    """``image_url`` is ``{"url": ..., "detail": ...}`` (OpenAI) or a bare string (some
    clients); ``detail`` is a hint every model here reads at its own resolution."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{at}.image_url.url must be a non-empty string", param=at)
    if isinstance(value, dict):
        unknown = set(value) - {"url", "detail"}
        if unknown:
            raise UnsupportedField(f"{at}.image_url.{sorted(unknown)[0]}")
        if value.get("detail") not in (None, "auto", "low", "high"):
            raise InvalidRequest(f"{at}.image_url.detail must be auto, low or high", param=at)
    return url


def _template_call(call: Any, at: str) -> Any:
    """OpenAI sends arguments as a JSON string; chat templates expect the object."""
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        fn = dict(call["function"])
        if isinstance(fn.get("arguments"), str):
            where = f"{at}.function.arguments"
            text = fn["arguments"] if fn["arguments"].strip() else "{}"
            # A call whose arguments are not JSON cannot be rendered as the call it was (and
            # llama-server refuses it too): a 400 naming the message, not a silent string.
            try:
                json.loads(text)
            except RecursionError:
                pass  # loads_or_text reports the depth
            except ValueError:
                raise InvalidRequest(f"{where} is not valid JSON", param=where) from None
            fn["arguments"] = json_input.loads_or_text(text, where=where)
        return {**call, "function": fn}
    return call


def _messages(value: Any, media: Media | None = None) -> tuple[dict[str, object], ...]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequest(f"{at}.role must be one of {sorted(ROLES)}", param=f"{at}.role")
        for key, val in msg.items():
            if key not in MESSAGE_KEYS and not (key in NULLABLE_ECHO_KEYS and not val):
                raise UnsupportedField(f"{at}.{key}")
        rendered: dict[str, object] = {k: v for k, v in msg.items() if k in MESSAGE_KEYS}
        if isinstance(msg.get("tool_calls"), list):
            rendered["tool_calls"] = [
                _template_call(c, f"{at}.tool_calls[{j}]") for j, c in enumerate(msg["tool_calls"])
            ]
        rendered["role"] = "system" if role == "developer" else role
        rendered["content"] = _content(msg.get("content"), f"{at}.content", media) or ""
        out.append(rendered)
    if len(out) >= 2 and out[-1]["role"] == out[-2]["role"] == "assistant":
        # One trailing assistant message is a prefill to continue; two are no conversation.
        at = f"messages[{len(out) - 1}]"
        raise InvalidRequest(
            f"{at}: cannot have 2 or more assistant messages at the end of the list",
            param=at,
        )
    if not any(str(m["content"]).strip() or m.get("tool_calls") for m in out):
        raise InvalidRequest(
            "Request must include at least one non-empty message content or media input.",
            param="messages",
        )
    return tuple(out)


# Requests parsed outside a server (tests, tools) start from mlx-lm-like plain sampling.
PLAIN_SAMPLING = SamplingParams()


def flatten_extra_body(data: Any) -> Any:
    """An ``extra_body`` object sent as a JSON key (clients that pass the SDK's argument
    through verbatim) is read as if its fields were top-level, as llama-server and vLLM do; a
    field given both ways takes the top-level value."""
    if not isinstance(data, dict) or "extra_body" not in data:
        return data
    extra = data["extra_body"]
    if not isinstance(extra, dict):
        raise InvalidRequest("extra_body must be an object", param="extra_body")
    rest = {k: v for k, v in data.items() if k != "extra_body"}
    return {**extra, **rest}


# Bounds that keep the per-token check cheap (it runs on the streamer's event loop).
MAX_PATTERN = 256
MAX_REPEATS = 64


def loop_limit(body: Any) -> LoopLimit | None:
    """vLLM's repetition detection fields: off unless max_pattern_size > 0, which needs a
    min_count of at least 2; min_pattern_size 0 means 1."""
    top = body.max_pattern_size or 0
    low = body.min_pattern_size or 0
    count = body.min_count or 0
    if not 0 <= top <= MAX_PATTERN:
        raise InvalidRequest(
            f"max_pattern_size must be between 0 (off) and {MAX_PATTERN}", param="max_pattern_size"
        )
    if top == 0:
        if low or count:
            field = "min_pattern_size" if low else "min_count"
            raise InvalidRequest(f"{field} needs max_pattern_size", param=field)
        return None
    if not 2 <= count <= MAX_REPEATS:
        raise InvalidRequest(
            f"min_count must be between 2 and {MAX_REPEATS} with max_pattern_size",
            param="min_count",
        )
    if not 0 <= low <= top:
        raise InvalidRequest(
            "min_pattern_size must be between 0 and max_pattern_size", param="min_pattern_size"
        )
    return LoopLimit(min_size=max(low, 1), max_size=top, min_count=count)


def _check_stream_options(body: Any) -> None:
    # OpenAI's own rule: the options shape a stream, so without one they ask for nothing.
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest(
            "stream_options is only allowed when stream is true", param="stream_options"
        )


def _length(body: Any, names: tuple[str, ...]) -> int | None:
    """The first of these length fields given; -1 is llama.cpp's "until end of sequence or
    context" (None), another negative a 400 naming the field."""
    for name in names:
        value = getattr(body, name)
        if value is not None:
            if value < -1:
                raise InvalidRequest(f"{name} must be at least 1, or -1 for no limit", param=name)
            return None if value == -1 else int(value)
    return None


def chat_request(
    data: Any,
    defaults: SamplingParams = PLAIN_SAMPLING,
    vocab_size: int | None = None,
    reasoning_budget: int = -1,
    tokenizer: Any = None,
    vision: bool = False,
    hears: bool = False,
    native_audio: bool = False,
) -> tuple[ChatCompletionBody, GenerationRequest]:
    """``vision``: the model takes images (else an image part is refused, before any URL is
    read: the contract's media guard); ``hears``: audio parts are taken (else refused),
    heard by the model itself with ``native_audio``, else transcribed into the prompt."""
    body = structure(flatten_extra_body(data), ChatCompletionBody)
    media = Media(
        images=[] if vision else None, audio=[] if hears else None, native_audio=native_audio
    )
    _check_openai_extras(body)
    _check_stream_options(body)
    max_tokens = _length(body, ("max_completion_tokens", "max_tokens", "n_predict"))
    tools, parse_tools, forced = _tools(body)
    constraint = structured_wire.combine(
        structured_wire.chat_constraint(
            structured_wire.response_format(body.response_format), body.json_schema, body.grammar
        ),
        forced,
    )
    request = GenerationRequest(
        request_id=new_id("chatcmpl"),
        prompt=ChatPrompt(
            messages=_messages(body.messages, media),
            tools=tools,
            template_kwargs=_template_kwargs(body),
        ),
        parse_tools=parse_tools,
        single_tool_call=body.parallel_tool_calls is False,
        parallel_tool_calls=body.parallel_tool_calls,
        sampling=sampling_params(body, defaults, vocab_size, tokenizer),
        max_tokens=max_tokens,
        stop=_stop(body.stop),
        ignore_eos=bool(body.ignore_eos),
        cache_key=cache_key(body),
        logprobs=_chat_logprobs(body),
        n=_n(body.n),
        constraint=constraint,
        thinking_budget=structured_wire.thinking_budget(
            {f: getattr(body, f) for f in structured_wire.BUDGET_FIELDS}, reasoning_budget
        ),
        loop_limit=loop_limit(body),
        images=tuple(media.images or ()),
        audio=tuple(media.audio or ()),
        **slot_options(body),
    )
    return body, request


def _template_kwargs(body: ChatCompletionBody) -> tuple[tuple[str, object], ...]:
    """`chat_template_kwargs` (e.g. enable_thinking) and `reasoning_effort`, given to the
    template exactly as sent; a template that rejects a value makes the render fail (400)."""
    kwargs: dict[str, object] = {}
    if body.chat_template_kwargs is not None:
        if not isinstance(body.chat_template_kwargs, dict) or not all(
            isinstance(k, str) for k in body.chat_template_kwargs
        ):
            raise InvalidRequest(
                "chat_template_kwargs must be an object", param="chat_template_kwargs"
            )
        reserved = {"messages", "tools", "add_generation_prompt"} & body.chat_template_kwargs.keys()
        if reserved:
            raise InvalidRequest(
                f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs"
            )
        kwargs.update(body.chat_template_kwargs)
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    return tuple(sorted(kwargs.items()))


MAX_TOOLS = 128


def _tools(
    body: ChatCompletionBody,
) -> tuple[tuple[dict[str, object], ...] | None, bool, ForcedToolCall | None]:
    """The function tools for the template, whether to parse calls out of the output, and the
    call that tool_choice forces (constrained decoding), if any."""
    if body.tools is None:
        if body.tool_choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None, False, None
    if not isinstance(body.tools, list):
        raise InvalidRequest("tools must be a list", param="tools")
    if len(body.tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools are supported", param="tools")
    for i, tool in enumerate(body.tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequest("only function tools are supported", param=f"tools[{i}].type")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest("a function tool needs a name", param=f"tools[{i}].function.name")
        check_tool_fields(fn, f"tools[{i}].function")
    names = [t["function"]["name"] for t in body.tools]
    parse, forced = structured_wire.tool_choice(
        body.tool_choice, names, parallel=body.parallel_tool_calls
    )
    return tuple(body.tools), parse, forced


# The types templates and tool-call parsers assume of a function tool's optional fields.
TOOL_FIELD_TYPES: dict[str, tuple[type, str]] = {
    "description": (str, "a string"),
    "parameters": (dict, "a JSON schema object"),
    "strict": (bool, "a boolean"),
}


def check_tool_fields(fn: dict[str, Any], at: str) -> None:
    """A 400 naming the first optional function-tool field of the wrong type."""
    for key, (kind, what) in TOOL_FIELD_TYPES.items():
        value = fn.get(key)
        if value is not None and not isinstance(value, kind):
            raise InvalidRequest(f"{at}.{key} must be {what}", param=f"{at}.{key}")


def _chat_logprobs(body: ChatCompletionBody) -> int | None:
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= 20:
            raise InvalidRequest("top_logprobs must be between 0 and 20", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _prompt(value: Any) -> Prompt:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str):
        raise InvalidRequest("prompt must be a string", param="prompt")
    if value and not value.strip():
        raise InvalidRequest("prompt must not be only whitespace", param="prompt")
    return TextPrompt(text=value)


def completion_request(
    data: Any,
    defaults: SamplingParams = PLAIN_SAMPLING,
    vocab_size: int | None = None,
    tokenizer: Any = None,
) -> tuple[CompletionBody, GenerationRequest]:
    body = structure(flatten_extra_body(data), CompletionBody)
    _check_stream_options(body)
    max_tokens = _length(body, ("max_tokens", "n_predict"))
    request = GenerationRequest(
        request_id=new_id("cmpl"),
        prompt=_prompt(body.prompt),
        sampling=sampling_params(body, defaults, vocab_size, tokenizer),
        max_tokens=max_tokens,
        stop=_stop(body.stop),
        ignore_eos=bool(body.ignore_eos),
        cache_key=cache_key(body),
        logprobs=body.logprobs,
        n=_n(body.n),
        constraint=structured_wire.response_format(body.response_format),
        loop_limit=loop_limit(body),
        **slot_options(body),
    )
    if body.logprobs is not None and not 0 <= body.logprobs <= 5:
        raise InvalidRequest("logprobs must be between 0 and 5", param="logprobs")
    return body, request

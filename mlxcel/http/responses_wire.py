"""Responses API request bodies (wire types) and their conversion into GenerationRequest.

A request's ``input`` (a string or typed items) is normalised into items in the shape the
Responses API itself returns them: every item gets an id, messages get typed content parts.
Those items are what the store keeps, what ``input_items`` lists, and what a later turn reads
back as history through ``previous_response_id`` or ``conversation``. ``chat_messages`` turns a
history of such items into the chat messages the model's template renders.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import attrs

from mlxcel.actors.grammars import schema_grammar
from mlxcel.http.openai_wire import MAX_TOOLS, PLAIN_SAMPLING, check_metadata, check_tool_fields
from mlxcel.http.sampling_wire import SamplingFields, sampling_params
from mlxcel.runtime import json_input
from mlxcel.runtime.codec import structure
from mlxcel.runtime.errors import InvalidRequest, UnsupportedField
from mlxcel.runtime.messages import (
    AudioRef,
    ChatPrompt,
    Constraint,
    ForcedToolCall,
    GenerationRequest,
    ImageRef,
    JsonObjectFormat,
    JsonSchemaFormat,
    SamplingParams,
)

# Tool types the Responses API defines that run on OpenAI's side; we have none of them.
HOSTED_TOOLS = (
    "web_search, web_search_preview, file_search, computer_use_preview, code_interpreter, "
    "image_generation, mcp, local_shell, shell, custom, apply_patch"
)
# `reasoning.effort` values that switch thinking off instead of being passed to the template.
NO_THINKING = {"none", "off", "disabled", "false", "0"}
# `include` values we can honour: logprobs are returned; reasoning is always plain text here
# (nothing is encrypted), so asking for encrypted reasoning changes nothing.
INCLUDES = {"message.output_text.logprobs", "reasoning.encrypted_content"}
TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}
MEDIA = {
    "input_image": "image",
    "image_url": "image",
    "input_audio": "audio",
    "video_url": "video",
    "input_file": "file",
    "file": "file",
}


@attrs.frozen(kw_only=True)
class ResponsesBody(SamplingFields):
    input: Any = None
    model: str | None = None
    instructions: str | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: Any = None
    reasoning: Any = None
    top_logprobs: int | None = None
    max_output_tokens: int | None = None
    metadata: Any = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    truncation: str | None = None
    stream: bool | None = None
    stream_options: Any = None
    include: Any = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    cache_prompt: bool | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def parse_body(data: Any) -> ResponsesBody:
    """Structure and check everything that needs neither the store nor the model."""
    body = structure(data, ResponsesBody)
    if body.background and body.store is False:
        raise InvalidRequest(
            "background responses are stored (that is how they are polled): "
            "leave store out or set it to true",
            param="background",
        )
    if body.truncation not in (None, "disabled", "auto"):
        raise InvalidRequest("truncation must be 'auto' or 'disabled'", param="truncation")
    if body.previous_response_id is not None and body.conversation is not None:
        raise InvalidRequest(
            "previous_response_id and conversation cannot be used together",
            param="previous_response_id",
        )
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise InvalidRequest("max_output_tokens must be at least 1", param="max_output_tokens")
    if body.max_tool_calls is not None and body.max_tool_calls < 1:
        raise InvalidRequest("max_tool_calls must be at least 1", param="max_tool_calls")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise InvalidRequest("top_logprobs must be between 0 and 20", param="top_logprobs")
    check_metadata(body.metadata)
    if body.include is not None:
        if not isinstance(body.include, list) or not all(isinstance(i, str) for i in body.include):
            raise InvalidRequest("include must be a list of strings", param="include")
        for value in body.include:
            if value not in INCLUDES:
                raise UnsupportedField("include", f"'{value}' is not available on this server")
    options = body.stream_options
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    # OpenAI's one option: our events carry no obfuscation padding, asked for or not.
    for key, value in (options or {}).items():
        if key != "include_obfuscation" or not isinstance(value, bool):
            raise InvalidRequest(
                "stream_options takes include_obfuscation (a boolean)",
                param=f"stream_options.{key}",
            )
    return body


def conversation_id(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict) and isinstance(value.get("id"), str):
        value = value["id"]
    if not isinstance(value, str) or not value:
        raise InvalidRequest(
            "conversation must be a conversation id or an object with an id",
            param="conversation",
        )
    return value


# --- input items -------------------------------------------------------------------------------


def input_items(
    value: Any, param: str = "input", *, vision: bool = False, hears: bool = False
) -> list[dict[str, Any]]:
    """The request's input as stored items (each with an id). ``vision``: a user message's
    ``input_image`` parts are kept (their URLs are read when the request is submitted); else
    they are refused here, before anything is fetched. ``hears``: ``input_audio`` parts are
    kept for the handler (http/heard.py) to transcribe, or to check and keep for a model that
    hears audio itself (else refused)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"{param} must be a string or a non-empty list of items", param=param)
    return [_item(item, f"{param}[{i}]", vision, hears) for i, item in enumerate(value)]


def _item(item: Any, at: str, vision: bool = False, hears: bool = False) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise InvalidRequest(f"{at} must be an object", param=at)
    kind = item.get("type", "message" if "role" in item else None)
    if not isinstance(kind, str):
        raise InvalidRequest(f"{at}.type must be a string", param=f"{at}.type")
    if item.get("id") is not None and not isinstance(item["id"], str):
        raise InvalidRequest(f"{at}.id must be a string", param=f"{at}.id")
    if kind == "message":
        return _message_item(item, at, vision, hears)
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise InvalidRequest(f"{at}.{key} must be a string", param=f"{at}.{key}")
        return {
            "id": item.get("id") or new_id("fc"),
            "type": "function_call",
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": item["arguments"],
            "status": "completed",
        }
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise InvalidRequest(f"{at}.call_id must be a string", param=f"{at}.call_id")
        output = item.get("output")
        if not isinstance(output, str):
            output = _parts_text(output, f"{at}.output")
        return {
            "id": item.get("id") or new_id("fco"),
            "type": "function_call_output",
            "call_id": item["call_id"],
            "output": output,
            "status": "completed",
        }
    if kind == "reasoning":
        content = item.get("content") or []
        if not isinstance(content, list):
            raise InvalidRequest(f"{at}.content must be a list", param=f"{at}.content")
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        if not all(isinstance(t, str) for t in texts):
            raise InvalidRequest(
                f"{at}.content must hold reasoning_text parts", param=f"{at}.content"
            )
        return {
            "id": item.get("id") or new_id("rs"),
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": t} for t in texts],
        }
    raise InvalidRequest(
        f"{at}.type '{kind}' is not supported; use message, function_call, "
        "function_call_output or reasoning items",
        param=f"{at}.type",
    )


def _message_item(item: Any, at: str, vision: bool = False, hears: bool = False) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(
            f"{at}.role must be user, system, developer or assistant", param=f"{at}.role"
        )
    if (vision or hears) and role == "user" and isinstance(item.get("content"), list):
        parts = _user_parts(item["content"], f"{at}.content", vision, hears)
    else:
        text = _parts_text(item.get("content"), f"{at}.content")
        part = "output_text" if role == "assistant" else "input_text"
        parts = [{"type": part, "text": text}]
        if part == "output_text":
            parts[0]["annotations"] = []
    return {
        "id": item.get("id") or new_id("msg"),
        "type": "message",
        "role": role,
        "content": parts,
        "status": "completed",
    }


def _user_parts(content: list[Any], at: str, vision: bool, hears: bool) -> list[dict[str, Any]]:
    """A user message's text, images and audio, in order, as stored: ``input_text`` parts
    joined as they come, each ``input_image`` on its own with its URL (a data URI, http(s), a
    path; a vision model), each ``input_audio`` with its data until the handler replaces it
    by its transcript (``heard.transcribe_items``; a server that hears) or, for a model that
    hears audio itself, by the stored part (``heard.keep_items``: OpenAI's shape)."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"{at}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "image_url") and vision:
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str) or not url:
                why = (
                    ", not a file_id (there is no uploads store here)"
                    if part.get("file_id")
                    else ""
                )
                raise InvalidRequest(f"{where}.image_url must be a non-empty URL{why}", param=where)
            parts.append(
                {"type": "input_image", "image_url": url, "detail": part.get("detail") or "auto"}
            )
            continue
        if kind == "input_audio" and hears:
            value = part.get("input_audio")
            data = value.get("data") if isinstance(value, dict) else None
            if not isinstance(data, str) or not data:
                raise InvalidRequest(f"{where}.input_audio.data must be base64 audio", param=where)
            fmt = value.get("format", "wav") if isinstance(value, dict) else "wav"
            parts.append({"type": "input_audio", "data": data, "format": fmt, "where": where})
            continue
        text = _part_text(part, kind, where)
        if parts and parts[-1]["type"] == "input_text":
            parts[-1]["text"] += "\n" + text
        else:
            parts.append({"type": "input_text", "text": text})
    return parts or [{"type": "input_text", "text": ""}]


def message_text(item: dict[str, Any]) -> str:
    """A stored message's text (its text parts joined)."""
    return "\n".join(p["text"] for p in item["content"] if "text" in p)


def chat_audio(items: list[dict[str, Any]]) -> tuple[AudioRef, ...]:
    """The audio parts of ``items``' user messages in prompt order (stored for a model that
    hears audio itself), named by item and part; each is rendered as an audio part
    (``chat_messages``), so none has a placeholder."""
    return tuple(
        AudioRef(
            f"{item['id']}.content[{j}]",
            part["input_audio"]["data"],
            part["input_audio"].get("format", "wav"),
            "",
        )
        for item in items
        if item["type"] == "message"
        for j, part in enumerate(item["content"])
        if part["type"] == "input_audio" and isinstance(part.get("input_audio"), dict)
    )


def chat_images(items: list[dict[str, Any]]) -> tuple[ImageRef, ...]:
    """The images of ``items``' user messages in prompt order, named by item and part."""
    return tuple(
        ImageRef(f"{item['id']}.content[{j}]", part["image_url"])
        for item in items
        if item["type"] == "message"
        for j, part in enumerate(item["content"])
        if part["type"] == "input_image"
    )


def _parts_text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{at} must be a string or a list of content parts", param=at)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        texts.append(_part_text(part, kind, f"{at}[{j}]"))
    return "\n".join(texts)


def _part_text(part: Any, kind: Any, where: str) -> str:
    """A text part's text; a 400 naming it for anything else (media this server does not
    read here, unknown types)."""
    if not isinstance(kind, str):
        raise InvalidRequest(f"{where}.type must be a string", param=f"{where}.type")
    if kind in TEXT_PARTS:
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise InvalidRequest(f"{where}.text must be a string", param=where)
        return value
    if kind in MEDIA:
        raise InvalidRequest(f"{MEDIA[kind]} input is not supported", param=where)
    raise InvalidRequest(f"{where}.type '{kind}' is not supported", param=where)


# Stored media parts, and the chat template's part each one renders as.
_MEDIA_ITEMS = {"input_image": "image", "input_audio": "audio"}


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, object]]:
    """Stored items -> chat messages: calls join the assistant turn before them, reasoning
    rides on the assistant turn after it."""
    out: list[dict[str, object]] = []
    reasoning: list[str] = []

    def assistant() -> dict[str, object]:
        last = out[-1] if out else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            out.append(last)
        if reasoning:
            last["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return last

    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning.extend(p["text"] for p in item["content"])
        elif kind == "message" and item["role"] == "assistant":
            msg = assistant()
            msg["content"] = str(msg["content"]) + message_text(item)
        elif kind == "message" and any(p["type"] in _MEDIA_ITEMS for p in item["content"]):
            # The parts a VLM chat template renders, images (and audio) where they were.
            parts = [
                {"type": _MEDIA_ITEMS[p["type"]]}
                if p["type"] in _MEDIA_ITEMS
                else {"type": "text", "text": p["text"]}
                for p in item["content"]
            ]
            out.append({"role": item["role"], "content": parts})
        elif kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": message_text(item)})
        elif kind == "function_call":
            msg = assistant()
            calls = msg.setdefault("tool_calls", [])
            assert isinstance(calls, list)
            calls.append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": _arguments(item["arguments"])},
                }
            )
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def _arguments(text: str) -> object:
    # Chat templates expect the arguments object, the wire carries a JSON string.
    return json_input.loads_or_text(text, where="function_call arguments")


# --- tools and output format -------------------------------------------------------------------


FUNCTION_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})


def template_tools(value: Any) -> tuple[dict[str, object], ...] | None:
    """Responses function tools ({type, name, parameters}) -> the chat template's shape."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequest("tools must be a list", param="tools")
    if len(value) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools are supported", param="tools")
    out: list[dict[str, object]] = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequest(
                f"tool type '{kind}' is not supported: only function tools are "
                f"(not {HOSTED_TOOLS})",
                param=f"tools[{i}].type",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidRequest("a function tool needs a name", param=f"tools[{i}].name")
        for key in sorted(set(tool) - FUNCTION_TOOL_KEYS):
            raise InvalidRequest(
                f"a function tool takes {', '.join(sorted(FUNCTION_TOOL_KEYS))}",
                param=f"tools[{i}].{key}",
            )
        check_tool_fields(tool, f"tools[{i}]")
        params = tool.get("parameters")
        fn: dict[str, object] = {"name": tool["name"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = params or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return tuple(out) or None


def forced_tools(body: ResponsesBody, names: list[str]) -> ForcedToolCall | None:
    """None for auto/none; the tools a call may name for required or a named function."""
    choice = "auto" if body.tool_choice is None else body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if choice in ("auto", "none"):
        return None
    if not names:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    if choice == "required":
        return ForcedToolCall(names=tuple(names), parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if name not in names:
            raise InvalidRequest(
                f"tool_choice names '{name}', which is not among the tools", param="tool_choice"
            )
        return ForcedToolCall(names=(str(name),), parallel=parallel)
    raise InvalidRequest(
        "tool_choice must be auto, none, required or {type: function, name}", param="tool_choice"
    )


def output_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"}:
        raise InvalidRequest("text takes format (and verbosity)", param="text")
    if value.get("verbosity") not in (None, "medium"):
        raise InvalidRequest(
            "text.verbosity other than medium is not supported (ask for brevity in the "
            "instructions)",
            param="text.verbosity",
        )
    fmt = value.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonObjectFormat()
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("text.format.schema must be a JSON schema", param="text.format")
        schema_json = json.dumps(schema)
        schema_grammar(schema_json, param="text.format")  # a 400 now, not a failed sequence
        return JsonSchemaFormat(schema_json=schema_json, strict=bool(fmt.get("strict")))
    raise InvalidRequest(
        "text.format.type must be text, json_schema or json_object", param="text.format"
    )


def _reasoning(value: Any) -> tuple[tuple[tuple[str, object], ...], int | None]:
    """Template kwargs and thinking budget for `reasoning.effort`."""
    if value is None:
        return (), None
    if not isinstance(value, dict) or set(value) - {"effort", "summary", "generate_summary"}:
        raise InvalidRequest("reasoning takes effort and summary", param="reasoning")
    effort = value.get("effort")
    if effort is None:
        return (), None
    if not isinstance(effort, str):
        raise InvalidRequest("reasoning.effort must be a string", param="reasoning.effort")
    if effort.lower() in NO_THINKING:
        return (("enable_thinking", False),), 0
    return (("reasoning_effort", effort),), None


def generation_request(
    body: ResponsesBody,
    request_id: str,
    history: list[dict[str, Any]],
    defaults: SamplingParams = PLAIN_SAMPLING,
    vocab_size: int | None = None,
    reasoning_budget: int = -1,
    tokenizer: Any = None,
) -> GenerationRequest:
    """The internal request for ``history`` (earlier turns plus this input, as items);
    ``tokenizer`` encodes logit_bias keys given as text."""
    messages = chat_messages(history)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not any(str(m.get("content", "")).strip() or m.get("tool_calls") for m in messages):
        raise InvalidRequest("input must contain some text", param="input")
    tools = template_tools(body.tools)
    names = [str(t["function"]["name"]) for t in tools or ()]  # type: ignore[index]  # a dict
    forced = forced_tools(body, names)
    text_format = output_format(body.text)
    if forced is not None and text_format is not None:
        raise InvalidRequest(
            "a forced tool_choice cannot be combined with text.format json_schema",
            param="tool_choice",
        )
    kwargs, budget = _reasoning(body.reasoning)
    if budget is None and reasoning_budget >= 0:
        budget = reasoning_budget  # no cap asked for: the server's --reasoning-budget
    wants_logprobs = body.top_logprobs is not None or "message.output_text.logprobs" in (
        body.include or ()
    )
    return GenerationRequest(
        request_id=request_id,
        prompt=ChatPrompt(messages=tuple(messages), tools=tools, template_kwargs=kwargs),
        sampling=sampling_params(body, defaults, vocab_size, tokenizer),
        max_tokens=body.max_output_tokens,
        cache_key=None if body.cache_prompt is False else body.prompt_cache_key or body.user or "",
        logprobs=(body.top_logprobs or 0) if wants_logprobs else None,
        parse_tools=tools is not None and body.tool_choice != "none",
        single_tool_call=body.parallel_tool_calls is False or body.max_tool_calls == 1,
        parallel_tool_calls=body.parallel_tool_calls and body.max_tool_calls != 1,
        constraint=forced or text_format,
        thinking_budget=budget,
        images=chat_images(history),
        audio=chat_audio(history),
    )

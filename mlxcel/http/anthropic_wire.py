"""Anthropic Messages request bodies (wire types) and their conversion into GenerationRequest.

Anthropic turns become the OpenAI-style messages our chat templates read: text blocks join into
``content``; ``tool_use`` blocks become the assistant's ``tool_calls`` (arguments as objects, as
templates expect); each ``tool_result`` block becomes a ``tool`` message; ``thinking`` blocks
become the assistant turn's ``reasoning_content``. ``system`` turns inside ``messages`` (Claude
Code sends them) are folded into the adjacent user turn, because most templates refuse a system
turn anywhere but first. A final assistant turn is a prefill: the answer continues it.

Errors name the field in the message itself, since Anthropic's envelope has no ``param``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import attrs

from mlxcel.actors.grammars import schema_grammar
from mlxcel.http.openai_wire import MAX_TOOLS, PLAIN_SAMPLING
from mlxcel.http.sampling_wire import SamplingFields, sampling_params
from mlxcel.runtime.codec import structure
from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import (
    ChatPrompt,
    Constraint,
    ForcedToolCall,
    GenerationRequest,
    ImageRef,
    JsonSchemaFormat,
    SamplingParams,
)
from mlxcel.runtime.sampling_rules import MAX_STOP_STRINGS


@attrs.frozen(kw_only=True)
class MessagesBody(SamplingFields):
    """`/v1/messages` and `/v1/messages/count_tokens`; `temperature`, `top_p`, `top_k` (and
    llama.cpp's other sampling knobs, as extensions) come from SamplingFields."""

    messages: Any
    model: str | None = None
    system: Any = None
    max_tokens: int | None = None
    stop_sequences: Any = None
    stream: bool | None = None
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None
    output_config: Any = None
    metadata: Any = None
    # Honoured as they are: every request is served at one tier, and the prompt cache is
    # automatic, so explicit cache breakpoints are already covered.
    service_tier: Any = None
    cache_control: Any = None
    # Claude Code always sends this (server-side clearing of old tool results and thinking)
    # and cannot turn it off. Nothing is cleared here: the client sees the whole prompt in
    # `usage` and compacts the conversation itself.
    context_management: Any = None
    # llama-server extensions.
    ignore_eos: bool | None = None
    cache_prompt: bool | None = None


@attrs.frozen
class Thinking:
    """How the answer's thinking is shown: with its text, or `display: "omitted"`."""

    omitted: bool = False


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _blocks(content: Any, at: str) -> list[Any]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{at}: must be a string or a list of content blocks", param=at)
    return content


def _block_type(block: Any, at: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise InvalidRequest(f"{at}: must be a content block with a 'type'", param=at)
    return kind


def _string(block: dict[str, Any], key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{at}.{key}: must be a string", param=f"{at}.{key}")
    return value


def _document(block: dict[str, Any], at: str) -> str:
    """A document's text: plain-text sources and text-block content sources; others are 400."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source, dict):
        text = _string(source, "data", f"{at}.source")
    elif kind == "content" and isinstance(source, dict):
        text = _text_only(source.get("content"), f"{at}.source.content")
    else:
        raise InvalidRequest(
            f"{at}.source: document input is not supported (only text documents are)",
            param=f"{at}.source",
        )
    title = block.get("title")
    return f"{title}\n\n{text}" if isinstance(title, str) and title else text


def _readable(block: dict[str, Any], kind: str, at: str) -> str | None:
    """The text of a text or document block; a 400 for an image where none is read (a text
    model, or outside a user turn: refused before anything is fetched); None for any other
    kind."""
    if kind == "text":
        return _string(block, "text", at)
    if kind == "document":
        return _document(block, at)
    if kind == "image":
        raise InvalidRequest(f"{at}: image input is not supported", param=at)
    return None


def _text_only(content: Any, at: str, *, image_notes: bool = False) -> str:
    """Text of a string or of text/document blocks (system prompts, tool results).

    ``image_notes`` (tool results): an image (Claude Code's screenshots, an image file read)
    becomes a note the model reads. Tool results reach the template as text, and a 400 would
    end an agent's session for good: the image stays in the history it resends every turn."""
    texts = []
    for j, block in enumerate(_blocks(content, at)):
        where = f"{at}[{j}]"
        kind = _block_type(block, where)
        if kind == "image" and image_notes:
            url = _image_url(block, where)  # a malformed source is still a 400 naming it
            media = url[5 : url.index(";")] if url.startswith("data:") and ";" in url else "url"
            texts.append(f"[image ({media}) not shown: tool results are read as text here]")
            continue
        text = _readable(block, kind, where)
        if text is None:
            raise InvalidRequest(
                f"{where}: unsupported content block type {kind!r} here", param=where
            )
        texts.append(text)
    return "\n".join(texts)


class _Turns:
    """Builds the template's message list turn by turn."""

    def __init__(self, images: list[ImageRef] | None = None) -> None:
        # A vision model's image references, in prompt order (None: images are refused).
        self._images = images
        self.out: list[dict[str, Any]] = []
        self._pending_system: list[str] = []
        # tool_use id -> tool name, so tool messages can carry the name templates print.
        self._names: dict[str, str] = {}

    def system(self, text: str) -> None:
        if (
            self.out
            and self.out[-1]["role"] == "user"
            and isinstance(self.out[-1]["content"], list)
        ):
            self.out[-1]["content"].append({"type": "text", "text": f"\n\n{text}"})
        elif self.out and self.out[-1]["role"] == "user":
            self.out[-1]["content"] = f"{self.out[-1]['content']}\n\n{text}"
        else:
            self._pending_system.append(text)

    def user(self, content: Any, at: str) -> None:
        texts: list[str] = []
        # With images: the turn's parts in order, as a VLM chat template renders them.
        parts: list[dict[str, str]] = []
        results = 0
        for j, block in enumerate(_blocks(content, at)):
            where = f"{at}[{j}]"
            kind = _block_type(block, where)
            if kind == "image" and self._images is not None:
                self._images.append(ImageRef(where, _image_url(block, where)))
                parts.append({"type": "image"})
                continue
            text = _readable(block, kind, where)
            if text is not None:
                texts.append(text)
                parts.append({"type": "text", "text": text})
            elif kind == "tool_result":
                self.out.append(self._tool_result(block, where))
                results += 1
            else:
                raise InvalidRequest(
                    f"{where}: unsupported content block type {kind!r} in a user turn",
                    param=where,
                )
        if any(p["type"] == "image" for p in parts):
            pending = "\n\n".join(self._pending_system)
            self._pending_system.clear()
            lead = [{"type": "text", "text": pending}] if pending else []
            self.out.append({"role": "user", "content": lead + parts})
        elif texts or not results:
            # Tool results answer the previous assistant turn, so any text follows them.
            joined = [*self._pending_system, "\n".join(texts)]
            self._pending_system.clear()
            self.out.append({"role": "user", "content": "\n\n".join(p for p in joined if p)})

    def _tool_result(self, block: dict[str, Any], at: str) -> dict[str, Any]:
        call_id = _string(block, "tool_use_id", at)
        content = block.get("content")
        text = "" if content is None else _text_only(content, f"{at}.content", image_notes=True)
        if block.get("is_error") is True:
            # Tool messages have no error flag; say it where the model reads it.
            text = f"Error: {text}"
        msg: dict[str, Any] = {"role": "tool", "tool_call_id": call_id, "content": text}
        if call_id in self._names:
            msg["name"] = self._names[call_id]
        return msg

    def assistant(self, content: Any, at: str) -> None:
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(_blocks(content, at)):
            where = f"{at}[{j}]"
            kind = _block_type(block, where)
            if kind == "text":
                texts.append(_string(block, "text", where))
            elif kind == "thinking":
                reasoning.append(_string(block, "thinking", where))
            elif kind == "redacted_thinking":
                continue  # encrypted by another service: nothing a model here can read
            elif kind == "tool_use":
                call_id, name = _string(block, "id", where), _string(block, "name", where)
                args = block.get("input", {})
                if not isinstance(args, dict):
                    raise InvalidRequest(f"{where}.input: must be an object", param=where)
                self._names[call_id] = name
                fn = {"name": name, "arguments": args}
                calls.append({"id": call_id, "type": "function", "function": fn})
            else:
                raise InvalidRequest(
                    f"{where}: unsupported content block type {kind!r} in an assistant turn",
                    param=where,
                )
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        self.out.append(msg)

    def finish(self) -> list[dict[str, Any]]:
        if self._pending_system:
            self.out.append({"role": "user", "content": "\n\n".join(self._pending_system)})
            self._pending_system.clear()
        return self.out


def _image_url(block: dict[str, Any], at: str) -> str:
    """An image block's source as a URL: base64 data as a data URI, or the url given."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media_type = _string(source, "media_type", f"{at}.source")
        return f"data:{media_type};base64,{_string(source, 'data', f'{at}.source')}"
    if kind == "url" and isinstance(source, dict):
        return _string(source, "url", f"{at}.source")
    raise InvalidRequest(f"{at}.source: must be a base64 or url image source", param=f"{at}.source")


def _messages(
    value: Any, system: Any, images: list[ImageRef] | None = None
) -> tuple[tuple[dict[str, object], ...], bool]:
    """The template's messages, and whether the last one is an assistant prefill to continue.
    ``images``: a vision model's image references are added to it (None: images refused)."""
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages: must be a non-empty list", param="messages")
    turns = _Turns(images)
    if system is not None:
        text = _text_only(system, "system")
        if text:
            turns.out.append({"role": "system", "content": text})
    for i, msg in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequest(f"{at}: must be an object", param=at)
        role, content = msg.get("role"), msg.get("content")
        for key in sorted(set(msg) - {"role", "content"}):
            # Anthropic's own answer to an extra key: a message is role and content only.
            raise InvalidRequest(f"{at}.{key}: Extra inputs are not permitted", param=f"{at}.{key}")
        if content is None:
            raise InvalidRequest(f"{at}.content: is required", param=f"{at}.content")
        if role == "user":
            turns.user(content, f"{at}.content")
        elif role == "assistant":
            turns.assistant(content, f"{at}.content")
        elif role == "system":
            turns.system(_text_only(content, f"{at}.content"))
        else:
            raise InvalidRequest(
                f"{at}.role: must be 'user', 'assistant' or 'system'", param=f"{at}.role"
            )
    out = turns.finish()
    if not any(str(m["content"]).strip() or m.get("tool_calls") for m in out):
        raise InvalidRequest(
            "messages: Request must include at least one non-empty message content or media input.",
            param="messages",
        )
    last = out[-1]
    prefill = last["role"] == "assistant"
    if prefill and (last.get("tool_calls") or not str(last["content"])):
        raise InvalidRequest(
            "messages: a final assistant turn is continued as a prefill, so it must hold text "
            "and no tool_use",
            param="messages",
        )
    return tuple(out), prefill


def _tools(value: Any) -> tuple[dict[str, object], ...] | None:
    """Client tools in the OpenAI function shape templates read; server tools (no
    input_schema, e.g. web_search) are dropped: nothing here can run them."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequest("tools: must be a list", param="tools")
    if len(value) > MAX_TOOLS:
        raise InvalidRequest(f"tools: at most {MAX_TOOLS} tools are supported", param="tools")
    out: list[dict[str, object]] = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"{at}: must be an object", param=at)
        if "input_schema" not in tool:
            continue
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{at}.name: must be a non-empty string", param=f"{at}.name")
        if not isinstance(schema, dict):
            raise InvalidRequest(
                f"{at}.input_schema: must be a JSON schema object", param=f"{at}.input_schema"
            )
        fn: dict[str, object] = {"name": name, "parameters": schema}
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest(f"{at}.description: must be a string", param=f"{at}.description")
        if description is not None:
            fn["description"] = description
        out.append({"type": "function", "function": fn})
    return tuple(out) or None


@attrs.frozen
class ToolPlan:
    parse_tools: bool = False
    single_call: bool = False
    forced: ForcedToolCall | None = None
    # disable_parallel_tool_use as sent, negated (None: not sent). As OpenAI's
    # parallel_tool_calls: the generic format writes a list of calls only when it is True.
    parallel: bool | None = None


def _tool_choice(value: Any, tools: tuple[dict[str, Any], ...] | None) -> ToolPlan:
    if value is None:
        return ToolPlan(parse_tools=tools is not None)
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "none", "tool"):
        raise InvalidRequest(
            "tool_choice.type: must be 'auto', 'any', 'none' or 'tool'", param="tool_choice"
        )
    assert isinstance(value, dict)
    sent = value.get("disable_parallel_tool_use")
    single = bool(sent)
    if sent is not None and not isinstance(sent, bool):
        raise InvalidRequest(
            "tool_choice.disable_parallel_tool_use: must be a boolean", param="tool_choice"
        )
    if kind == "none":
        return ToolPlan()
    if tools is None:
        if kind == "auto":
            return ToolPlan()
        raise InvalidRequest(f"tool_choice: type {kind!r} needs tools", param="tool_choice")
    names = tuple(str(t["function"]["name"]) for t in tools)
    parallel = None if sent is None else not sent
    if kind == "auto":
        return ToolPlan(parse_tools=True, single_call=single, parallel=parallel)
    if kind == "tool":
        name = value.get("name")
        if name not in names:
            raise InvalidRequest(
                f"tool_choice.name: {name!r} is not one of the tools", param="tool_choice.name"
            )
        names = (name,)
    return ToolPlan(True, single, ForcedToolCall(names=names, parallel=not single), parallel)


def _thinking(value: Any) -> tuple[dict[str, object], int | None, Thinking]:
    """(template variables, thinking budget, display) for `thinking`."""
    if value is None:
        return {}, None, Thinking()
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise InvalidRequest(
            "thinking.type: must be 'enabled', 'adaptive' or 'disabled'", param="thinking.type"
        )
    assert isinstance(value, dict)
    display = value.get("display")
    if display not in (None, "summarized", "omitted"):
        raise InvalidRequest(
            "thinking.display: must be 'summarized' or 'omitted'", param="thinking.display"
        )
    shown = Thinking(omitted=display == "omitted")
    if kind == "disabled":
        return {"enable_thinking": False}, 0, shown
    if kind == "adaptive":
        return {"enable_thinking": True}, None, shown
    budget = value.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InvalidRequest(
            "thinking.budget_tokens: must be a non-negative integer",
            param="thinking.budget_tokens",
        )
    return {"enable_thinking": True}, budget, shown


def _output_config(value: Any) -> tuple[dict[str, object], JsonSchemaFormat | None]:
    """`effort` goes to the template as `reasoning_effort`; `format` constrains the output."""
    if value is None:
        return {}, None
    if not isinstance(value, dict):
        raise InvalidRequest("output_config: must be an object", param="output_config")
    unknown = sorted(set(value) - {"effort", "format"})
    if unknown:
        raise InvalidRequest(
            f"output_config.{unknown[0]}: is not supported by this server",
            param=f"output_config.{unknown[0]}",
        )
    kwargs: dict[str, object] = {}
    if value.get("effort") is not None:
        kwargs["reasoning_effort"] = value["effort"]
    fmt = value.get("format")
    if fmt is None:
        return kwargs, None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequest(
            "output_config.format.type: must be 'json_schema'", param="output_config.format"
        )
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidRequest(
            "output_config.format.schema: must be a JSON schema object",
            param="output_config.format.schema",
        )
    schema_json = json.dumps(fmt["schema"])
    schema_grammar(schema_json, param="output_config.format.schema")  # 400 now, not mid-run
    return kwargs, JsonSchemaFormat(schema_json=schema_json, strict=True)


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise InvalidRequest(
            "stop_sequences: must be a list of non-empty strings", param="stop_sequences"
        )
    if len(value) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"stop_sequences: at most {MAX_STOP_STRINGS} are supported", param="stop_sequences"
        )
    return tuple(value)


def _cache_key(body: MessagesBody) -> str | None:
    """The prompt-cache tenant: `metadata.user_id` (as OpenAI's `user`); None opts out."""
    if body.metadata is not None and not isinstance(body.metadata, dict):
        raise InvalidRequest("metadata: must be an object", param="metadata")
    if body.cache_prompt is False:
        return None
    user = (body.metadata or {}).get("user_id")
    return user if isinstance(user, str) else ""


@attrs.frozen
class MessagesRequest:
    body: MessagesBody
    generation: GenerationRequest
    thinking: Thinking


def messages_request(
    data: Any,
    defaults: SamplingParams = PLAIN_SAMPLING,
    vocab_size: int | None = None,
    reasoning_budget: int = -1,
    tokenizer: Any = None,
    vision: bool = False,
) -> MessagesRequest:
    """Validate a Messages body (400 naming the field) and convert it for the pipeline;
    ``tokenizer`` encodes logit_bias keys given as text; ``vision``: image blocks in user
    turns are read (else refused before anything is fetched)."""
    body = structure(data, MessagesBody)
    images: list[ImageRef] | None = [] if vision else None
    messages, prefill = _messages(body.messages, body.system, images)
    tools = _tools(body.tools)
    plan = _tool_choice(body.tool_choice, tools)
    kwargs, budget, thinking = _thinking(body.thinking)
    if budget is None and reasoning_budget >= 0:
        budget = reasoning_budget  # no cap asked for: the server's --reasoning-budget
    effort, schema = _output_config(body.output_config)
    kwargs.update(effort)
    if prefill:
        kwargs["continue_final_message"] = True
    constraint: Constraint | None = plan.forced
    if schema is not None:
        if constraint is not None:
            raise InvalidRequest(
                "output_config.format: cannot be combined with a tool_choice that forces a call",
                param="output_config.format",
            )
        constraint = schema
    if body.max_tokens is not None and body.max_tokens < 1:
        raise InvalidRequest("max_tokens: must be at least 1", param="max_tokens")
    generation = GenerationRequest(
        request_id=new_message_id(),
        prompt=ChatPrompt(
            messages=messages, tools=tools, template_kwargs=tuple(sorted(kwargs.items()))
        ),
        sampling=sampling_params(body, defaults, vocab_size, tokenizer),
        max_tokens=body.max_tokens,
        stop=_stop_sequences(body.stop_sequences),
        ignore_eos=bool(body.ignore_eos),
        cache_key=_cache_key(body),
        parse_tools=plan.parse_tools,
        single_tool_call=plan.single_call,
        parallel_tool_calls=plan.parallel,
        constraint=constraint,
        thinking_budget=budget,
        images=tuple(images or ()),
    )
    return MessagesRequest(body, generation, thinking)

"""Anthropic Messages bodies -> GenerationRequest, and the streamed block state machine."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxcel.actors.toolcalls import ToolCallArgs, ToolCallEnd, ToolCallStart
from mlxcel.http.anthropic_blocks import BlockStream, stop_reason
from mlxcel.http.anthropic_wire import Thinking, messages_request
from mlxcel.runtime.errors import InvalidRequest, UnsupportedField
from mlxcel.runtime.messages import ChatPrompt, ForcedToolCall, JsonSchemaFormat
from mlxcel.runtime.slot import SlotUpdate
from tests.support.chat_templates import TOOL_THINK_TEMPLATE

WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


def convert(**body: Any) -> Any:
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return messages_request(body)


def prompt(**body: Any) -> ChatPrompt:
    p = convert(**body).generation.prompt
    assert isinstance(p, ChatPrompt)
    return p


def test_system_string_and_blocks_become_the_system_turn() -> None:
    assert prompt(system="Be brief.").messages[0] == {"role": "system", "content": "Be brief."}
    blocks = [
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}},
    ]
    assert prompt(system=blocks).messages[0] == {
        "role": "system",
        "content": "Be brief.\nBe kind.",
    }


def test_system_turns_inside_messages_fold_into_the_adjacent_user_turn() -> None:
    messages = [
        {"role": "system", "content": "Reminder A"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
        {"role": "system", "content": [{"type": "text", "text": "Reminder B"}]},
    ]
    assert prompt(messages=messages).messages == (
        {"role": "user", "content": "Reminder A\n\nHi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again\n\nReminder B"},
    )


def test_tool_use_and_tool_result_become_tool_calls_and_tool_messages() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                CALL,
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "timeout"}],
                    "is_error": True,
                },
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    p = prompt(messages=messages, tools=[WEATHER])
    assert p.messages[1:] == (
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": "Thanks"},
    )
    assert p.tools == (
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "Weather for a city",
            },
        },
    )


def test_a_tool_result_turn_renders_through_a_real_template(smollm_tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [CALL],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}
            ],
        },
    ]
    p = prompt(messages=messages, tools=[WEATHER])
    text = smollm_tokenizer.apply_chat_template(
        list(p.messages),
        tools=list(p.tools or ()),
        chat_template=TOOL_THINK_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text
    assert '"name": "get_weather"' in text.split("</tools>")[0]  # the tool is offered
    assert text.endswith("<|im_start|>assistant\n")


def test_documents_give_their_text_and_other_media_are_400() -> None:
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "D"}}
    msgs = [{"role": "user", "content": [doc, {"type": "text", "text": "Summarise"}]}]
    assert prompt(messages=msgs).messages[0]["content"] == "D\nSummarise"
    image = {"type": "image", "source": {"type": "url", "url": "http://example.invalid/x.png"}}
    with pytest.raises(InvalidRequest, match="image input is not supported") as caught:
        convert(messages=[{"role": "user", "content": [image]}])
    assert caught.value.param == "messages[0].content[0]"
    pdf = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "AA"},
    }
    with pytest.raises(InvalidRequest, match="document input is not supported"):
        convert(messages=[{"role": "user", "content": [pdf]}])
    # An image in a tool result (an agent's screenshot) is a note the model reads, not a 400
    # that would end the agent's session; nothing is fetched.
    nested = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    (result,) = prompt(messages=[{"role": "user", "content": [nested]}]).messages
    assert result["role"] == "tool"
    assert result["content"] == "[image (url) not shown: tool results are read as text here]"


def test_tool_choice_maps_to_forced_calls() -> None:
    other = {**WEATHER, "name": "get_time"}
    server_tool = {"type": "web_search_20250305", "name": "web_search"}
    r = convert(tools=[WEATHER, other, server_tool])
    assert r.generation.parse_tools and r.generation.constraint is None
    assert [t["function"]["name"] for t in r.generation.prompt.tools] == ["get_weather", "get_time"]
    r = convert(tools=[WEATHER, other], tool_choice={"type": "any"})
    assert r.generation.constraint == ForcedToolCall(names=("get_weather", "get_time"))
    r = convert(
        tools=[WEATHER, other],
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
    )
    assert r.generation.constraint == ForcedToolCall(names=("get_time",), parallel=False)
    assert r.generation.single_tool_call
    r = convert(tools=[WEATHER], tool_choice={"type": "none"})
    assert not r.generation.parse_tools and r.generation.prompt.tools
    with pytest.raises(InvalidRequest, match="tool_choice.name"):
        convert(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(InvalidRequest, match="needs tools"):
        convert(tool_choice={"type": "any"})
    # Only server tools: nothing is offered, so nothing can be forced.
    with pytest.raises(InvalidRequest, match="needs tools"):
        convert(tools=[server_tool], tool_choice={"type": "any"})


def test_thinking_config() -> None:
    r = convert(thinking={"type": "enabled", "budget_tokens": 2048})
    assert dict(r.generation.prompt.template_kwargs) == {"enable_thinking": True}
    assert r.generation.thinking_budget == 2048 and r.thinking == Thinking()
    r = convert(thinking={"type": "disabled"})
    assert dict(r.generation.prompt.template_kwargs) == {"enable_thinking": False}
    assert r.generation.thinking_budget == 0
    r = convert(thinking={"type": "adaptive", "display": "omitted"})
    assert r.generation.thinking_budget is None and r.thinking.omitted
    assert convert().generation.prompt.template_kwargs == ()
    with pytest.raises(InvalidRequest, match="budget_tokens"):
        convert(thinking={"type": "enabled"})
    with pytest.raises(InvalidRequest, match="thinking.type"):
        convert(thinking={"type": "sometimes"})


def test_output_config_effort_and_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = convert(
        output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}}
    )
    assert dict(r.generation.prompt.template_kwargs) == {"reasoning_effort": "low"}
    assert r.generation.constraint == JsonSchemaFormat(schema_json=json.dumps(schema), strict=True)
    with pytest.raises(InvalidRequest, match="output_config.format"):
        convert(
            tools=[WEATHER],
            tool_choice={"type": "any"},
            output_config={"format": {"type": "json_schema", "schema": schema}},
        )


def test_sampling_stop_and_limits() -> None:
    r = convert(
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        max_tokens=64,
        stop_sequences=["END"],
        metadata={"user_id": "u1"},
    )
    g = r.generation
    assert (g.sampling.temperature, g.sampling.top_p, g.sampling.top_k) == (0.5, 0.9, 40)
    assert g.max_tokens == 64 and g.stop == ("END",) and g.cache_key == "u1"
    assert g.request_id.startswith("msg_")
    with pytest.raises(InvalidRequest, match="stop_sequences"):
        convert(stop_sequences="END")
    with pytest.raises(InvalidRequest, match="stop_sequences"):
        convert(stop_sequences=[str(i) for i in range(17)])
    with pytest.raises(InvalidRequest, match="temperature"):
        convert(temperature=-1)
    # What Claude Code sends on every request is accepted.
    claude_code = convert(
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        thinking={"type": "adaptive"},
        metadata={"user_id": "session"},
    )
    assert dict(claude_code.generation.prompt.template_kwargs)["reasoning_effort"] == "high"
    with pytest.raises(UnsupportedField, match="mcp_servers"):
        convert(mcp_servers=[])


def test_a_final_assistant_turn_is_a_prefill() -> None:
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"}]
    p = prompt(messages=msgs)
    assert dict(p.template_kwargs) == {"continue_final_message": True}
    with pytest.raises(InvalidRequest, match="messages"):
        convert(messages=[{"role": "user", "content": "   "}])
    with pytest.raises(InvalidRequest, match="role"):
        convert(messages=[{"role": "tool", "content": "x"}])


def test_stop_reasons() -> None:
    assert stop_reason("stop", None, 5, 10) == ("end_turn", None)
    assert stop_reason("stop", "END", 5, 10) == ("stop_sequence", "END")
    assert stop_reason("length", None, 10, 10) == ("max_tokens", None)
    assert stop_reason("length", None, 7, 10) == ("model_context_window_exceeded", None)
    assert stop_reason("tool_calls", None, 5, 10) == ("tool_use", None)


def check_event_order(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Anthropic's stream grammar: message_start, then blocks (start, deltas, stop) one at a
    time with indices 0, 1, 2..., then message_delta and message_stop; pings anywhere."""
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("message_start") == 1
    open_index: int | None = None
    next_index = 0
    for name, data in events:
        assert data["type"] == name
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = next_index, next_index + 1
        elif name == "content_block_delta":
            assert data["index"] == open_index
            delta = data["delta"]
            kind = delta["type"]
            field = {
                "text_delta": "text",
                "thinking_delta": "thinking",
                "input_json_delta": "partial_json",
                "signature_delta": "signature",
            }[kind]
            assert delta[field], f"empty {kind}"
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        elif name in ("message_delta", "message_stop"):
            assert open_index is None


def test_block_stream_state_machine() -> None:
    blocks = BlockStream(Thinking())
    updates = [
        SlotUpdate("", 1, None, reasoning="Let me "),
        SlotUpdate("", 1, None, reasoning="think."),
        SlotUpdate("Sure.", 1, None),
        SlotUpdate(
            "",
            3,
            None,
            tool_events=(
                ToolCallStart(0, "call_abc", "get_weather"),
                ToolCallArgs(0, '{"city": "Paris"}'),
                ToolCallEnd(0),
                ToolCallStart(1, "call_def", "get_time"),
                ToolCallArgs(1, ""),
                ToolCallArgs(1, "{}"),
            ),
        ),
        SlotUpdate("", 0, "tool_calls"),
    ]
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start"})]
    for u in updates:
        events += blocks.feed(u)
    events += blocks.close([])
    events += [
        ("message_delta", {"type": "message_delta"}),
        ("message_stop", {"type": "message_stop"}),
    ]
    check_event_order(events)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use", "tool_use"]
    assert starts[2]["id"] == "toolu_abc" and starts[2]["name"] == "get_weather"
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Let me think."
    assert [d["type"] for d in deltas].count("signature_delta") == 1
    assert [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"] == [
        '{"city": "Paris"}',
        "{}",
    ]


def test_omitted_thinking_keeps_the_block_and_its_signature_only() -> None:
    blocks = BlockStream(Thinking(omitted=True))
    events = blocks.feed(SlotUpdate("Hi", 2, None, reasoning="secret"))
    events += blocks.close([])
    kinds = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert kinds == ["signature_delta", "text_delta"]
    assert "secret" not in json.dumps(events)


def test_a_call_open_across_updates_ends_before_later_text() -> None:
    blocks = BlockStream(Thinking())
    events = blocks.feed(SlotUpdate("", 1, None, tool_events=(ToolCallStart(0, "call_a", "f"),)))
    # Its arguments arrive merged with the text that followed the call.
    events += blocks.feed(
        SlotUpdate("after", 2, None, tool_events=(ToolCallArgs(0, '{"x": 1}'), ToolCallEnd(0)))
    )
    events += blocks.close([])
    deltas = [(d["index"], d["delta"]) for n, d in events if n == "content_block_delta"]
    assert deltas == [
        (0, {"type": "input_json_delta", "partial_json": '{"x": 1}'}),
        (1, {"type": "text_delta", "text": "after"}),
    ]

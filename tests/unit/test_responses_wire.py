"""Responses input items -> stored items -> the chat messages the template renders."""

from __future__ import annotations

import pytest

from mlxcel.http.responses_wire import (
    chat_messages,
    generation_request,
    input_items,
    parse_body,
)
from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import ChatPrompt, ForcedToolCall, JsonSchemaFormat

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def test_history_items_become_chat_turns() -> None:
    items = input_items(
        [
            {"role": "developer", "content": "Rules."},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "two"}],
            },
        ]
    )
    assert all(item["id"] for item in items)
    assert chat_messages(items) == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "Calling.",
            "reasoning_content": "think",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                {"id": "c2", "type": "function", "function": {"name": "f", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


def test_request_fields_map_onto_the_generation_request() -> None:
    body = parse_body(
        {
            "input": "hi",
            "instructions": "Be brief.",
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": False,
            "max_output_tokens": 7,
            "reasoning": {"effort": "low"},
            "top_logprobs": 3,
            "prompt_cache_key": "tenant",
        }
    )
    gen = generation_request(body, "resp_1", input_items(body.input))
    assert isinstance(gen.prompt, ChatPrompt)
    assert gen.prompt.messages[0] == {"role": "system", "content": "Be brief."}
    assert gen.prompt.tools == (
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    )
    assert gen.constraint == ForcedToolCall(names=("f",), parallel=False)
    assert gen.max_tokens == 7 and gen.logprobs == 3 and gen.cache_key == "tenant"
    assert dict(gen.prompt.template_kwargs) == {"reasoning_effort": "low"}
    off = parse_body({"input": "hi", "reasoning": {"effort": "none"}})
    gen = generation_request(off, "resp_2", input_items(off.input))
    assert gen.thinking_budget == 0
    schema = parse_body(
        {
            "input": "hi",
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
        }
    )
    gen = generation_request(schema, "resp_3", input_items(schema.input))
    assert gen.constraint == JsonSchemaFormat(schema_json='{"type": "object"}', strict=False)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        (
            {"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}},
            "tool_choice",
        ),
        (
            {
                "input": "x",
                "tools": [TOOL],
                "tool_choice": "required",
                "text": {"format": {"type": "json_schema", "name": "n", "schema": {}}},
            },
            "tool_choice",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
        # Fields accepted before and then left unused: each is a 400 naming it now.
        ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
        ({"input": "x", "stream": True, "stream_options": {"foo": 1}}, "stream_options.foo"),
        (
            {"input": "x", "stream_options": {"include_obfuscation": "no"}},
            "stream_options.include_obfuscation",
        ),
        ({"input": "x", "tools": [{**TOOL, "cache_control": {}}]}, "tools[0].cache_control"),
    ],
)
def test_bad_fields_are_named(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        parsed = parse_body(body)
        generation_request(parsed, "resp_x", input_items(parsed.input))
    assert error.value.param == param


def test_the_openai_defaults_of_those_fields_are_accepted() -> None:
    body = parse_body(
        {
            "input": "x",
            "text": {"verbosity": "medium"},
            "stream": True,
            "stream_options": {"include_obfuscation": False},
            "tools": [{**TOOL, "strict": True}],
        }
    )
    gen = generation_request(body, "resp_y", input_items(body.input))
    assert gen.prompt.tools is not None

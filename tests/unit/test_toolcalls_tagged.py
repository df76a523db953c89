"""Qwen3-Coder, GLM-4.5, DeepSeek V3.1 and Kimi K2 tool calls, as those models write them.

Same property as test_toolcalls: every chunking gives the non-streaming result, what is not a
whole valid call is content. Qwen3-Coder and GLM write arguments as raw text, so the JSON types
come from the tools' schemas (as vLLM's qwen3_coder and glm45 parsers read them).
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxcel.actors.toolcalls import (
    Event,
    TextDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    ToolFormat,
    detect,
)
from mlxcel.actors.toolcalls.sections import kimi_history_ids
from tests.unit.test_toolcalls import assert_chunking_invariant, call, complete

Q, Z, D, K = ToolFormat.QWEN3_CODER, ToolFormat.GLM45, ToolFormat.DEEPSEEK_V31, ToolFormat.KIMI_K2
D3 = ToolFormat.DEEPSEEK_V3

TOOLS: list[dict[str, object]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "scale": {"type": "number"},
                    "hourly": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "hours": {"type": "array"},
                    "note": {"type": ["string", "null"]},
                    "zip": {"type": "string"},
                    "mode": {"enum": ["fast", "true"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    },
]
CODE = "def f():\n    return {'a': '</tool_call>'}  # <parameter=x>\n"


VALID: list[tuple[ToolFormat, str, str | None, list[ToolCall]]] = [
    # Qwen3-Coder-30B-A3B-Instruct: prose first, then a call with one newline around each value
    (
        Q,
        "I'll check the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "San Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
        "</tool_call>",
        "I'll check the weather.",
        [call(0, "get_weather", {"city": "San Francisco", "days": 3})],
    ),
    # every schema type, as vLLM converts them; an integer that does not parse stays text
    (
        Q,
        "<tool_call>\n<function=get_weather>\n<parameter=scale>\n2.5\n</parameter>\n"
        "<parameter=days>\nseven\n</parameter>\n<parameter=hourly>\nTrue\n</parameter>\n"
        '<parameter=opts>\n{"a": [1, null]}\n</parameter>\n<parameter=hours>\n[6, 12]\n'
        "</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=zip>\n01234\n"
        "</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>",
        None,
        [
            call(
                0,
                "get_weather",
                {
                    "scale": 2.5,
                    "days": "seven",
                    "hourly": True,
                    "opts": {"a": [1, None]},
                    "hours": [6, 12],
                    "note": None,
                    "zip": "01234",
                    "extra": "42",
                },
            )  # fmt: skip
        ],
    ),
    # a file written raw: newlines, quotes, braces, even the call's own tags, kept exactly
    (
        Q,
        "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
        f"<parameter=content>\n{CODE}\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "</function>\n</tool_call>",
        None,
        [
            call(0, "write_file", {"path": "src/a.py", "content": CODE}),
            call(1, "get_weather", {"city": "Oslo"}),
        ],
    ),
    # stopped right before </tool_call> (it is a stop token): the call is whole
    (
        Q,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
        None,
        [call(0, "get_weather", {"city": "Paris"})],
    ),
    # GLM-4.5: the name on the first line, string values raw, others JSON
    (
        Z,
        "Let me look that up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "<arg_key>zip</arg_key>\n<arg_value>01234</arg_value>\n</tool_call>",
        "Let me look that up.",
        [call(0, "get_weather", {"city": "Beijing", "days": 3, "zip": "01234"})],
    ),
    # objects as JSON or Python literals, an untyped enum value decoded, an unknown key too;
    # GLM-4.7 writes no newlines between the tags
    (
        Z,
        "<tool_call>get_weather<arg_key>opts</arg_key><arg_value>{'a': True}</arg_value>"
        "<arg_key>mode</arg_key><arg_value>fast</arg_value><arg_key>hours</arg_key>"
        "<arg_value>[1, 2]</arg_value><arg_key>hourly</arg_key><arg_value>false</arg_value>"
        "</tool_call>\n<tool_call>write_file\n<arg_key>content</arg_key>\n"
        f"<arg_value>{CODE}</arg_value>\n</tool_call>",
        None,
        [
            call(
                0,
                "get_weather",
                {"opts": {"a": True}, "mode": "fast", "hours": [1, 2], "hourly": False},
            ),
            call(1, "write_file", {"content": CODE.strip()}),
        ],
    ),  # fmt: skip
    (Z, "<tool_call>now\n</tool_call>", None, [call(0, "now", {})]),
    # DeepSeek V3.1: parallel calls in one section, prose before
    (
        D,
        "Checking both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>write_file'
        '<｜tool▁sep｜>{"path": "x}.txt", "content": "<｜tool▁call▁end｜>"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>",
        "Checking both.",
        [
            call(0, "get_weather", {"city": "Paris", "days": 2}),
            call(1, "write_file", {"path": "x}.txt", "content": "<｜tool▁call▁end｜>"}),
        ],
    ),
    (
        D,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
        None,
        [call(0, "now", {})],
    ),
    # DeepSeek V3-0324 / R1: the type and name before the fence, the arguments in it, calls
    # apart by a newline (as the template writes them), a fence inside a string
    (
        D3,
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
        'function<｜tool▁sep｜>write_file\n```json\n{"path": "a.md", "content": "```json x"}'
        "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Checking.",
        [
            call(0, "get_weather", {"city": "Paris", "days": 2}),
            call(1, "write_file", {"path": "a.md", "content": "```json x"}),
        ],
    ),
    (
        D3,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```"
        "<｜tool▁call▁end｜>",
        None,
        [call(0, "now", {})],
    ),
    # Kimi K2: the calls get the API's ids, not the model's functions.NAME:IDX (the prompt
    # restores those; see test_kimi_history_ids)
    (
        K,
        "I'll check.<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>\n'
        '<|tool_call_begin|>functions.math.sqrt:1<|tool_call_argument_begin|>{"x": 2}'
        "<|tool_call_end|>\n<|tool_calls_section_end|>",
        "I'll check.",
        [
            call(0, "get_weather", {"city": "Paris"}),
            call(1, "math.sqrt", {"x": 2}),
        ],
    ),
    # the singular section spelling Kimi K2 sometimes writes
    (
        K,
        "<|tool_call_section_begin|><|tool_call_begin|>functions.now:3"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_call_section_end|>",
        None,
        [call(0, "now", {})],
    ),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), VALID)
def test_recorded_calls_parse_identically_in_every_chunking(
    fmt: ToolFormat, text: str, content: str | None, calls: list[ToolCall]
) -> None:
    assert complete(fmt, text, TOOLS) == (content, calls)
    events = assert_chunking_invariant(fmt, text, TOOLS)
    tool_events = [e for e in events if not isinstance(e, TextDelta)]
    expected: list[Event] = []
    for i, c in enumerate(calls):
        expected += [ToolCallStart(i, c.id, c.name), ToolCallArgs(i, c.arguments), ToolCallEnd(i)]
    assert tool_events == expected


MALFORMED: list[tuple[ToolFormat, str]] = [
    (Q, "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),  # max_tokens
    (Q, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"),
    (Q, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'),  # Hermes
    (Q, "<tool_call>\n<function=f>\n<param=x>\n1\n</param>\n</function>\n</tool_call>"),
    (Q, "<tool_call>\n<function=f>\n</function>\n</tool> and more"),
    (Q, "<tool_call>\n</tool_call>"),
    (Z, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"),
    (Z, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'),
    (Z, "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>"),
    (Z, "<tool_call>get_weather\n<arg_value>Paris</arg_value>\n</tool_call>"),
    (Z, "<tool_call>"),
    (D, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": '),
    (D, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"),
    (D, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{} trailing"
        "<｜tool▁calls▁end｜>"),
    (D, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>two words<｜tool▁sep｜>{}<｜tool▁call▁end｜>"),
    (D, "<｜tool▁calls▁begin｜>plain text"),
    (D3, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": "),
    # V3.1's syntax
    (D3, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>"),
    (D3, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n"
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),  # the fence not closed
    (K, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f<|tool_call_argument_begin|>"
        "{}<|tool_call_end|><|tool_calls_section_end|>"),  # no index
    (K, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '{"x": NaN}<|tool_call_end|><|tool_calls_section_end|>'),
    (K, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_malformed_output_comes_back_as_content(fmt: ToolFormat, text: str) -> None:
    assert complete(fmt, text, TOOLS) == (text, [])
    assert_chunking_invariant(fmt, text, TOOLS)


def test_without_the_tools_raw_values_stay_text() -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n"
        "</tool_call>"
    )
    assert complete(Q, text) == (None, [call(0, "get_weather", {"days": "3"})])
    assert complete(Q, text, TOOLS) == (None, [call(0, "get_weather", {"days": 3})])


def test_repeated_kimi_ids_are_replaced_by_fresh_ones() -> None:
    one = "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    text = f"<|tool_calls_section_begin|>{one}{one}<|tool_calls_section_end|>"
    _, calls = complete(K, text)
    assert [c.id for c in calls] == ["call_0", "call_1"]


# The lines of each family's published chat template that name its syntax.
QWEN3_CODER_TEMPLATE = (
    "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{{- '<parameter=' + args_name + '>\\n' }}"
)
GLM45_TEMPLATE = (
    "<tool_call>{function-name}\\n<arg_key>{arg-key-1}</arg_key>\\n"
    "<arg_value>{arg-value-1}</arg_value>"
)
DEEPSEEK_V31_TEMPLATE = (
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + "
    "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
)
DEEPSEEK_V3_TEMPLATE = (
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments']}}"
)
KIMI_K2_TEMPLATE = (
    "<|tool_calls_section_begin|>{%- for tool_call in message['tool_calls'] -%}"
    "<|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>"
)


@pytest.mark.parametrize(
    ("template", "vocab", "expected"),
    [
        (QWEN3_CODER_TEMPLATE, {"<tool_call>": 151657}, Q),  # not Hermes, despite <tool_call>
        (GLM45_TEMPLATE, {"<tool_call>": 151352}, Z),
        (DEEPSEEK_V31_TEMPLATE, {"<｜tool▁calls▁begin｜>": 128806}, D),
        (DEEPSEEK_V3_TEMPLATE, None, D3),  # the ```json fence: V3-0324 and R1
        (KIMI_K2_TEMPLATE, None, K),
        (None, {"<tool_call>": 151352, "<arg_key>": 151356}, Z),
        (None, {"<|tool_calls_section_begin|>": 163595}, K),
    ],
)
def test_detect(template: str | None, vocab: dict[str, int] | None, expected: Any) -> None:
    assert detect(template, vocab) is expected


def test_kimi_history_ids_count_calls_across_the_conversation() -> None:
    """Whatever ids the client kept, Kimi's template reads functions.NAME:IDX with IDX counting
    calls over the whole conversation, and each result points at its call."""

    def calls(*pairs: tuple[str, str]) -> dict[str, Any]:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": "{}"}}
            for i, n in pairs]}  # fmt: skip

    messages = [
        {"role": "user", "content": "Weather in Oslo and Paris?"},
        calls(("toolu_a", "get_weather"), ("toolu_b", "get_weather")),
        {"role": "tool", "tool_call_id": "toolu_b", "content": "Paris: rain"},
        {"role": "tool", "tool_call_id": "toolu_a", "content": "Oslo: sun"},
        calls(("call_c", "now")),
        {"role": "tool", "tool_call_id": "call_c", "content": "noon"},
        {"role": "tool", "tool_call_id": "call_unknown", "content": "kept as sent"},
    ]
    out = kimi_history_ids(messages)
    assert [c["id"] for c in out[1]["tool_calls"]] == [
        "functions.get_weather:0",
        "functions.get_weather:1",
    ]
    assert [m.get("tool_call_id") for m in out[2:4]] == [
        "functions.get_weather:1",
        "functions.get_weather:0",
    ]
    assert out[4]["tool_calls"][0]["id"] == "functions.now:2"
    assert out[5]["tool_call_id"] == "functions.now:2"
    assert out[6]["tool_call_id"] == "call_unknown"
    assert messages[1]["tool_calls"][0]["id"] == "toolu_a"  # the request is not changed

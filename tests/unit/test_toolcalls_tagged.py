"""Qwen3-Coder tool calls, as the model writes them.

Same property as test_toolcalls: every chunking gives the non-streaming result, what is not a
whole valid call is content. Qwen3-Coder writes arguments as raw text, so the JSON types
come from the tools' schemas (as vLLM's qwen3_coder parser reads them).
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
from tests.unit.test_toolcalls import assert_chunking_invariant, call, complete

Q = ToolFormat.QWEN3_CODER

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


# The lines of each family's published chat template that name its syntax.
QWEN3_CODER_TEMPLATE = (
    "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{{- '<parameter=' + args_name + '>\\n' }}"
)


@pytest.mark.parametrize(
    ("template", "vocab", "expected"),
    [
        (QWEN3_CODER_TEMPLATE, {"<tool_call>": 151657}, Q),  # not Hermes, despite <tool_call>
    ],
)
def test_detect(template: str | None, vocab: dict[str, int] | None, expected: Any) -> None:
    assert detect(template, vocab) is expected

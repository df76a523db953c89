"""gpt-oss's harmony channels end to end: a tiny random-weight model whose vocabulary has the
harmony special tokens (``<|call|>`` and ``<|return|>`` end generation, as in gpt-oss) and whose
template is written from openai/gpt-oss-20b's, served for real, through the openai and
anthropic SDKs.

The model's analysis must come out as reasoning on every API family (``reasoning_content``,
thinking blocks, reasoning items), its final message as content and its calls as calls, with no
harmony marker anywhere, streamed exactly as not streamed; an earlier call with its reasoning
and result must reach the prompt as the template writes them. (The family's shared checks are in
test_tool_formats.py.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from mlxcel.actors.toolcalls.harmony import CALL, RETURN
from mlxcel.actors.toolcalls.harmony import TOKENS as HARMONY_TOKENS
from tests.conftest import ServerProcess
from tests.e2e.test_tool_formats import _client
from tests.support.templates import GPT_OSS_TOOLS
from tests.support.tiny_model import build_tiny_model

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER},
    }
]
CLAUDE_TOOLS: list[Any] = [{"name": "get_weather", "input_schema": WEATHER}]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = build_tiny_model(
        tmp_path_factory.mktemp("gpt_oss") / "gpt_oss",
        chat_template=GPT_OSS_TOOLS,
        special_tokens=HARMONY_TOKENS,
        eos_tokens=(CALL, RETURN),
    )
    proc = ServerProcess(["-m", str(model), "--parallel", "2"])
    yield proc
    proc.stop()


def _clean(*texts: str | None) -> None:
    for text in texts:
        assert "<|" not in (text or ""), text


def test_a_forced_call_after_thinking_streams_the_same_on_every_family(
    server: ServerProcess,
) -> None:
    """Greedy random weights take the grammar's analysis message to its bound, then call: the
    analysis is reasoning and the call a call, streamed and not, on chat, Anthropic and
    Responses (each family's prompt differs a little: each is compared with itself)."""
    chat: dict[str, Any] = {
        "model": "default",
        "messages": ASK,
        "max_tokens": 2000,
        "temperature": 0,
        "tools": TOOLS,
        "tool_choice": "required",
    }
    with _client(server) as client:
        whole = client.chat.completions.create(**chat)
        chunks = list(client.chat.completions.create(**chat, stream=True))
    message = whole.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert reasoning and message.content is None
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), WEATHER)
    _clean(reasoning)
    streamed_reasoning, streamed_content, streamed_args = "", "", ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        streamed_reasoning += getattr(delta, "reasoning_content", None) or ""
        streamed_content += delta.content or ""
        for d in delta.tool_calls or []:
            streamed_args += (d.function and d.function.arguments) or ""
    assert (streamed_reasoning, streamed_content, streamed_args) == (reasoning, "", calls[0][1])

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    kw: dict[str, Any] = {
        "model": "default",
        "max_tokens": 2000,
        "extra_body": {"temperature": 0},
        "messages": ASK,
        "tools": CLAUDE_TOOLS,
        "tool_choice": {"type": "any"},
    }
    with claude:
        answer = claude.messages.create(**kw)
        events = list(claude.messages.create(**kw, stream=True))
    assert [b.type for b in answer.content] == ["thinking", "tool_use"]
    assert answer.stop_reason == "tool_use"
    thinking, use = answer.content
    assert thinking.type == "thinking" and thinking.thinking
    assert use.type == "tool_use" and use.name == "get_weather"
    _clean(thinking.thinking)
    thought = "".join(
        e.delta.thinking
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert (thought, json.loads(partial)) == (thinking.thinking, use.input)

    rkw: dict[str, Any] = {
        "model": "default",
        "input": ASK[0]["content"],
        "max_output_tokens": 2000,
        "temperature": 0,
        "tools": [{"type": "function", **TOOLS[0]["function"]}],
        "tool_choice": "required",
        "store": False,
    }
    with _client(server) as client:
        response = client.responses.create(**rkw)
        stream = list(client.responses.create(**rkw, stream=True))
    assert [i.type for i in response.output] == ["reasoning", "function_call"]
    item, call = response.output
    assert item.type == "reasoning" and call.type == "function_call"
    thought = "".join(c.text for c in item.content or [])
    assert thought and call.name == "get_weather"
    _clean(thought)
    assert "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta") == (
        thought
    )
    args = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments


# The model's own framing around its answer, written by a client grammar (random weights never
# keep to harmony otherwise), its markers the special tokens.
FINAL = (
    'start: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant" '
    '<|channel|> "final" <|message|> ANSWER <|end|>\n'
    "THOUGHT: /[a-z]{3,8}( [a-z]{3,8}){2,5}/\n"
    "ANSWER: /[A-Z][a-z]{3,8}( [a-z]{3,8}){2,5}/\n"
)


def test_the_final_channel_is_content_and_the_analysis_reasoning(server: ServerProcess) -> None:
    body: dict[str, Any] = {
        "model": "default",
        "messages": ASK,
        "max_tokens": 200,
        "seed": 7,
        "logprobs": True,
        "extra_body": {"grammar": FINAL},
    }
    with _client(server) as client:
        whole = client.chat.completions.create(**body)
        chunks = list(client.chat.completions.create(**body, stream=True))
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    raw = b"".join(bytes(t.bytes or []) for t in choice.logprobs.content).decode()
    m = re.fullmatch(
        r"<\|channel\|>analysis<\|message\|>(.*)<\|end\|><\|start\|>assistant"
        r"<\|channel\|>final<\|message\|>(.*)<\|end\|>",
        raw,
    )
    assert m is not None, raw
    assert getattr(choice.message, "reasoning_content", None) == m.group(1)
    assert choice.message.content == m.group(2)
    streamed = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in streamed) == m.group(1)
    assert "".join(d.content or "" for d in streamed) == m.group(2)


def test_an_earlier_call_its_reasoning_and_result_render_as_the_template_writes_them(
    server: ServerProcess,
) -> None:
    """The call turn's reasoning (reasoning_content on chat, a thinking block on Anthropic)
    reaches the template as its analysis message; an earlier answer's reasoning is dropped, as
    the template does; the next turn is served."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages: list[Any] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "OLD THOUGHT"},
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Look it up.",
            "tool_calls": [call],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "RESULT: sunny"},
    ]
    prompt = httpx.post(
        f"{server.base_url}/apply-template", json={"messages": messages, "tools": TOOLS}
    ).json()["prompt"]
    assert "OLD THOUGHT" not in prompt
    assert prompt.endswith(
        "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
        "<|start|>user<|message|>What is the weather in Oslo?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Oslo"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '"RESULT: sunny"<|end|><|start|>assistant'
    ), prompt
    with _client(server) as client:
        r = client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, tool_choice="required",
            max_tokens=200, seed=5, extra_body={"thinking_budget_tokens": 0},
        )  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    turn: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look it up.", "signature": "x"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "RESULT: sunny"}]},
    ]  # fmt: skip
    with claude:
        answer = claude.messages.create(
            model="default", max_tokens=200, messages=turn, extra_body={"seed": 5},
            tools=CLAUDE_TOOLS,
            tool_choice={"type": "any"}, thinking={"type": "disabled"},
        )  # fmt: skip
        counted = claude.messages.count_tokens(model="default", messages=turn, tools=CLAUDE_TOOLS)
    assert answer.stop_reason == "tool_use"
    assert [b.type for b in answer.content] == ["tool_use"]
    # The thinking block is in the prompt: without it the count is smaller.
    plain = [turn[0], {**turn[1], "content": turn[1]["content"][1:]}, turn[2]]
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        fewer = c.messages.count_tokens(model="default", messages=plain, tools=CLAUDE_TOOLS)
    assert fewer.input_tokens < counted.input_tokens

    # Responses: a reasoning item before the call reaches the prompt too.
    def items(thought: list[Any]) -> list[Any]:
        return [
            {"role": "user", "content": ASK[0]["content"]},
            *thought,
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "RESULT: sunny"},
        ]  # fmt: skip

    reasoning_item = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Look it up in the weather service."}],
    }
    rkw: dict[str, Any] = {"model": "default", "max_output_tokens": 16, "store": False}
    with _client(server) as client:
        with_thought = client.responses.create(**rkw, input=items([reasoning_item]))
        without = client.responses.create(**rkw, input=items([]))
    assert with_thought.usage and without.usage
    assert with_thought.usage.input_tokens > without.usage.input_tokens


CALL_MESSAGE = (
    'start: <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
    '"{\\"city\\": \\"Oslo\\"}" <|call|>\n'
)


@pytest.mark.parametrize("tools", [None, "none"])
def test_a_call_nobody_parses_is_content_without_markup(
    server: ServerProcess, tools: str | None
) -> None:
    """No tools offered, or ``tool_choice: none``: a call the model writes anyway comes back as
    its arguments in content, never as harmony markup, streamed and not."""
    body: dict[str, Any] = {
        "model": "default",
        "messages": ASK,
        "max_tokens": 50,
        "extra_body": {"grammar": CALL_MESSAGE},
    }
    if tools:
        body |= {"tools": TOOLS, "tool_choice": tools}
    with _client(server) as client:
        whole = client.chat.completions.create(**body)
        chunks = list(client.chat.completions.create(**body, stream=True))
    choice = whole.choices[0]
    assert choice.message.content == '{"city": "Oslo"}'
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content

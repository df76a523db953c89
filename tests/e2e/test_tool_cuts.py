"""A tool call that max_tokens cuts, on the default model's generic tool format: every family
says plainly that the budget cut it and shows the call as far as it got, never the format's
raw wrapper JSON as text (OpenAI: the partial ``tool_calls`` entry and ``finish_reason:
"length"``; Anthropic: ``stop_reason: "max_tokens"`` and the tool_use block; Responses:
``incomplete`` with the partial function_call item)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import ServerProcess

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": WEATHER}},
]  # fmt: skip
# On this model, greedy, this question starts a call under `auto` too.
ASK: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
# Enough for the wrapper and the name, not for the arguments.
CUT = 20


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess([])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                       timeout=120, _strict_response_validation=True) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0,
                             timeout=120) as c:  # fmt: skip
        yield c


def assert_cut(arguments: str) -> None:
    """The arguments JSON as far as it got: an object begun, not finished."""
    assert arguments.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_chat_shows_the_cut_call_streamed_or_not(client: openai.OpenAI, choice: str) -> None:
    args: dict[str, Any] = {"model": "default", "messages": ASK, "tools": TOOLS,
                            "tool_choice": choice, "max_tokens": CUT, "temperature": 0}  # fmt: skip
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "length"
    assert not whole.message.content  # no {"tool_call": ... wrapper as text
    calls = whole.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert_cut(calls[0].function.arguments)

    text, streamed, finish = "", {}, None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += (d.function and d.function.name) or ""
                entry["arguments"] += (d.function and d.function.arguments) or ""
            finish = c.finish_reason or finish
    assert finish == "length" and not text
    assert list(streamed) == [0] and streamed[0]["id"].startswith("call_")
    assert streamed[0]["name"] == "get_weather"
    assert streamed[0]["arguments"] == calls[0].function.arguments


def test_anthropic_says_max_tokens_and_shows_the_tool_use(claude: anthropic.Anthropic) -> None:
    args: dict[str, Any] = {
        "model": "default",
        "max_tokens": CUT,
        "messages": ASK,
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "any"},
        "extra_body": {"temperature": 0},
    }
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "max_tokens"
        assert [b.type for b in message.content] == ["tool_use"]  # no raw JSON text block
        use = message.content[0]
        assert use.type == "tool_use" and use.name == "get_weather"
        assert use.id.startswith("toolu_") and isinstance(use.input, dict)
    # The SDK reads the cut input_json_delta in partial mode; the server reads its own the same
    # way, so the two agree.
    assert whole.content[0].input == streamed.content[0].input  # type: ignore[union-attr]
    kinds = [e.type for e in events]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert_cut(partial)


def test_responses_is_incomplete_with_the_partial_function_call(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "default",
        "input": "Weather in Paris?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER,
                   "strict": False}],
        "tool_choice": "required",
        "max_output_tokens": CUT,
        "temperature": 0,
        "store": False,
    }  # fmt: skip
    r = client.responses.create(**args)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.status == "incomplete"
    assert_cut(call.arguments)
    deltas, final = "", None
    for event in client.responses.create(**args, stream=True):
        if event.type == "response.function_call_arguments.delta":
            deltas += event.delta
        if event.type == "response.incomplete":
            final = event.response
    assert final is not None and final.output[0].type == "function_call"
    assert deltas == final.output[0].arguments == call.arguments

"""Each current tool-call family end to end: a tiny random-weight model carrying that family's
chat template (tests/support/templates.py), served for real, called through the official
openai SDK.

Random weights never write a call on their own, so a forced call (``tool_choice: required``)
that comes back as ``tool_calls`` with schema-valid arguments shows the whole path: the format
detected from the template, the grammar in that format, and the parser reading it back. The
tokens the model wrote (``logprobs``) show the family's own syntax was used, and the streamed
deltas must assemble to exactly the non-streamed answer for the same seed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from mlxcel.actors.section_grammars import MAX_PARALLEL_CALLS
from mlxcel.actors.toolcalls.harmony import CALL, RETURN
from mlxcel.actors.toolcalls.harmony import TOKENS as HARMONY_TOKENS
from tests.conftest import ServerProcess
from tests.support.templates import (
    DEEPSEEK_V3_TOOLS,
    DEEPSEEK_V31_TOOLS,
    GLM45_TOOLS,
    GPT_OSS_TOOLS,
    KIMI_K2_TOOLS,
    QWEN3_CODER_TOOLS,
)
from tests.support.tiny_model import build_tiny_model

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": name, "description": f"The tool {name}.", "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]

# family -> (chat template, what the model's raw output holds for a get_weather call, and how
# the template writes an earlier call back into the next prompt)
FAMILIES = {
    "qwen3_coder": (
        QWEN3_CODER_TOOLS,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n",
        "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n",
    ),
    "glm45": (
        GLM45_TOOLS,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n",
    ),
    "deepseek_v31": (
        DEEPSEEK_V31_TOOLS,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{",
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "days": 2}',
    ),
    "deepseek_v3": (
        DEEPSEEK_V3_TOOLS,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{",
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Oslo", "days": 2}\n```<｜tool▁call▁end｜>',
    ),
    "kimi_k2": (
        KIMI_K2_TOOLS,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:",
        '<|tool_call_begin|>CALL_ID<|tool_call_argument_begin|>{"city": "Oslo", "days": 2}',
    ),
    # The forced call may think first (an analysis message); its call is in the model's own
    # spelling, the history in the template's.
    "gpt_oss": (
        GPT_OSS_TOOLS,
        "<|channel|>",
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Oslo", "days": 2}<|call|>',
    ),
}
# Families whose markers are special tokens of the tiny model's vocabulary (as in the real
# one), with those that end generation: gpt-oss stops on <|call|> and <|return|>.
SPECIAL_TOKENS = {"gpt_oss": (HARMONY_TOKENS, (CALL, RETURN))}
# The text of a forced call in each family's own syntax, once any thinking before it is done.
# Greedy decoding on random weights thinks to its limit: where a test needs a greedy call within
# a small budget, thinking is turned off (Anthropic thinking disabled, Responses effort none, a
# chat thinking budget of 0).
NO_THINKING = {
    "gpt_oss": (
        {"thinking": {"type": "disabled"}},
        {"reasoning": {"effort": "none"}},
        {"extra_body": {"thinking_budget_tokens": 0}},
    ),
}
CALL_TEXT = {
    "gpt_oss": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{",
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ServerProcess]]:
    name = request.param
    special, eos = SPECIAL_TOKENS.get(name, ((), ()))
    model = build_tiny_model(
        tmp_path_factory.mktemp(name) / name,
        chat_template=FAMILIES[name][0],
        special_tokens=special,
        eos_tokens=eos,
    )
    server = ServerProcess(["-m", str(model), "--parallel", "2"])
    yield name, server
    server.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        _strict_response_validation=True,
    )


def _forced(tool_choice: Any = "required", **kw: Any) -> dict[str, Any]:
    return {
        "model": "default",
        "messages": ASK,
        "max_tokens": 200,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        **kw,
    }


def test_a_forced_call_is_written_in_the_family_syntax_and_parsed(
    family: tuple[str, ServerProcess],
) -> None:
    name, server = family
    with _client(server) as client:
        r = client.chat.completions.create(
            **_forced({"type": "function", "function": {"name": "get_weather"}}),
            seed=3,
            logprobs=True,
        )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, WEATHER)
    assert isinstance(args["days"], int)  # typed by the schema, even where written as text
    assert choice.logprobs is not None and choice.logprobs.content
    # Token bytes, not token strings: DeepSeek's markers split inside UTF-8 characters.
    raw = b"".join(bytes(t.bytes or []) for t in choice.logprobs.content).decode()
    assert raw.startswith(FAMILIES[name][1]), raw
    if name in CALL_TEXT:
        assert CALL_TEXT[name] in raw, raw
    # OpenAI's id syntax on every family, Kimi's too (the model wrote functions.NAME:IDX).
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id), calls[0].id


@pytest.mark.parametrize("seed", [11, 12])
def test_streamed_deltas_assemble_to_exactly_the_non_streamed_calls(
    family: tuple[str, ServerProcess], seed: int
) -> None:
    _, server = family
    with _client(server) as client:
        whole = client.chat.completions.create(**_forced(), seed=seed)
        stream = client.chat.completions.create(**_forced(), seed=seed, stream=True)
        calls: dict[int, dict[str, str]] = {}
        content: list[str] = []
        finish = None
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content.append(delta.content or "")
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                if d.id:
                    assert not call["id"], "id only in the first delta of an index"
                    call["id"] = d.id
                if d.function and d.function.name:
                    call["name"] += d.function.name
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
            finish = chunk.choices[0].finish_reason or finish
    choice = whole.choices[0]
    assert choice.finish_reason == finish == "tool_calls"
    assert choice.message.content is None and "".join(content) == ""
    expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert expected
    for fn, arguments in expected:
        jsonschema.validate(json.loads(arguments), SCHEMAS[fn])


def test_an_earlier_call_and_its_result_render_through_the_family_template(
    family: tuple[str, ServerProcess],
) -> None:
    name, server = family
    call_id = "call_abc"
    messages: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "RESULT: sunny, 21 C"},
    ]
    # The prompt the model reads: the call in its own syntax (DeepSeek's template takes the
    # arguments as text, the others as an object), then the result.
    prompt = httpx.post(
        f"{server.base_url}/apply-template", json={"messages": messages, "tools": TOOLS}
    ).json()["prompt"]
    # Kimi reads its own id syntax whatever id the client kept (see the test below).
    written = FAMILIES[name][2].replace("CALL_ID", "functions.get_weather:0")
    assert written in prompt, prompt
    assert prompt.index(written) < prompt.index("RESULT: sunny, 21 C")
    # ... and the next turn, forced again, is served.
    with _client(server) as client:
        r = client.chat.completions.create(
            **{**_forced(), "messages": messages}, seed=5, parallel_tool_calls=False
        )
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls and len(r.choices[0].message.tool_calls) == 1


def test_anthropic_and_responses_streams_assemble_to_the_same_calls(
    family: tuple[str, ServerProcess],
) -> None:
    """Anthropic's ``input_json_delta`` and Responses' ``function_call_arguments.delta`` carry
    the same calls as their non-streamed answers (greedy, so both runs write the same)."""
    name, server = family
    quiet, rquiet, _ = NO_THINKING.get(name, ({}, {}, {}))
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    kw: dict[str, Any] = {
        "model": "default",
        "max_tokens": 200,
        "extra_body": {"temperature": 0},  # this SDK no longer takes it as an argument
        "messages": ASK,
        "tools": [
            {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
            for t in TOOLS
        ],
        # One call: greedy decoding on random weights may otherwise repeat calls to the end.
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        **quiet,
    }
    with claude:
        whole = claude.messages.create(**kw)
        events = list(claude.messages.create(**kw, stream=True))
    uses = [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
    assert uses and whole.stop_reason == "tool_use"
    streamed: list[tuple[str, str]] = []
    for e in events:
        if e.type == "content_block_start" and e.content_block.type == "tool_use":
            streamed.append((e.content_block.name, ""))
        elif e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            streamed[-1] = (streamed[-1][0], streamed[-1][1] + e.delta.partial_json)
    assert [(name, json.loads(args)) for name, args in streamed] == uses
    for name, args in uses:
        jsonschema.validate(args, SCHEMAS[name])

    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    rkw: dict[str, Any] = {
        "model": "default",
        "input": ASK[0]["content"],
        "max_output_tokens": 200,
        "temperature": 0,
        "tools": tools,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        **rquiet,
    }
    with _client(server) as client:
        response = client.responses.create(**rkw)
        stream_events = list(client.responses.create(**rkw, stream=True))
    calls = [(i.name, i.arguments) for i in response.output if i.type == "function_call"]
    assert calls
    deltas: dict[str, str] = {}
    for e in stream_events:
        if e.type == "response.function_call_arguments.delta":
            deltas[e.item_id] = deltas.get(e.item_id, "") + e.delta
    assert list(deltas.values()) == [args for _, args in calls]


def test_ids_look_like_each_family_and_round_trip(family: tuple[str, ServerProcess]) -> None:
    """Anthropic's ``toolu_`` ids and Responses' ``call_`` ids, whatever the model's own id
    syntax (Kimi K2 writes ``functions.NAME:IDX``); sent back with the result, they reach the
    template as the model's own syntax, and the next turn is served."""
    name, server = family
    quiet, rquiet, _ = NO_THINKING.get(name, ({}, {}, {}))
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    tools: list[Any] = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    kw: dict[str, Any] = {
        "model": "default",
        "max_tokens": 200,
        "extra_body": {"temperature": 0},
        "tools": tools,
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        **quiet,
    }
    with claude:
        first = claude.messages.create(**kw, messages=ASK)
        (use,) = [b for b in first.content if b.type == "tool_use"]
        # Anthropic's own pattern for tool_use ids.
        assert re.fullmatch(r"toolu_[A-Za-z0-9_-]+", use.id), use.id
        result = {"type": "tool_result", "tool_use_id": use.id, "content": "RESULT: sunny"}
        turn: list[Any] = [*ASK, {"role": "assistant", "content": first.content},
                           {"role": "user", "content": [result]}]  # fmt: skip
        second = claude.messages.create(**kw, messages=turn)
    assert second.stop_reason == "tool_use"
    # What that turn rendered: the same messages in OpenAI's shape, with the toolu_ id.
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "RESULT: sunny"},
    ]  # fmt: skip
    prompt = httpx.post(
        f"{server.base_url}/apply-template", json={"messages": messages, "tools": TOOLS}
    ).json()["prompt"]
    if name == "kimi_k2":
        assert use.id not in prompt
        assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in prompt
        assert "## Return of functions.get_weather:0\nRESULT: sunny" in prompt

    rkw: dict[str, Any] = {
        "model": "default",
        "max_output_tokens": 200,
        "temperature": 0,
        "tools": [{"type": "function", **t["function"]} for t in TOOLS],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "store": False,
        **rquiet,
    }
    with _client(server) as client:
        r = client.responses.create(**rkw, input=ASK[0]["content"])
        (call,) = [i for i in r.output if i.type == "function_call"]
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.call_id), call.call_id
        follow = client.responses.create(**rkw, input=[
            {"role": "user", "content": ASK[0]["content"]},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "RESULT: sunny"},
        ])  # fmt: skip
    assert [i.type for i in follow.output] == ["function_call"]


def test_parallel_forced_calls_end_at_the_cap_or_at_one(
    family: tuple[str, ServerProcess],
) -> None:
    """Forced calls end within a bound a client can see: at most MAX_PARALLEL_CALLS (greedy
    random weights in DeepSeek's format repeat calls until the grammar stops them, where they
    used to run to max_tokens), and exactly one when parallel calls are turned off, on every
    API family."""
    name, server = family
    with _client(server) as client:
        r = client.chat.completions.create(**_forced(max_tokens=2000), temperature=0)
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls"
        assert 1 <= len(calls) <= MAX_PARALLEL_CALLS
        if name == "deepseek_v31":
            assert len(calls) == MAX_PARALLEL_CALLS
        one = client.chat.completions.create(
            **_forced(max_tokens=2000), temperature=0, parallel_tool_calls=False
        )
        assert one.choices[0].finish_reason == "tool_calls"
        assert len(one.choices[0].message.tool_calls or []) == 1
        responses = client.responses.create(
            model="default", input=ASK[0]["content"], max_output_tokens=2000, temperature=0,
            tools=[{"type": "function", **t["function"]} for t in TOOLS],
            tool_choice="required", parallel_tool_calls=False, store=False,
        )  # fmt: skip
    # (gpt-oss thinks first: its analysis is a reasoning item, a thinking block)
    assert [i.type for i in responses.output if i.type != "reasoning"] == ["function_call"]
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    with claude:
        message = claude.messages.create(
            model="default", max_tokens=2000, extra_body={"temperature": 0}, messages=ASK,
            tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                   for t in TOOLS],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )  # fmt: skip
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content if b.type != "thinking"] == ["tool_use"]


def test_a_call_cut_by_max_tokens_shows_no_raw_format_text(
    family: tuple[str, ServerProcess],
) -> None:
    """max_tokens ending a forced call inside its arguments: finish_reason length, none of the
    format's markers as content, and (formats whose arguments are JSON text) the call as far
    as it got, streamed and not alike."""
    name, server = family
    one = _forced(
        {"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        **NO_THINKING.get(name, ({}, {}, {}))[2],
    )
    with _client(server) as client:
        full = client.chat.completions.create(**one, logprobs=True)
        assert full.choices[0].message.tool_calls and full.choices[0].logprobs
        whole_args = full.choices[0].message.tool_calls[0].function.arguments
        # Cut just after the second argument's name is written: inside the arguments.
        tokens = [bytes(t.bytes or []) for t in full.choices[0].logprobs.content or []]
        n = next(i for i in range(1, len(tokens)) if b"days" in b"".join(tokens[:i]))
        cut = {**one, "max_tokens": n}
        r = client.chat.completions.create(**cut)
        chunks = list(client.chat.completions.create(**cut, stream=True))
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_args = "".join(
        (d.function and d.function.arguments) or ""
        for c in chunks
        if c.choices
        for d in c.choices[0].delta.tool_calls or []
    )
    assert not streamed_text
    calls = choice.message.tool_calls or []
    if name in ("deepseek_v31", "deepseek_v3", "kimi_k2", "gpt_oss"):
        assert [c.function.name for c in calls] == ["get_weather"]
        args = calls[0].function.arguments
        assert whole_args.startswith(args) and args != whole_args
        assert streamed_args == args
    else:  # raw-text arguments: no JSON so far to show, and no markup either
        assert not calls and not streamed_args

"""Structured output, forced tool calls and the thinking budget, end to end.

The official openai SDK (strict response validation) against `mlxcel serve` with a tiny
random-weight model: random weights would never write valid JSON on their own, so output that
parses and validates shows the grammar constraint at work. Schemas keep strings short
(maxLength) so the random model finishes them well within max_tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.conftest import ServerProcess
from tests.support.templates import QWEN_THINKING, QWEN_TOOLS
from tests.support.tiny_model import build_tiny_model

ASK: list[Any] = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)


class GetWeather(pydantic.BaseModel):
    """Weather for a city."""

    city: str = pydantic.Field(max_length=10)
    days: int = pydantic.Field(ge=1, le=7)


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    )


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = build_tiny_model(tmp_path_factory.mktemp("qwen") / "qwen", chat_template=QWEN_TOOLS)
    server = ServerProcess(["-m", str(model), "--parallel", "4"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(tools_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with _client(tools_server) as c:
        yield c


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=200,
        seed=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_every_choice_of_n_follows_the_schema(client: openai.OpenAI) -> None:
    # Each of the n rows forked from one prefill carries its own matcher.
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=200,
        n=2,
        seed=3,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_streamed_json_schema_output_is_the_same_json(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    kw: dict[str, Any] = {"model": "default", "messages": ASK, "max_tokens": 200, "seed": 12}
    whole = client.chat.completions.create(response_format=fmt, **kw)
    chunks = list(client.chat.completions.create(response_format=fmt, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model="default", messages=ASK, max_tokens=200, seed=2, response_format=Person
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person)
    assert 0 <= parsed.age <= 120 and len(parsed.name) <= 8


def test_json_object_output_is_an_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=200,
        seed=3,
        response_format={"type": "json_object"},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content or ""), dict)


def _check_calls(calls: Any, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_yields_valid_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=300,
        seed=4,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, set(SCHEMAS))


def test_named_tool_choice_calls_that_tool(client: openai.OpenAI) -> None:
    for seed in (5, 6):
        r = client.chat.completions.create(
            model="default",
            messages=ASK,
            max_tokens=300,
            seed=seed,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls, {"get_time"})


def test_stream_helper_accumulates_forced_tool_calls(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model="default",
        messages=ASK,
        max_tokens=300,
        seed=7,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
    ) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    assert len(done) == len(choice.message.tool_calls)
    for call in choice.message.tool_calls:
        assert call.function.name == "GetWeather"
        assert isinstance(call.function.parsed_arguments, GetWeather)


def test_constrained_and_free_requests_share_the_batch(tools_server: ServerProcess) -> None:
    async def both() -> tuple[Any, Any]:
        async with openai.AsyncOpenAI(
            base_url=f"{tools_server.base_url}/v1", api_key="unused", max_retries=0
        ) as aclient:
            return await asyncio.gather(
                aclient.chat.completions.create(
                    model="default",
                    messages=ASK,
                    max_tokens=200,
                    seed=8,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "person", "schema": PERSON},
                    },
                ),
                aclient.chat.completions.create(
                    model="default",
                    messages=ASK,
                    max_tokens=60,
                    seed=8,
                    extra_body={"ignore_eos": True},
                ),
            )

    constrained, free = asyncio.run(both())
    jsonschema.validate(json.loads(constrained.choices[0].message.content), PERSON)
    assert free.choices[0].finish_reason == "length"
    assert free.usage.completion_tokens == 60
    # Unconstrained random weights do not happen to write JSON.
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_invalid_requests_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": PERSON},
                },
            },
            "response_format",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"extra_body": {"thinking_budget_tokens": -2}}, "thinking_budget_tokens"),
        ({"extra_body": {"reasoning_budget_tokens": "many"}}, "reasoning_budget_tokens"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="default", messages=ASK, max_tokens=5, **extra)
        assert info.value.param == param, extra


# --- thinking budget -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = build_tiny_model(
        tmp_path_factory.mktemp("qwen3") / "qwen3", chat_template=QWEN_THINKING
    )
    server = ServerProcess(["-m", str(model), "--parallel", "4"])
    yield server
    server.stop()


def _think(client: openai.OpenAI, budget: int) -> tuple[int | None, str, str]:
    """(tokens generated before the end-of-thinking marker or None, reasoning, answer)."""
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=60,
        seed=9,
        logprobs=True,
        extra_body={"thinking_budget_tokens": budget, "ignore_eos": True},
    )
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    pieces = [e.token for e in choice.logprobs.content]
    ends = [i for i in range(len(pieces)) if "".join(pieces[i:]).startswith("</think>")]
    message = choice.message.model_dump()
    return (
        ends[0] if ends else None,
        message.get("reasoning_content") or "",
        message["content"] or "",
    )


@pytest.fixture(scope="module")
def thinking_client(thinking_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with _client(thinking_server) as c:
        yield c


def test_thinking_budget_caps_the_reasoning(thinking_client: openai.OpenAI) -> None:
    client = thinking_client
    closed, unlimited, answer = _think(client, -1)
    # Unbounded, random weights never close the block within 60 tokens.
    assert closed is None and unlimited and not answer
    closed, reasoning, answer = _think(client, 5)
    # The same seed draws the same first five tokens; then the marker is forced.
    assert closed == 5 and unlimited.startswith(reasoning) and reasoning
    assert answer.strip(), "no answer after the forced end of thinking"
    closed, reasoning, answer = _think(client, 0)
    assert closed == 0 and reasoning == "" and answer.strip()


def _control(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions/control", json=body, timeout=30)


def test_reasoning_control_ends_the_thinking_of_a_running_stream(
    thinking_client: openai.OpenAI, thinking_server: ServerProcess
) -> None:
    stream = thinking_client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=80,
        seed=9,
        stream=True,
        extra_body={"reasoning_control": True, "ignore_eos": True},
    )
    reasoning, answer, answer_at = [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        answer.append(delta.content or "")
        if len([r for r in reasoning if r]) == 5 and answer_at is None:
            answer_at = len(reasoning)
            r = _control(thinking_server, {"id": chunk.id, "action": "reasoning_end"})
            assert r.status_code == 200 and r.json() == {"success": True}
    # Unbounded, these random weights never close the block in 80 tokens (see above, and the
    # unarmed stream below): the answer that follows is the control's doing. (Chunks the
    # client had not read yet when it asked, and the forced marker's, come between.)
    assert answer_at is not None and "".join(answer).strip()
    first_answer = next(i for i, a in enumerate(answer) if a)
    assert answer_at < first_answer < len(answer) - 20
    assert not any(reasoning[first_answer:])


def test_reasoning_control_refusals(
    thinking_client: openai.OpenAI, thinking_server: ServerProcess
) -> None:
    stream = thinking_client.chat.completions.create(
        model="default", messages=ASK, max_tokens=60, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(c for c in stream if c.choices)
    # Not armed: refused, and the stream thinks on undisturbed.
    r = _control(thinking_server, {"id": first.id, "action": "reasoning_end"})
    assert r.status_code == 200 and r.json()["success"] is False
    assert "reasoning_control" in r.json()["message"]
    assert not "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    r = _control(thinking_server, {"id": "chatcmpl-nope", "action": "reasoning_end"})
    assert r.json()["success"] is False
    for body, param, message in [
        ({"action": "reasoning_end"}, "id", "missing completion id"),
        ({"id": first.id, "action": "explode"}, "action", "unknown control action"),
    ]:
        r = _control(thinking_server, body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and message in error["message"]


def test_reasoning_control_on_a_native_completion(thinking_server: ServerProcess) -> None:
    # A raw prompt that opens the thinking block. Native output carries only the answer, so
    # the id comes from /slots (`id_task`) while the request runs.
    base = thinking_server.base_url
    prompt = "<|im_start|>user\nDescribe a person.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    body = {"prompt": prompt, "n_predict": 300, "ignore_eos": True, "seed": 9}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        plain = pool.submit(httpx.post, f"{base}/completion", json=body, timeout=60)
        armed = pool.submit(
            httpx.post, f"{base}/completion", json={**body, "reasoning_control": True}, timeout=60
        )
        tasks: list[str] = []
        deadline = time.monotonic() + 30
        while len(tasks) < 2:
            assert time.monotonic() < deadline, "the two requests never ran together"
            tasks = [s["id_task"] for s in httpx.get(f"{base}/slots").json() if s["is_processing"]]
        replies = [_control(thinking_server, {"id": t, "action": "reasoning_end"}) for t in tasks]
        plain_answer, armed_answer = plain.result().json(), armed.result().json()
    # Only the armed request was steered: it answers; the other thought to the end.
    assert sorted(r.json()["success"] for r in replies) == [False, True]
    assert armed_answer["content"].strip() and not plain_answer["content"].strip()


def test_json_schema_starts_after_thinking(thinking_client: openai.OpenAI) -> None:
    r = thinking_client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=300,
        seed=10,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        extra_body={"thinking_budget_tokens": 8},
    )
    message = r.choices[0].message.model_dump()
    assert message.get("reasoning_content")
    jsonschema.validate(json.loads(message["content"]), PERSON)


def test_server_default_budget_flag(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "qwen3", chat_template=QWEN_THINKING)
    server = ServerProcess(["-m", str(model), "--reasoning-budget", "0"])
    try:
        with _client(server) as client:
            closed, _, _ = _think(client, -1)
            r = client.chat.completions.create(model="default", messages=ASK, max_tokens=20, seed=9)
            # The flag is the default of the Anthropic and Responses routes too.
            anthropic = httpx.post(
                f"{server.base_url}/v1/messages",
                json={"max_tokens": 20, "messages": ASK},
                timeout=60,
            ).json()
            responses = httpx.post(
                f"{server.base_url}/v1/responses",
                json={"max_output_tokens": 20, "input": "Describe a person.", "store": False},
                timeout=60,
            ).json()
        assert closed is None  # the request's -1 wins over the flag
        assert not r.choices[0].message.model_dump().get("reasoning_content")
        assert r.choices[0].message.content
        assert [b["type"] for b in anthropic["content"]] == ["text"]
        assert [o["type"] for o in responses["output"]] == ["message"]
    finally:
        server.stop()


def test_native_completion_json_schema_and_gbnf_grammar(tools_server: ServerProcess) -> None:
    url = f"{tools_server.base_url}/completion"
    base = {"prompt": "Answer:", "n_predict": 200, "seed": 11}
    r = httpx.post(url, json={**base, "json_schema": PERSON}, timeout=120)
    assert r.status_code == 200
    jsonschema.validate(json.loads(r.json()["content"]), PERSON)
    gbnf = 'root ::= answer " " answer\nanswer ::= "yes" | "no"'
    r = httpx.post(url, json={**base, "grammar": gbnf}, timeout=120)
    assert r.status_code == 200 and r.json()["stop_type"] == "eos"
    assert r.json()["content"] in {f"{a} {b}" for a in ("yes", "no") for b in ("yes", "no")}
    for bad, param in (
        ({"grammar": 'root ::= "unclosed'}, "grammar"),
        ({"json_schema": {"type": "objekt"}}, "json_schema"),
        ({"json_schema": PERSON, "grammar": gbnf}, "grammar"),
    ):
        r = httpx.post(url, json={**base, **bad}, timeout=120)
        # llama-server's native envelope has no `param`: the message names the field.
        assert r.status_code == 400 and param in r.json()["error"]["message"], r.text


def test_legacy_completions_take_response_format(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="default",
        prompt="Person:",
        max_tokens=200,
        seed=13,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            }
        },
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_reasoning_control_belongs_to_the_key_that_armed_it(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "qwen3", chat_template=QWEN_THINKING)
    server = ServerProcess(["-m", str(model), "--api-key", "alice", "--api-key", "bob"])
    try:
        url = f"{server.base_url}/v1/chat/completions"
        alice, bob = {"Authorization": "Bearer alice"}, {"X-Api-Key": "bob"}
        body = {"messages": ASK, "max_tokens": 80, "stream": True, "ignore_eos": True}
        with httpx.stream(
            "POST", url, json={**body, "reasoning_control": True}, headers=alice, timeout=60
        ) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            ask = {"id": first["id"], "action": "reasoning_end"}
            by_bob = httpx.post(f"{url}/control", json=ask, headers=bob).json()
            by_alice = httpx.post(f"{url}/control", json=ask, headers=alice).json()
            rest = list(lines)
        assert by_bob["success"] is False and by_alice == {"success": True}
        assert any('"content":"' in line and '"content":""' not in line for line in rest)
    finally:
        server.stop()


@pytest.mark.parametrize(
    "flags",
    [["--reasoning-format", "none"], ["--skip-chat-parsing"], ["--reasoning-alias-field", "none"]],
)
def test_reasoning_output_flags(tmp_path: Path, flags: list[str]) -> None:
    """llama-server's --reasoning-format none and --skip-chat-parsing leave the raw output
    (the end-of-thinking marker included) in content; --reasoning-alias-field none drops the
    `reasoning` copy of reasoning_content, streamed or not."""
    model = build_tiny_model(tmp_path / "qwen3", chat_template=QWEN_THINKING)
    server = ServerProcess(["-m", str(model), *flags])
    body = {"messages": ASK, "max_tokens": 30, "seed": 9, "thinking_budget_tokens": 4}
    try:
        whole = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        message = whole.json()["choices"][0]["message"]
        with httpx.stream(
            "POST",
            f"{server.base_url}/v1/chat/completions",
            json={**body, "stream": True},
            timeout=60,
        ) as r:
            deltas = [
                json.loads(line[6:])["choices"][0]["delta"]
                for line in r.iter_lines()
                if line.startswith("data: {") and '"choices": []' not in line
            ]
    finally:
        server.stop()
    streamed = "".join(d.get("content") or "" for d in deltas)
    if flags[0] == "--reasoning-alias-field":
        assert message["reasoning_content"] and "reasoning" not in message
        assert "</think>" not in message["content"]
        assert any("reasoning_content" in d for d in deltas)
        assert not any("reasoning" in d for d in deltas)
    else:
        assert "reasoning_content" not in message and "reasoning" not in message
        assert "</think>" in message["content"] and "</think>" in streamed
        assert not any("reasoning_content" in d for d in deltas)
    assert streamed == message["content"]

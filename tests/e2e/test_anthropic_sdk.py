"""The official anthropic SDK (strict response validation) against `mlxcel serve` on loopback.

Two servers: the session's tiny model with SmolLM2's template, and a tiny model whose template
calls tools (Hermes <tool_call>) and thinks when asked, behind an API key, with one slot and a
one-deep queue so that overload and disconnects can be watched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.conftest import ServerProcess
from tests.support.chat_templates import TOOL_THINK_TEMPLATE
from tests.unit.test_anthropic_wire import WEATHER, check_event_order

USER: list[Any] = [{"role": "user", "content": "Hello!"}]
GREEDY = {"temperature": 0}
KEY = "secret"


def sdk(server: ServerProcess, **kw: Any) -> anthropic.Anthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(
        base_url=server.base_url, max_retries=0, _strict_response_validation=True, **kw
    )


@pytest.fixture(scope="module")
def client(tiny_server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with sdk(tiny_server) as c:
        yield c


def raw_events(url: str, body: dict[str, Any], **kw: Any) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) pairs of a raw SSE stream, as a strict client reads them."""
    events: list[tuple[str, dict[str, Any]]] = []
    name = None
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                assert name is not None, "data without an event name"
                events.append((name, json.loads(line[6:])))
                name = None
            else:
                assert line == "", f"unexpected SSE line {line!r}"
    return events


def test_create_text(client: anthropic.Anthropic) -> None:
    r = client.messages.create(model="default", max_tokens=12, messages=USER)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].type == "text" and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert 0 < r.usage.output_tokens <= 12
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) > 5
    # A template that does not think takes every thinking setting and simply answers.
    for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}):
        t = client.messages.create(model="default", max_tokens=4, messages=USER, thinking=thinking)
        assert [b.type for b in t.content] == ["text"]


def test_system_as_string_and_blocks_reaches_the_prompt(client: anthropic.Anthropic) -> None:
    def count(**kw: Any) -> int:
        return client.messages.count_tokens(model="default", messages=USER, **kw).input_tokens

    plain = count()
    as_string = count(system="You answer in French.")
    as_blocks = count(system=[{"type": "text", "text": "You answer in French."}])
    assert as_string == as_blocks != plain
    r = client.messages.create(
        model="default",
        max_tokens=4,
        messages=USER,
        system=[{"type": "text", "text": "You answer in French."}],
    )
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == as_blocks


def test_count_tokens_equals_usage_input_tokens(client: anthropic.Anthropic) -> None:
    body: dict[str, Any] = {
        "model": "default",
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "How are you?"}]},
        ],
    }
    counted = client.messages.count_tokens(**body).input_tokens
    r = client.messages.create(**body, max_tokens=3)
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == counted
    assert r.usage.cache_creation_input_tokens == 0


def test_stop_sequences_and_max_tokens(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"model": "default", "messages": USER}
    full = client.messages.create(**kw, max_tokens=24, extra_body=GREEDY)
    assert full.content[0].type == "text"
    text = full.content[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = client.messages.create(**kw, max_tokens=24, stop_sequences=[stop], extra_body=GREEDY)
    assert cut.content[0].type == "text" and cut.content[0].text == text[: text.index(stop)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    capped = client.messages.create(**kw, max_tokens=5, extra_body={**GREEDY, "ignore_eos": True})
    assert capped.stop_reason == "max_tokens" and capped.stop_sequence is None
    assert capped.usage.output_tokens == 5


def test_stream_event_order_and_accumulator(
    client: anthropic.Anthropic, tiny_server: ServerProcess
) -> None:
    kw: dict[str, Any] = {"model": "default", "max_tokens": 16, "messages": USER}
    whole = client.messages.create(**kw, extra_body=GREEDY)
    with client.messages.stream(**kw, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].type == whole.content[0].type == "text"
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = raw_events(f"{tiny_server.base_url}/v1/messages", {**kw, **GREEDY})
    check_event_order(events)
    assert [n for n, _ in events if n != "ping"][:2] == ["message_start", "content_block_start"]
    start = next(d for n, d in events if n == "message_start")["message"]
    assert start["content"] == []
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens
    # message_start and message_delta split the prompt the same way: read now, and found in
    # the prompt cache (most of it here: the same prompt ran just before).
    begun, ended = start["usage"], events[-2][1]["usage"]
    for key in ("input_tokens", "cache_read_input_tokens"):
        assert begun[key] == ended[key], key
    prompt = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert begun["input_tokens"] + begun["cache_read_input_tokens"] == prompt > 5
    assert begun["cache_read_input_tokens"] > 0
    # The alias serves the same stream.
    alias = raw_events(f"{tiny_server.base_url}/messages", {**kw, **GREEDY})
    texts = [
        "".join(d["delta"].get("text", "") for n, d in e if n == "content_block_delta")
        for e in (events, alias)
    ]
    assert texts[0] == texts[1] == whole.content[0].text


def test_models_list_in_the_anthropic_shape(
    client: anthropic.Anthropic, tiny_model_dir: Path, tiny_server: ServerProcess
) -> None:
    (model,) = client.models.list().data
    assert model.id == tiny_model_dir.name and model.type == "model"
    assert model.max_input_tokens and model.max_input_tokens > 0
    # Without anthropic-version the OpenAI list is served as before.
    assert httpx.get(f"{tiny_server.base_url}/v1/models").json()["object"] == "list"


def test_bad_requests_are_400_in_the_anthropic_envelope(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="default", max_tokens=5, messages=USER, extra_body={"temperature": -1}
        )
    assert caught.value.status_code == 400
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "temperature must be >= 0"},
    }
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="default", max_tokens=5, messages=[])
    image = {
        "type": "image",
        "source": {"type": "url", "url": "http://192.0.2.1/never-fetched.png"},
    }
    with pytest.raises(anthropic.BadRequestError, match="image input is not supported") as img:
        client.messages.create(
            model="default",
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}],
        )
    assert isinstance(img.value.body, dict)
    assert img.value.body["error"]["type"] == "invalid_request_error"
    # Any model name is served by the one model (llama-server's single-model mode).
    served = client.messages.create(model="claude-none", max_tokens=5, messages=USER)
    assert served.model != "claude-none" and served.usage.input_tokens > 0


# --- a model that calls tools and thinks, behind a key, with one slot ---------------------


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from tests.support.tiny_model import build_tiny_model

    model = build_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-tools", chat_template=TOOL_THINK_TEMPLATE
    )
    server = ServerProcess(
        [
            "-m",
            str(model),
            "--api-key",
            KEY,
            "--parallel",
            "1",
            "--max-queue-depth",
            "1",
            "-c",
            "8192",
            "--sse-ping-interval",
            "1",
        ]
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tools_client(tool_server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with sdk(tool_server, api_key=KEY) as c:
        yield c


# Tight enough that a random model, constrained to the schema, finishes the call quickly.
FORECAST = {
    "name": "get_forecast",
    "description": "Weather forecast for a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


def test_forced_tool_use_round_trip(tools_client: anthropic.Anthropic) -> None:
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw: dict[str, Any] = {"model": "default", "max_tokens": 200, "tools": [WEATHER, FORECAST]}
    single = {"disable_parallel_tool_use": True}
    r = tools_client.messages.create(
        **kw, messages=ask, tool_choice={"type": "tool", "name": "get_forecast", **single}
    )
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "get_forecast" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, FORECAST["input_schema"])
    assert r.stop_reason == "tool_use"
    # Streamed: the SDK's accumulator rebuilds the input from input_json_delta events.
    with tools_client.messages.stream(
        **{**kw, "tools": [FORECAST]}, messages=ask, tool_choice={"type": "any", **single}
    ) as stream:
        streamed = stream.get_final_message()
    (streamed_call,) = [b for b in streamed.content if b.type == "tool_use"]
    jsonschema.validate(streamed_call.input, FORECAST["input_schema"])
    assert streamed.stop_reason == "tool_use"
    # Next turn: the call goes back with its result, and the model answers.
    follow = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}],
        },
    ]
    counted = tools_client.messages.count_tokens(
        model="default", messages=follow, tools=kw["tools"]
    ).input_tokens
    answer = tools_client.messages.create(**kw, messages=follow)
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == counted


def test_a_tool_result_turn_is_rendered_and_answered(tools_client: anthropic.Anthropic) -> None:
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}

    def follow(result: str) -> list[Any]:
        return [
            *ask,
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, call]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": result}],
            },
        ]

    def count(messages: list[Any]) -> int:
        return tools_client.messages.count_tokens(
            model="default", messages=messages, tools=[WEATHER]
        ).input_tokens

    short, long = count(follow("Sunny")), count(follow("Sunny, 21 C, light wind from the west"))
    assert count(ask) < short < long  # the call and its result are both in the prompt
    r = tools_client.messages.create(
        model="default", max_tokens=8, messages=follow("Sunny"), tools=[WEATHER]
    )
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == short


def test_thinking_becomes_thinking_blocks(
    tools_client: anthropic.Anthropic, tool_server: ServerProcess
) -> None:
    kw: dict[str, Any] = {"model": "default", "messages": USER}
    # The template opens <think> when thinking is on; a random model never closes it, so
    # everything it writes is thinking until the budget forces the end of the block.
    budget = tools_client.messages.create(
        **kw, max_tokens=40, thinking={"type": "enabled", "budget_tokens": 8}
    )
    assert [b.type for b in budget.content][:1] == ["thinking"]
    assert budget.content[0].type == "thinking"
    assert budget.content[0].thinking and budget.content[0].signature
    assert [b.type for b in budget.content] == ["thinking", "text"], "budget not enforced"
    with tools_client.messages.stream(**kw, max_tokens=10, thinking={"type": "adaptive"}) as stream:
        kinds = {e.delta.type for e in stream if e.type == "content_block_delta"}
        final = stream.get_final_message()
    assert kinds == {"thinking_delta", "signature_delta"}
    assert [b.type for b in final.content] == ["thinking"] and final.stop_reason == "max_tokens"
    off = tools_client.messages.create(**kw, max_tokens=10, thinking={"type": "disabled"})
    assert "thinking" not in [b.type for b in off.content]
    events = raw_events(
        f"{tool_server.base_url}/v1/messages",
        {**kw, "max_tokens": 10, "thinking": {"type": "adaptive"}},
        headers={"x-api-key": KEY},
    )
    check_event_order(events)


def test_wrong_key_is_401_in_the_anthropic_envelope(tool_server: ServerProcess) -> None:
    with sdk(tool_server, api_key="wrong") as c, pytest.raises(anthropic.AuthenticationError) as e:
        c.messages.create(model="default", max_tokens=2, messages=USER)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Invalid API Key"},
    }
    # Bearer (the SDK's auth_token) works as x-api-key does.
    with sdk(tool_server, api_key=None, auth_token=KEY) as c:
        assert c.messages.count_tokens(model="default", messages=USER).input_tokens > 5


def test_errors_before_a_route_matches_use_the_anthropic_envelope(
    tiny_server: ServerProcess, tool_server: ServerProcess
) -> None:
    """An Anthropic SDK reads only its own envelope, also for a method or sub-route we do not
    serve (they used to come back in OpenAI's)."""
    for method, path, status, kind in (
        ("GET", "/v1/messages", 405, "invalid_request_error"),
        ("POST", "/v1/messages/batches", 404, "not_found_error"),
    ):
        r = httpx.request(method, tiny_server.base_url + path, json={})
        assert r.status_code == status
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == kind, body
    r = httpx.post(tool_server.base_url + "/v1/messages/batches", headers={"x-api-key": "no"})
    assert r.status_code == 401 and r.json()["type"] == "error"


def test_full_queue_is_503_overloaded_and_the_waiting_stream_pings(
    tool_server: ServerProcess, tools_client: anthropic.Anthropic
) -> None:
    url = f"{tool_server.base_url}/v1/messages"
    long = {
        "model": "default",
        "max_tokens": 6000,
        "messages": USER,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with (
        httpx.Client(timeout=60, headers=headers) as a,
        httpx.Client(timeout=60, headers=headers) as b,
    ):
        with a.stream("POST", url, json=long) as running:
            running_lines = running.iter_lines()  # keep a reference: dropping it disconnects
            events = (x for x in running_lines if x.startswith("event: ") and x != "event: ping")
            assert next(events) == "event: message_start"
            with b.stream("POST", url, json=long) as queued:
                assert queued.status_code == 200
                queued_lines = queued.iter_lines()
                with pytest.raises(anthropic.ServiceUnavailableError) as e:
                    tools_client.messages.create(model="default", max_tokens=2, messages=USER)
                assert e.value.status_code == 503
                assert isinstance(e.value.body, dict)
                assert e.value.body["type"] == "error"
                assert e.value.body["error"]["type"] == "overloaded_error"
                # The queued request waits for the slot; its stream stays alive with pings, and
                # its message_start (whose usage needs the prompt cache's share) waits too.
                assert next(queued_lines) == "event: ping"
                assert next(queued_lines) == 'data: {"type":"ping"}'
    # Both disconnected: the slot is free again.
    wait_idle(tool_server)
    r = tools_client.messages.create(model="default", max_tokens=2, messages=USER)
    assert r.usage.output_tokens > 0


def busy_slots(server: ServerProcess) -> int:
    slots = httpx.get(f"{server.base_url}/slots", headers={"x-api-key": KEY}).json()
    return sum(1 for s in slots if s["is_processing"])


def wait_idle(server: ServerProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while busy_slots(server):
        assert time.monotonic() < deadline, "the slot stayed busy after the client left"
        time.sleep(0.1)


def test_disconnect_mid_stream_frees_the_slot(
    tool_server: ServerProcess, tools_client: anthropic.Anthropic
) -> None:
    url = f"{tool_server.base_url}/v1/messages"
    # 7000 tokens would hold the only slot for far longer than the wait below allows.
    long = {"model": "default", "max_tokens": 7000, "messages": USER, "ignore_eos": True}
    with httpx.stream(
        "POST", url, json={**long, "stream": True}, headers={"x-api-key": KEY}, timeout=60
    ) as r:
        lines = r.iter_lines()
        while next(lines) != "event: content_block_delta":
            pass
        assert busy_slots(tool_server) == 1
    wait_idle(tool_server)
    r2 = tools_client.messages.create(model="default", max_tokens=3, messages=USER)
    assert r2.usage.output_tokens > 0

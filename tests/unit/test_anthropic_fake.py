"""/v1/messages over the whole actor pipeline on the deterministic fake backend.

The fake model answers scripted text (tool calls, thinking, stop sequences), so the exact
Anthropic shapes can be asserted; the official anthropic SDK runs in a thread against the
in-process server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import httpx
import trio

from mlxcel.actors.pipeline import LocalPipeline
from mlxcel.runtime.errors import InternalError
from tests.support.pipeline import admission, pipeline
from tests.unit.test_anthropic_wire import WEATHER, check_event_order
from tests.unit.test_pipeline_fake import fake_server, scripted, wait_until

CALL = (
    'I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)
USER = [{"role": "user", "content": "Weather in Paris?"}]


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake", "max_tokens": 64, "messages": USER, **extra}


async def events_of(client: httpx.AsyncClient, payload: dict[str, Any]) -> list[Any]:
    """(event name, data) pairs of a raw stream, in order."""
    async with client.stream("POST", "/v1/messages", json={**payload, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in r.aiter_lines()]
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
            name = None
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


@asynccontextmanager
async def sdk(client: httpx.AsyncClient) -> AsyncIterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(
        base_url=str(client.base_url).rstrip("/"),
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    )
    try:
        yield c
    finally:
        c.close()


async def in_thread(fn: Callable[[], Any]) -> Any:
    # The sync SDK runs in a thread so this test's Trio loop keeps serving it.
    return await trio.to_thread.run_sync(fn)


async def test_tool_use_non_streamed_and_streamed_agree(smollm_tokenizer: Any) -> None:
    async with scripted(smollm_tokenizer, CALL) as (client, model):
        r = await client.post("/v1/messages", json=body(tools=[WEATHER]))
        events = await events_of(client, body(tools=[WEATHER]))
        async with sdk(client) as c:

            def stream() -> Any:
                with c.messages.stream(**body(tools=[WEATHER])) as s:
                    for _ in s:
                        pass
                    return s.get_final_message()

            final = await in_thread(stream)
    msg = r.json()
    assert r.status_code == 200
    assert set(msg) == {
        "id",
        "type",
        "role",
        "model",
        "content",
        "stop_reason",
        "stop_sequence",
        "usage",
    }
    assert msg["id"].startswith("msg_") and msg["type"] == "message" and msg["model"] == model
    text, call = msg["content"]
    assert text == {"type": "text", "text": "I will check."}
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert call["name"] == "get_weather" and call["input"] == {"city": "Paris"}
    assert msg["stop_reason"] == "tool_use" and msg["stop_sequence"] is None
    assert msg["usage"]["output_tokens"] > 0
    check_event_order(events)
    names = [n for n, _ in events if n != "ping"]
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * (len(names) - 8),
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "I will check."
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


async def test_thinking_becomes_a_signed_thinking_block(smollm_tokenizer: Any) -> None:
    text = "<think>\nThe user greets me.\n</think>\n\nHello!"
    async with scripted(smollm_tokenizer, text, reasoning_template=True) as (client, _):
        thinking = {"type": "enabled", "budget_tokens": 1024}
        r = await client.post("/v1/messages", json=body(thinking=thinking))
        events = await events_of(client, body(thinking=thinking))
        omitted = await client.post(
            "/v1/messages", json=body(thinking={**thinking, "display": "omitted"})
        )
    think, answer = r.json()["content"]
    assert think["type"] == "thinking" and think["thinking"] == "The user greets me."
    assert think["signature"]
    assert answer == {"type": "text", "text": "Hello!"}
    check_event_order(events)
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == think["thinking"]
    assert [d["signature"] for d in deltas if d["type"] == "signature_delta"] == [
        think["signature"]
    ]
    assert "".join(d.get("text", "") for d in deltas) == "Hello!"
    hidden, shown = omitted.json()["content"]
    assert hidden == {**think, "thinking": ""} and shown == answer


async def test_stop_sequence_is_cut_and_reported(smollm_tokenizer: Any) -> None:
    async with scripted(smollm_tokenizer, "Hello world END and more") as (client, _):
        r = await client.post("/v1/messages", json=body(stop_sequences=["END", "zzz"]))
        events = await events_of(client, body(stop_sequences=["END"]))
        capped = await client.post("/v1/messages", json=body(max_tokens=2))
    msg = r.json()
    assert msg["content"] == [{"type": "text", "text": "Hello world "}]
    assert msg["stop_reason"] == "stop_sequence" and msg["stop_sequence"] == "END"
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert capped.json()["stop_reason"] == "max_tokens"
    assert capped.json()["usage"]["output_tokens"] == 2


async def test_count_tokens_matches_message_start(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer, script=[905, 17]) as (client, _, _):
        payload = body(system=[{"type": "text", "text": "Be brief."}])
        counted = await client.post("/v1/messages/count_tokens", json=payload)
        alias = await client.post("/messages/count_tokens", json=payload)
        events = await events_of(client, payload)
    assert counted.status_code == 200 and counted.json() == alias.json()
    started = events[0][1]["message"]
    assert started["usage"]["input_tokens"] == counted.json()["input_tokens"] > 5
    assert started["content"] == [] and started["stop_reason"] is None
    final = events[-2][1]["usage"]
    assert (
        final["input_tokens"] + final["cache_read_input_tokens"] == started["usage"]["input_tokens"]
    )


async def test_pings_while_silent_and_an_error_event_without_message_stop(
    smollm_tokenizer: Any,
) -> None:
    async with fake_server(
        smollm_tokenizer, ctx_size=16384, step_delay=0.05, sse_ping_interval=0.1
    ) as (client, _, ctx):
        long = body(messages=[{"role": "user", "content": "word " * 3000}], stream=True)
        async with client.stream("POST", "/v1/messages", json=long) as r:
            lines = r.aiter_lines()
            pings = 0
            async for line in lines:
                if line == "event: ping":
                    pings += 1
                    assert await lines.__anext__() == 'data: {"type":"ping"}'
                if pings == 2:
                    break
            assert isinstance(pipeline(ctx), LocalPipeline)  # the live slot, behind the interface
            slots = pipeline(ctx).scheduler.slot_items()
            ((item, _choice),) = [i for i in slots if i is not None]
            item.slot.fail(InternalError("Generation error: boom"))
            rest = [line async for line in lines if line]
    assert rest[-2:] == [
        "event: error",
        'data: {"type":"error","error":{"type":"api_error","message":"Generation error: boom"}}',
    ]
    assert "event: message_stop" not in rest


async def test_disconnect_mid_stream_stops_generation(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer, step_delay=0.01) as (client, backend, ctx):
        payload = body(max_tokens=100_000, stream=True)
        async with client.stream("POST", "/v1/messages", json=payload) as r:
            assert r.status_code == 200
            # Leave once tokens are flowing (reading part of the body under Trio would leave
            # httpx's inner generators unclosed).
            await wait_until(lambda: backend.steps > 10)
        await wait_until(lambda: admission(ctx).active == 0)
        steps = backend.steps
        await wait_until(lambda: backend.rows == 0)  # 100,000 tokens had it gone on
        assert backend.steps <= steps + 1, "generation went on after the client left"


async def test_error_envelopes_auth_and_overload(smollm_tokenizer: Any) -> None:
    async with fake_server(
        smollm_tokenizer,
        api_keys=frozenset({"secret"}),
        parallel=1,
        max_queue_depth=1,
        step_delay=0.02,
        strict_model_names=True,
    ) as (client, _, ctx):
        key = {"x-api-key": "secret", "anthropic-version": "2023-06-01"}
        wrong = await client.post("/v1/messages", json=body(), headers={"x-api-key": "nope"})
        assert wrong.status_code == 401
        assert wrong.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "Invalid API Key"},
        }
        # Other families keep their own 401 body.
        assert "type" not in (await client.post("/v1/chat/completions", json={})).json()
        bearer = await client.post(
            "/v1/messages/count_tokens", json=body(), headers={"Authorization": "Bearer secret"}
        )
        assert bearer.status_code == 200
        bad = await client.post("/v1/messages", json=body(temperature=-1), headers=key)
        assert bad.status_code == 400
        assert bad.json()["type"] == "error"
        assert bad.json()["error"]["type"] == "invalid_request_error"
        assert "temperature" in bad.json()["error"]["message"]
        image = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "AA"},
        }
        img = await client.post(
            "/v1/messages", json=body(messages=[{"role": "user", "content": [image]}]), headers=key
        )
        assert img.status_code == 400
        assert "image input is not supported" in img.json()["error"]["message"]
        unknown = await client.post("/v1/messages", json=body(model="claude-x"), headers=key)
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        long = body(max_tokens=10_000, stream=True)
        async with client.stream("POST", "/v1/messages", json=long, headers=key) as running:
            assert running.status_code == 200
            async with client.stream("POST", "/v1/messages", json=long, headers=key) as queued:
                assert queued.status_code == 200
                await wait_until(lambda: admission(ctx).queued == 1)
                full = await client.post("/v1/messages", json=body(stream=True), headers=key)
    assert full.status_code == 503
    assert full.headers["content-type"].startswith("application/json")
    assert full.json()["error"]["type"] == "overloaded_error"


async def test_disconnect_while_waiting_for_a_whole_message_stops_generation(
    smollm_tokenizer: Any,
) -> None:
    async with fake_server(smollm_tokenizer, step_delay=0.02) as (client, backend, ctx):
        with trio.move_on_after(0.3):
            await client.post("/v1/messages", json=body(max_tokens=100_000))
        await wait_until(lambda: admission(ctx).active == 0)
        steps = backend.steps
        await wait_until(lambda: backend.rows == 0)  # 100,000 tokens had it gone on
        assert backend.steps <= steps + 1, "generation went on after the client left"

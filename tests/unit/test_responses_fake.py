"""/v1/responses on the whole actor pipeline with the deterministic fake backend.

The fake model answers scripted text, so these tests can check exact output items (reasoning,
tool calls), what the model was shown on a chained turn, and what a cancel or a disconnect
does to the compute thread. Clients are httpx and the official openai SDK (strict validation,
run in a thread so the in-process server keeps serving).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import trio

from mlxcel.actors.pipeline import LocalPipeline
from mlxcel.http.context import ServerContext
from tests.support.pipeline import admission, pipeline
from tests.unit.test_pipeline_fake import QWEN_TEMPLATE, fake_server, wait_until

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL = (
    'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@asynccontextmanager
async def server(
    tok: Any, tmp_path: Path, text: str = "Hello there, friend.", **kw: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, openai.OpenAI, ServerContext, list[str], Any]]:
    """A fake model answering ``text``; yields the client, an SDK client, the context, the
    list of prompts the model was shown (rendered text), and the backend."""
    script = tok.encode(text, add_special_tokens=False)
    kw.setdefault("eos_after", len(script))
    async with fake_server(
        tok, script=script, chat_template=QWEN_TEMPLATE, cache_dir=tmp_path, **kw
    ) as (client, backend, ctx):
        prompts: list[str] = []
        assert isinstance(pipeline(ctx), LocalPipeline)
        tokenizer = pipeline(ctx).tokenizer
        render = tokenizer.render

        def recording(request: Any) -> str:
            text = render(request)
            prompts.append(text)
            return text

        tokenizer.render = recording  # type: ignore[method-assign]
        sdk = openai.OpenAI(
            base_url=f"{str(client.base_url).rstrip('/')}/v1",
            api_key="x",
            max_retries=0,
            _strict_response_validation=True,
        )
        try:
            yield client, sdk, ctx, prompts, backend
        finally:
            sdk.close()


async def test_create_returns_the_sdk_typed_response(smollm_tokenizer: Any, tmp_path: Path) -> None:
    async with server(smollm_tokenizer, tmp_path) as (_, sdk, _, prompts, _):
        r = await trio.to_thread.run_sync(
            lambda: sdk.responses.create(
                model="fake",
                instructions="Be brief.",
                input="Hi",
                metadata={"k": "v"},
                temperature=0.5,
            )
        )
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello there, friend."
    (msg,) = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.status == "completed"
    assert r.usage is not None and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.metadata == {"k": "v"} and r.temperature == 0.5 and r.instructions == "Be brief."
    # Instructions are the leading system turn.
    assert prompts[-1].startswith("<|im_start|>system\nBe brief.<|im_end|>")


async def test_stream_event_order_and_sequence_numbers(
    smollm_tokenizer: Any, tmp_path: Path
) -> None:
    text = "<think>\nThey greet me.\n</think>\n\nHello!"
    async with server(smollm_tokenizer, tmp_path, text, reasoning_template=True) as (
        client,
        sdk,
        *_,
    ):

        def run() -> tuple[list[Any], Any]:
            with sdk.responses.stream(model="fake", input="Hi") as stream:
                events = list(stream)
                return events, stream.get_final_response()

        events, final = await trio.to_thread.run_sync(run)
        stored = (await client.get(f"/v1/responses/{final.id}")).json()
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * types.count("response.reasoning_text.delta"),
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * types.count("response.output_text.delta"),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "They greet me."
    assert message.type == "message" and final.output_text == "Hello!"
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens > 0
    # The stream stored what it sent.
    assert stored["status"] == "completed" and stored["output"][1]["content"][0]["text"] == "Hello!"


async def test_function_call_round_trip(smollm_tokenizer: Any, tmp_path: Path) -> None:
    async with server(smollm_tokenizer, tmp_path, CALL) as (_, sdk, _, prompts, _):
        first = await trio.to_thread.run_sync(
            lambda: sdk.responses.create(model="fake", input="Weather?", tools=[WEATHER_TOOL])
        )
        text, call = first.output
        assert text.type == "message" and first.output_text == "Let me look."
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
        second = await trio.to_thread.run_sync(
            lambda: sdk.responses.create(
                model="fake",
                previous_response_id=first.id,
                tools=[WEATHER_TOOL],
                input=[
                    {"type": "function_call_output", "call_id": call.call_id, "output": "22C sun"}
                ],
            )
        )

        # Streamed, the same call arrives as typed events.
        def streamed() -> list[Any]:
            with sdk.responses.stream(model="fake", input="Weather?", tools=[WEATHER_TOOL]) as s:
                return list(s)

        events = await trio.to_thread.run_sync(streamed)
    assert second.previous_response_id == first.id
    shown = prompts[-2]  # the second create's prompt
    assert "Weather?" in shown and "22C sun" in shown and "Let me look." in shown
    assert shown.index("Weather?") < shown.index("Let me look.") < shown.index("22C sun")
    types = [e.type for e in events]
    i = types.index("response.function_call_arguments.done")
    assert types[i - 1] == "response.function_call_arguments.delta"
    assert types[i + 1] == "response.output_item.done" and types[-1] == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}


async def test_conversation_chains_turns(smollm_tokenizer: Any, tmp_path: Path) -> None:
    async with server(smollm_tokenizer, tmp_path) as (client, sdk, _, prompts, _):
        conv = await trio.to_thread.run_sync(lambda: sdk.conversations.create(metadata={"a": "b"}))
        for question in ("First question?", "Second question?"):
            r = await trio.to_thread.run_sync(
                lambda q=question: sdk.responses.create(model="fake", input=q, conversation=conv.id)
            )
            assert r.conversation is not None and r.conversation.id == conv.id
        items = await trio.to_thread.run_sync(
            lambda: list(sdk.conversations.items.list(conv.id, order="asc"))
        )
        fetched = await trio.to_thread.run_sync(lambda: sdk.conversations.retrieve(conv.id))
        counted = (
            await client.post(
                "/v1/responses/input_tokens", json={"input": "Third?", "conversation": conv.id}
            )
        ).json()["input_tokens"]
        alone = (await client.post("/v1/responses/input_tokens", json={"input": "Third?"})).json()
    second = prompts[1]  # the second create's prompt (then come the two counts)
    assert "First question?" in second and "Hello there, friend." in second
    assert second.index("First question?") < second.index("Second question?")
    assert [i.type for i in items] == ["message"] * 4
    assert [getattr(i, "role", None) for i in items] == ["user", "assistant"] * 2
    assert fetched.metadata == {"a": "b"}
    assert counted > alone["input_tokens"] + 10


async def test_cancel_stops_an_in_flight_stream(smollm_tokenizer: Any, tmp_path: Path) -> None:
    async with server(smollm_tokenizer, tmp_path, step_delay=0.02, eos_after=None) as (
        client,
        _,
        ctx,
        _,
        backend,
    ):
        body = {"input": "Hi", "stream": True, "max_output_tokens": 100_000}
        async with client.stream("POST", "/v1/responses", json=body) as r:
            lines = r.aiter_lines()
            first = json.loads((await anext(lines)) and (await anext(lines))[6:])
            rid = first["response"]["id"]
            await wait_until(lambda: backend.steps > 5)
            running = (await client.get(f"/v1/responses/{rid}")).json()
            assert running["status"] == "in_progress"
            cancelled = await client.post(f"/v1/responses/{rid}/cancel")
            rest = [line async for line in lines if line.startswith("data: ")]
        steps = backend.steps
        await wait_until(lambda: backend.rows == 0)  # 100,000 tokens had it gone on
        assert backend.steps <= steps + 1, "generation went on after the cancel"
        stored = (await client.get(f"/v1/responses/{rid}")).json()
        assert not store_running(ctx)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    last = json.loads(rest[-1][6:])
    assert last["response"]["status"] == "cancelled"
    assert stored["status"] == "cancelled" and stored["output"][0]["content"][0]["text"]


def store_running(ctx: ServerContext) -> tuple[str, ...]:
    assert ctx.session_store is not None
    return ctx.session_store.running_ids()


async def test_disconnect_aborts_the_generation(smollm_tokenizer: Any, tmp_path: Path) -> None:
    async with server(smollm_tokenizer, tmp_path, step_delay=0.02, eos_after=None) as (
        client,
        _,
        ctx,
        _,
        backend,
    ):
        body = {"input": "Hi", "stream": True, "max_output_tokens": 100_000}
        async with client.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            await wait_until(lambda: backend.steps > 3)
        await wait_until(lambda: admission(ctx).active == 0)  # its handler has sent the abort
        steps = backend.steps
        await wait_until(lambda: backend.rows == 0)  # 100,000 tokens had it gone on
        assert backend.steps <= steps + 1
        await wait_until(lambda: not store_running(ctx))


async def test_retrieve_delete_and_input_items(smollm_tokenizer: Any, tmp_path: Path) -> None:
    async with server(smollm_tokenizer, tmp_path) as (client, sdk, *_):
        items = [
            {"role": "developer", "content": "Use French."},
            {"role": "user", "content": [{"type": "input_text", "text": "Bonjour"}]},
            {"role": "assistant", "content": "Salut"},
            {"role": "user", "content": "Ça va?"},
        ]
        r = await trio.to_thread.run_sync(lambda: sdk.responses.create(model="fake", input=items))
        got = await trio.to_thread.run_sync(lambda: sdk.responses.retrieve(r.id))
        page = await trio.to_thread.run_sync(
            lambda: sdk.responses.input_items.list(r.id, limit=3, order="asc")
        )
        rest = await trio.to_thread.run_sync(
            lambda: sdk.responses.input_items.list(r.id, after=page.data[-1].id, order="asc")
        )
        counted = await trio.to_thread.run_sync(
            lambda: sdk.responses.input_tokens.count(model="fake", input=items)
        )
        deleted = (await client.delete(f"/v1/responses/{r.id}")).json()
        again = await client.delete(f"/v1/responses/{r.id}")
        gone = await client.get(f"/v1/responses/{r.id}")
    assert got.id == r.id and got.output_text == r.output_text
    assert [getattr(i, "role", None) for i in page.data] == ["developer", "user", "assistant"]
    assert page.has_more and not rest.has_more and len(rest.data) == 1
    assert r.usage is not None and counted.input_tokens == r.usage.input_tokens
    assert deleted == {"id": r.id, "object": "response.deleted", "deleted": True}
    assert again.json()["deleted"] is False
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"


async def test_requests_we_cannot_honour_are_400s(smollm_tokenizer: Any, tmp_path: Path) -> None:
    cases: list[tuple[dict[str, Any], int, str | None]] = [
        ({"input": "Hi", "background": True, "store": False}, 400, "background"),
        ({"input": "Hi", "truncation": "sometimes"}, 400, "truncation"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "Hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        (
            {"input": "Hi", "previous_response_id": "resp_x", "conversation": "conv_x"},
            400,
            "previous_response_id",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "http://x/y.png"}],
                    }
                ]
            },
            400,
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
        ({"input": "Hi", "include": ["file_search_call.results"]}, 400, "include"),
        ({"input": "Hi", "prompt": {"id": "p"}}, 400, "prompt"),
    ]
    async with server(smollm_tokenizer, tmp_path) as (client, *_):
        for body, status, param in cases:
            r = await client.post("/v1/responses", json=body)
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
        image = await client.post(
            "/v1/responses",
            json={"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        )
    assert "image input is not supported" in image.json()["error"]["message"]


async def test_with_the_store_off_nothing_is_retrievable(
    smollm_tokenizer: Any, tmp_path: Path
) -> None:
    async with server(smollm_tokenizer, tmp_path, responses_store_max_entries=0) as (client, *_):
        r = await client.post("/v1/responses", json={"input": "Hi"})
        rid = r.json()["id"]
        got = await client.get(f"/v1/responses/{rid}")
        chained = await client.post(
            "/v1/responses", json={"input": "Hi", "previous_response_id": rid}
        )
    assert r.status_code == 200 and r.json()["store"] is False
    assert r.json()["output_text"] == "Hello there, friend."
    assert got.status_code == 400 and "disabled" in got.json()["error"]["message"]
    assert chained.status_code == 400 and chained.json()["error"]["param"] == "previous_response_id"


async def test_keepalive_comments_flow_while_the_prompt_is_read(
    smollm_tokenizer: Any, tmp_path: Path
) -> None:
    async with server(
        smollm_tokenizer, tmp_path, ctx_size=16384, step_delay=0.1, sse_ping_interval=0.15
    ) as (client, *_):
        body = {"input": "word " * 3000, "stream": True, "max_output_tokens": 1}
        async with client.stream("POST", "/v1/responses", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line]
    events = [line[7:] for line in lines if line.startswith("event: ")]
    assert events[:2] == ["response.created", "response.in_progress"]
    assert ": keepalive" in lines[lines.index("event: response.in_progress") :]
    assert events[-1] == "response.incomplete"


TWO_CALLS = "".join(
    f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
    for city in ("Paris", "Rome")
)


async def test_max_tool_calls_keeps_the_first_calls(smollm_tokenizer: Any, tmp_path: Path) -> None:
    async with server(smollm_tokenizer, tmp_path, TWO_CALLS) as (client, *_):
        body: dict[str, Any] = {"input": "Weather?", "tools": [WEATHER_TOOL]}
        both = (await client.post("/v1/responses", json=body)).json()
        one = (await client.post("/v1/responses", json={**body, "max_tool_calls": 1})).json()
    cities = [json.loads(i["arguments"])["city"] for i in both["output"]]
    assert cities == ["Paris", "Rome"]
    assert [json.loads(i["arguments"])["city"] for i in one["output"]] == ["Paris"]
    assert len({i["call_id"] for i in both["output"]}) == 2


async def test_cancel_ends_a_non_streaming_request(smollm_tokenizer: Any, tmp_path: Path) -> None:
    async with server(smollm_tokenizer, tmp_path, step_delay=0.02, eos_after=None) as (
        client,
        _,
        ctx,
        _,
        backend,
    ):
        result: dict[str, Any] = {}

        async def create() -> None:
            body = {"input": "Hi", "max_output_tokens": 100_000}
            result["r"] = await client.post("/v1/responses", json=body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(create)
            await wait_until(lambda: bool(store_running(ctx)) and backend.steps > 5)
            (rid,) = store_running(ctx)
            cancelled = await client.post(f"/v1/responses/{rid}/cancel")
    body = result["r"].json()
    assert body["id"] == rid and body["status"] == "cancelled"
    assert cancelled.json()["status"] == "cancelled"
    assert 0 < body["usage"]["output_tokens"] < 100_000


async def test_a_failure_mid_stream_ends_with_response_failed(
    smollm_tokenizer: Any, tmp_path: Path
) -> None:
    import attrs

    async with server(smollm_tokenizer, tmp_path, step_delay=0.01, eos_after=None) as (
        client,
        _,
        _,
        _,
        backend,
    ):
        apply = backend.apply

        def failing(plan: Any) -> Any:
            out = apply(plan)
            if backend.steps == 6:  # a few tokens in, the step fails for every sequence
                rids = {t.request_id for t in out.tokens}
                for rid in rids:
                    backend._seqs.pop(rid, None)
                return attrs.evolve(out, tokens=(), errors=tuple((r, "boom") for r in rids))
            return out

        backend.apply = failing  # type: ignore[method-assign]
        body = {"input": "Hi", "stream": True, "max_output_tokens": 100}
        async with client.stream("POST", "/v1/responses", json=body) as r:
            frames = [
                json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")
            ]
        rid = frames[0]["response"]["id"]
        stored = (await client.get(f"/v1/responses/{rid}")).json()
    last = frames[-1]
    assert last["type"] == "response.failed"
    assert last["response"]["status"] == "failed"
    assert last["response"]["error"]["code"] == "server_error"
    assert "boom" in last["response"]["error"]["message"]
    assert stored["status"] == "failed"
    # The output streamed before the failure is closed properly before the terminal event.
    assert frames[-2]["type"] == "response.output_item.done"


async def test_top_logprobs_fill_output_text_logprobs(
    smollm_tokenizer: Any, tmp_path: Path
) -> None:
    async with server(smollm_tokenizer, tmp_path) as (client, sdk, *_):
        r = await trio.to_thread.run_sync(
            lambda: sdk.responses.create(model="fake", input="Hi", top_logprobs=2)
        )
        body = {"input": "Hi", "top_logprobs": 2, "stream": True}
        async with client.stream("POST", "/v1/responses", json=body) as s:
            frames = [json.loads(x[6:]) async for x in s.aiter_lines() if x.startswith("data: ")]
    part = r.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs
    assert "".join(lp.token for lp in part.logprobs) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob == -0.5 for lp in part.logprobs)
    deltas = [f for f in frames if f["type"] == "response.output_text.delta"]
    streamed = [lp["token"] for f in deltas for lp in f["logprobs"]]
    assert "".join(streamed) == r.output_text


async def test_conversation_item_routes_and_concurrent_turns(
    smollm_tokenizer: Any, tmp_path: Path
) -> None:
    async with server(smollm_tokenizer, tmp_path) as (client, sdk, *_):
        conv = await trio.to_thread.run_sync(
            lambda: sdk.conversations.create(items=[{"role": "user", "content": "Seed."}])
        )
        added = await trio.to_thread.run_sync(
            lambda: sdk.conversations.items.create(
                conv.id, items=[{"type": "message", "role": "assistant", "content": "Ok."}]
            )
        )
        (item,) = added.data
        got = await trio.to_thread.run_sync(
            lambda: sdk.conversations.items.retrieve(item.id, conversation_id=conv.id)
        )
        await trio.to_thread.run_sync(
            lambda: sdk.conversations.update(conv.id, metadata={"topic": "x"})
        )
        await trio.to_thread.run_sync(
            lambda: sdk.conversations.items.delete(item.id, conversation_id=conv.id)
        )

        async def turn(text: str) -> None:
            r = await client.post("/v1/responses", json={"input": text, "conversation": conv.id})
            assert r.status_code == 200

        # Two turns finishing together must both land in the conversation.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(turn, "A?")
            nursery.start_soon(turn, "B?")
        items = await trio.to_thread.run_sync(
            lambda: list(sdk.conversations.items.list(conv.id, order="asc"))
        )
        meta = (await client.get(f"/v1/conversations/{conv.id}")).json()["metadata"]
        missing = await client.get(f"/v1/conversations/{conv.id}/items/{item.id}")
    assert got.id == item.id and got.type == "message"
    assert meta == {"topic": "x"}
    assert missing.status_code == 404
    texts = [i.content[0].text for i in items]  # type: ignore[union-attr]
    assert texts[0] == "Seed." and len(items) == 5
    assert {"A?", "B?"} <= set(texts) and texts.count("Hello there, friend.") == 2


async def test_truncation_auto_drops_the_oldest_turns_to_leave_room(
    smollm_tokenizer: Any, tmp_path: Path
) -> None:
    # A 512-token window and a long conversation passed as input items: "disabled" (the
    # default) is the usual context 400; "auto" drops whole turns from the start until the
    # prompt leaves max_output_tokens of room, and the answer comes.
    turns: list[dict[str, Any]] = []
    for i in range(12):
        turns.append({"role": "user", "content": f"Question {i}: " + "tell me more " * 8})
        turns.append({"role": "assistant", "content": f"Answer {i}: " + "here is more " * 8})
    turns.append({"role": "user", "content": "The last question."})
    body = {"model": "fake", "input": turns, "max_output_tokens": 64, "store": False}
    async with server(smollm_tokenizer, tmp_path, ctx_size=512) as (client, _, _, prompts, _):
        refused = await client.post("/v1/responses", json=body)
        r = await client.post("/v1/responses", json={**body, "truncation": "auto"})
    assert refused.status_code == 400 and "context" in refused.json()["error"]["message"]
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "completed" and out["truncation"] == "auto"
    assert out["usage"]["input_tokens"] <= 512 - 64
    shown = prompts[-1]
    assert "The last question." in shown and "Question 0:" not in shown
    # Whole turns: the model's view starts at a user message, and the newest turns stay.
    assert "Question 11:" in shown and "Answer 11:" in shown
    first_user = shown.index("<|im_start|>user")
    assert "<|im_start|>assistant" not in shown[:first_user]

"""The whole actor pipeline and HTTP front on the deterministic fake backend.

The server runs in-process on a loopback port; clients are real HTTP clients. The fake
backend takes real time per step, so these tests can disconnect mid-prefill and watch what
the compute thread does afterwards.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio

from mlxcel.actors.model_runner.backend import ModelInfo
from mlxcel.actors.model_runner.fake import FakeBackend
from mlxcel.http.context import ServerContext
from mlxcel.runtime.settings import Settings
from mlxcel.server import serve
from tests.conftest import free_port
from tests.support.pipeline import admission, pipeline

HELLO = [19556, 28, 905, 17]  # token ids; decoded below rather than trusted


@asynccontextmanager
async def fake_server(
    tokenizer: Any,
    *,
    script: list[int] | None = None,
    chat_template: str | None = None,
    reasoning_template: bool = False,
    max_rows: int | None = None,
    **kw: Any,
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeBackend, ServerContext]]:
    names = {a.name for a in attrs.fields(Settings)}
    settings_kw = {k: kw.pop(k) for k in list(kw) if k in names}
    settings = Settings(port=free_port(), warmup=False, **settings_kw)
    info = ModelInfo(
        model_id="fake",
        path=None,
        tokenizer=tokenizer,
        eos_token_ids=frozenset({tokenizer.eos_token_id}),
        context_length=settings.ctx_size,
        # Output parsing reads the template: a tool marker or a <think> mention switches it on.
        chat_template=(chat_template or "") + ("{# <think> #}" if reasoning_template else "")
        or None,
        max_rows=max_rows,
    )
    backend = FakeBackend(info, script=script or HELLO, **kw)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        _, ctx = await nursery.start(
            lambda task_status: serve(
                settings, build_backend=lambda: backend, stop=stop, task_status=task_status
            )
        )
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{settings.port}", timeout=30
        ) as client:
            yield client, backend, ctx
        stop.set()


def chat(content: str = "Hi", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


async def wait_until(predicate: Any) -> None:
    with trio.fail_after(10.0):
        while not predicate():  # noqa: ASYNC110 - fakes change state without an event to await
            await trio.sleep(0.01)


async def test_non_streaming_chat_returns_the_scripted_text(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer) as (client, _, _):
        r = await client.post("/v1/chat/completions", json=chat(max_tokens=4))
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["message"]["content"] == smollm_tokenizer.decode(HELLO)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4


async def test_stop_string_across_tokens_is_cut_and_generation_stops(smollm_tokenizer: Any) -> None:
    text = smollm_tokenizer.decode(HELLO)
    stop = text[len(text) // 2 - 1 : len(text) // 2 + 2]  # straddles a token boundary
    async with fake_server(smollm_tokenizer, step_delay=0.01) as (client, backend, ctx):
        r = await client.post("/v1/chat/completions", json=chat(max_tokens=500, stop=[stop]))
        body = r.json()
        assert body["choices"][0]["message"]["content"] == text[: text.index(stop)]
        assert body["choices"][0]["finish_reason"] == "stop"
        steps = backend.steps
        # Out of the batch (a row that ran on would stay for 500 tokens) within one step.
        await wait_until(lambda: backend.rows == 0)
        assert backend.steps <= steps + 1, "the sequence kept running after its stop string"


async def test_full_queue_is_503_before_any_stream_byte(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer, parallel=1, max_queue_depth=1, step_delay=0.02) as (
        client,
        _,
        ctx,
    ):
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=10_000)
        ) as running:
            assert running.status_code == 200
            async with client.stream(
                "POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=10_000)
            ) as queued:
                assert queued.status_code == 200
                await wait_until(lambda: admission(ctx).queued == 1)
                r = await client.post("/v1/chat/completions", json=chat(stream=True))
                assert r.status_code == 503
                assert r.headers["content-type"].startswith("application/json")
                assert r.json()["error"]["type"] == "server_busy"
                # The SDKs wait this long before their retry.
                assert r.headers["retry-after"] == "1"


async def test_a_burst_as_wide_as_the_batch_is_not_turned_away(smollm_tokenizer: Any) -> None:
    """--max-queue-depth counts requests waiting for a slot: a burst that free slots take is
    not waiting, so 6 requests arriving at once at a --parallel 4 server with a queue of 2 all
    run, and the 7th, beyond both, is a 503."""
    async with fake_server(smollm_tokenizer, parallel=4, max_queue_depth=2, step_delay=0.05) as (
        client,
        _,
        ctx,
    ):
        from mlxcel.runtime.errors import ServerBusy
        from mlxcel.runtime.messages import GenerationRequest, SamplingParams, TextPrompt

        gate = admission(ctx)

        def request(i: int) -> GenerationRequest:
            return GenerationRequest(
                request_id=f"burst-{i}",
                prompt=TextPrompt(text="Hi"),
                sampling=SamplingParams(),
                max_tokens=3,
            )

        # Submitted back to back, before any is tokenized or scheduled.
        slots = [gate.submit(request(i)) for i in range(6)]
        with pytest.raises(ServerBusy):
            gate.submit(request(6))
        await wait_until(lambda: all(s.done for s in slots))
        # Over HTTP too: a burst of 6 streams all answer 200.
        async with trio.open_nursery() as nursery:
            codes: list[int] = []

            async def one() -> None:
                r = await client.post("/v1/chat/completions", json=chat(max_tokens=3))
                codes.append(r.status_code)

            for _ in range(6):
                nursery.start_soon(one)
        assert codes == [200] * 6


async def test_disconnect_mid_prefill_stops_within_one_chunk(smollm_tokenizer: Any) -> None:
    long_prompt = "word " * 6000  # ~6000 tokens: 12 chunks of 512
    async with fake_server(smollm_tokenizer, ctx_size=16384, step_delay=0.05) as (
        client,
        backend,
        ctx,
    ):
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat(long_prompt, stream=True)
        ) as r:
            assert r.status_code == 200
            await wait_until(lambda: sum(backend.chunks_done.values()) >= 2)
        chunks_at_disconnect = sum(backend.chunks_done.values())
        await wait_until(lambda: backend.rows == 0)  # the abort has reached the batch
        assert sum(backend.chunks_done.values()) <= chunks_at_disconnect + 1
        assert admission(ctx).queued == 0
        # The freed slot serves the next request at once.
        r2 = await client.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert r2.status_code == 200


async def test_disconnected_non_streaming_request_stops_too(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer, step_delay=0.02) as (client, backend, ctx):
        with trio.move_on_after(0.3):  # the client gives up waiting
            await client.post("/v1/chat/completions", json=chat(max_tokens=100_000))
        await wait_until(lambda: admission(ctx).active == 0)  # its handler has sent the abort
        steps = backend.steps
        # Left the batch (else it would run for 100,000 tokens), within one step.
        await wait_until(lambda: backend.rows == 0)
        assert backend.steps <= steps + 1, "generation went on after the client left"


async def test_one_disconnect_aborts_only_that_request(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer, step_delay=0.01) as (client, _, _):
        results: dict[str, Any] = {}

        async def survivor() -> None:
            results["r"] = await client.post("/v1/chat/completions", json=chat(max_tokens=30))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(survivor)
            with trio.move_on_after(0.1):
                await client.post("/v1/chat/completions", json=chat(max_tokens=100_000))
        assert results["r"].json()["usage"]["completion_tokens"] == 30


async def test_statistics_are_a_frozen_copy_taken_between_steps(smollm_tokenizer: Any) -> None:
    """/slots, /metrics and the control route read a copy of the scheduler: it says what ran
    when it was taken, and stays so while the scheduler moves on."""
    async with fake_server(smollm_tokenizer, step_delay=0.02, eos_after=None) as (
        client,
        backend,
        ctx,
    ):
        body = chat(max_tokens=200, stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            await wait_until(lambda: backend.steps > 3)
            during = pipeline(ctx).statistics()
            request_id = next(s for s in during.slots if s is not None).request.request_id
        await wait_until(lambda: pipeline(ctx).statistics().running == 0)
        after = pipeline(ctx).statistics()
    (busy,) = [s for s in during.slots if s is not None]
    assert during.running == 1 and during.rows == 1 and len(during.slots) == 4
    assert busy.decoded_tokens > 0 and busy.max_tokens == 200 and busy.choice == 0
    assert during.running_request(request_id) is busy.request
    assert after.running_request(request_id) is None and not any(after.slots)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        during.running = 0  # type: ignore[misc]  # the point: it cannot be changed


async def test_keepalive_comments_flow_during_a_long_prefill(smollm_tokenizer: Any) -> None:
    async with fake_server(
        smollm_tokenizer, ctx_size=16384, step_delay=0.1, sse_ping_interval=0.15
    ) as (client, _, _):
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat("word " * 3000, stream=True, max_tokens=1)
        ) as r:
            lines = [line async for line in r.aiter_lines() if line]
    assert ": keepalive" in lines
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert lines[-1] == "data: [DONE]"


async def test_shutdown_rejects_new_work_with_503(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer) as (client, _, ctx):
        admission(ctx).drain()
        r = await client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "unavailable_error"


QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{# tools: <tool_call> #}<|im_start|>assistant\n"
)
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@asynccontextmanager
async def scripted(
    tokenizer: Any, text: str, reasoning_template: bool = False, **kw: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """A fake model that answers `text` (then end of sequence), with a Hermes/Qwen tool template."""
    script = tokenizer.encode(text, add_special_tokens=False)
    async with fake_server(
        tokenizer,
        script=script,
        eos_after=len(script),
        chat_template=QWEN_TEMPLATE,
        reasoning_template=reasoning_template,
        **kw,
    ) as (client, _, ctx):
        yield client, ctx.models.default().name


CALL = (
    'I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)


async def test_tool_call_non_streaming_shape(smollm_tokenizer: Any) -> None:
    async with scripted(
        smollm_tokenizer,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ) as (client, _):
        r = await client.post("/v1/chat/completions", json=chat(tools=WEATHER))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


async def test_tool_call_streaming_deltas_and_sdk_accumulator(smollm_tokenizer: Any) -> None:
    import openai

    async with scripted(smollm_tokenizer, CALL) as (client, model):
        sdk = openai.OpenAI(
            base_url=f"{str(client.base_url).rstrip('/')}/v1",
            api_key="x",
            max_retries=0,
            _strict_response_validation=True,
        )
        messages: Any = [{"role": "user", "content": "weather?"}]

        def raw_stream() -> list[Any]:
            return list(
                sdk.chat.completions.create(
                    model=model, messages=messages, tools=WEATHER, stream=True
                )
            )

        def helper_stream() -> Any:
            # The SDK's own accumulator checks the delta shapes as it merges them.
            with sdk.chat.completions.stream(
                model=model, messages=messages, tools=WEATHER
            ) as stream:
                for _ in stream:
                    pass
                return stream.get_final_completion()

        # The sync SDK runs in a thread so this test's Trio loop keeps serving it.
        deltas = await trio.to_thread.run_sync(raw_stream)
        final = await trio.to_thread.run_sync(helper_stream)
        sdk.close()
    calls = [
        d.choices[0].delta.tool_calls for d in deltas if d.choices and d.choices[0].delta.tool_calls
    ]
    first, *rest = [c[0] for c in calls]
    assert (
        first.index == 0
        and first.id
        and first.type == "function"
        and first.function.name == "get_weather"
    )
    assert all(c.id is None and c.type is None and c.function.name is None for c in rest)
    args = (first.function.arguments or "") + "".join(c.function.arguments or "" for c in rest)
    assert json.loads(args) == {"city": "Paris"}
    text = "".join(d.choices[0].delta.content or "" for d in deltas if d.choices)
    assert text == "I will check."
    assert deltas[-1].choices[0].finish_reason == "tool_calls"
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }
    assert final.choices[0].message.content == "I will check."
    assert final.choices[0].finish_reason == "tool_calls"


async def test_tool_choice_none_leaves_the_text_alone(smollm_tokenizer: Any) -> None:
    async with scripted(smollm_tokenizer, CALL) as (client, _):
        r = await client.post("/v1/chat/completions", json=chat(tools=WEATHER, tool_choice="none"))
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == CALL and "tool_calls" not in msg
    assert r.json()["choices"][0]["finish_reason"] == "stop"


async def test_bad_tool_choice_is_a_400_naming_the_field(smollm_tokenizer: Any) -> None:
    async with scripted(smollm_tokenizer, CALL) as (client, _):
        for choice in (
            {"type": "function", "function": {"name": "get_time"}},  # not among the tools
            {"type": "function"},
            "always",
        ):
            r = await client.post(
                "/v1/chat/completions", json=chat(tools=WEATHER, tool_choice=choice)
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        bad = await client.post("/v1/chat/completions", json=chat(tools=[{"type": "web_search"}]))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].type"
        # A tool whose parameters llguidance cannot compile fails before any generation.
        broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]
        r = await client.post(
            "/v1/chat/completions", json=chat(tools=broken, tool_choice="required")
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


async def test_reasoning_is_split_the_same_way_streamed_and_not(smollm_tokenizer: Any) -> None:
    text = "<think>\nThe user greets me.\n</think>\n\nHello!"
    async with scripted(smollm_tokenizer, text, reasoning_template=True) as (client, _):
        whole = (await client.post("/v1/chat/completions", json=chat())).json()["choices"][0][
            "message"
        ]
        async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            frames = [
                json.loads(line[6:])
                for line in [x async for x in r.aiter_lines()]
                if line.startswith("data: {")
            ]
    assert whole["reasoning_content"] == whole["reasoning"] == "The user greets me."
    assert whole["content"] == "Hello!"
    deltas = [f["choices"][0]["delta"] for f in frames if f["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]


async def test_template_kwargs_reach_the_chat_template(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer) as (client, _, _):
        base = (await client.post("/apply-template", json=chat("hi"))).json()["prompt"]
        # The SmolLM2 template has no variables for these: the render is unchanged, and accepted.
        same = await client.post(
            "/apply-template",
            json=chat(
                "hi", reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}
            ),
        )
        assert same.status_code == 200 and same.json()["prompt"] == base
        bad = await client.post(
            "/apply-template", json=chat("hi", chat_template_kwargs={"messages": []})
        )
        assert bad.status_code == 400 and bad.json()["error"]["code"] == 400


def test_template_kwargs_are_passed_to_jinja(smollm_tokenizer: Any) -> None:
    from mlxcel.actors.tokenizer import TokenizerActor
    from mlxcel.http.openai_wire import chat_request

    class Recording:
        def __init__(self) -> None:
            self.kwargs: dict[str, Any] = {}

        def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
            self.kwargs = kwargs
            return "x"

    tok = Recording()
    actor = TokenizerActor.__new__(TokenizerActor)
    actor._tok = tok  # only render() is exercised
    actor._tool_format = None
    actor._reasoning = None
    _, gen = chat_request(
        chat("hi", reasoning_effort="high", chat_template_kwargs={"enable_thinking": True})
    )
    actor.render(gen)
    assert tok.kwargs["reasoning_effort"] == "high" and tok.kwargs["enable_thinking"] is True


async def test_a_model_that_cannot_batch_serves_one_request_at_a_time(
    smollm_tokenizer: Any,
) -> None:
    # A vision family whose language model keeps one prompt's positions (models/vlm.py).
    async with fake_server(smollm_tokenizer, parallel=4, max_rows=1, step_delay=0.01) as (
        client,
        backend,
        _,
    ):
        assert (await client.get("/props")).json()["total_slots"] == 1
        most = 0

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, backend.rows)
                await trio.sleep(0.002)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)

            async def ask() -> None:
                r = await client.post("/v1/chat/completions", json=chat(max_tokens=6))
                assert r.status_code == 200

            async with trio.open_nursery() as requests:
                for _ in range(3):
                    requests.start_soon(ask)
            nursery.cancel_scope.cancel()
        assert most == 1

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
import trio

from mlxcel.actors.model_runner.backend import ModelInfo
from mlxcel.actors.model_runner.fake import FakeBackend
from mlxcel.http.context import ServerContext
from mlxcel.runtime.settings import Settings
from mlxcel.server import serve
from tests.conftest import free_port

HELLO = [19556, 28, 905, 17]  # token ids; decoded below rather than trusted


@asynccontextmanager
async def fake_server(
    tokenizer: Any, *, script: list[int] | None = None, **kw: Any
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
        chat_template=None,
    )
    backend = FakeBackend(info, script=script or HELLO, **kw)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        _, ctx = await nursery.start(lambda task_status: serve(settings, build_backend=lambda: backend, stop=stop, task_status=task_status))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.port}", timeout=30) as client:
            yield client, backend, ctx
        stop.set()


def chat(content: str = "Hi", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
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
        await trio.sleep(0.2)
        assert backend.steps <= steps + 1, "the sequence kept running after its stop string"


async def test_full_queue_is_503_before_any_stream_byte(smollm_tokenizer: Any) -> None:
    async with fake_server(
        smollm_tokenizer, parallel=1, max_queue_depth=1, step_delay=0.02
    ) as (client, _, ctx):
        async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=10_000)) as running:
            assert running.status_code == 200
            async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=10_000)) as queued:
                assert queued.status_code == 200
                await wait_until(lambda: ctx.admission.queued == 1)
                r = await client.post("/v1/chat/completions", json=chat(stream=True))
                assert r.status_code == 503
                assert r.headers["content-type"].startswith("application/json")
                assert r.json()["error"]["type"] == "server_busy"


async def test_disconnect_mid_prefill_stops_within_one_chunk(smollm_tokenizer: Any) -> None:
    long_prompt = "word " * 6000  # ~6000 tokens: 12 chunks of 512
    async with fake_server(smollm_tokenizer, ctx_size=16384, step_delay=0.05) as (client, backend, ctx):
        async with client.stream("POST", "/v1/chat/completions", json=chat(long_prompt, stream=True)) as r:
            assert r.status_code == 200
            await wait_until(lambda: sum(backend.chunks_done.values()) >= 2)
        chunks_at_disconnect = sum(backend.chunks_done.values())
        await trio.sleep(0.5)  # ten more steps' worth of time
        assert sum(backend.chunks_done.values()) <= chunks_at_disconnect + 1
        assert ctx.admission.queued == 0
        # The freed slot serves the next request at once.
        r2 = await client.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert r2.status_code == 200


async def test_disconnected_non_streaming_request_stops_too(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer, step_delay=0.02) as (client, backend, _):
        with trio.move_on_after(0.3):
            await client.post("/v1/chat/completions", json=chat(max_tokens=100_000))
        await trio.sleep(0.1)
        steps = backend.steps
        await trio.sleep(0.3)
        assert backend.steps == steps, "generation went on after the client left"


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


async def test_keepalive_comments_flow_during_a_long_prefill(smollm_tokenizer: Any) -> None:
    async with fake_server(
        smollm_tokenizer, ctx_size=16384, step_delay=0.1, sse_ping_interval=0.15
    ) as (client, _, _):
        async with client.stream("POST", "/v1/chat/completions", json=chat("word " * 3000, stream=True, max_tokens=1)) as r:
            lines = [line async for line in r.aiter_lines() if line]
    assert ": keepalive" in lines
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert lines[-1] == "data: [DONE]"


async def test_shutdown_rejects_new_work_with_503(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer) as (client, _, ctx):
        ctx.admission.drain()
        r = await client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "unavailable_error"

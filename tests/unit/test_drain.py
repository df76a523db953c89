"""The shutdown drain on the fake backend, in-process: what a client of a running stream, a new
client and a load balancer see between the stop signal and the server's return."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from mlxcel.actors.model_runner.backend import ModelInfo
from mlxcel.actors.model_runner.fake import FakeBackend
from mlxcel.runtime.errors import ShuttingDown
from mlxcel.runtime.settings import Settings
from mlxcel.runtime.slot import AbortBox, OutputSlot, Reservation
from mlxcel.server import serve
from tests.conftest import free_port
from tests.support.pipeline import admission

CHAT = [{"role": "user", "content": "Hi"}]


async def test_stop_ends_a_running_stream_with_length_and_done(smollm_tokenizer: Any) -> None:
    settings = Settings(port=free_port(), warmup=False, graceful_timeout=1.0)
    info = ModelInfo(
        model_id="fake",
        path=None,
        tokenizer=smollm_tokenizer,
        eos_token_ids=frozenset({smollm_tokenizer.eos_token_id}),
        context_length=settings.ctx_size,
        chat_template=None,
    )
    backend = FakeBackend(info, script=[19556, 28, 905, 17], step_delay=0.01)
    stop = trio.Event()
    frames: list[str] = []
    async with trio.open_nursery() as nursery:
        _, ctx = await nursery.start(
            lambda task_status: serve(
                settings, build_backend=lambda: backend, stop=stop, task_status=task_status
            )
        )
        base = f"http://127.0.0.1:{settings.port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            body = {"messages": CHAT, "max_tokens": 100_000, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        frames.append(line[6:])
                    if len(frames) == 5:
                        break
                stop.set()
                await trio.testing.wait_all_tasks_blocked()  # the server has seen it
                assert admission(ctx).draining
                async with httpx.AsyncClient(base_url=base, timeout=30) as other:
                    health = await other.get("/health")
                    refused = await other.post("/v1/chat/completions", json={"messages": CHAT})
                async for line in lines:
                    if line.startswith("data: "):
                        frames.append(line[6:])
    assert health.status_code == 503 and health.headers["Retry-After"] == "1"
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert frames[-1] == "[DONE]"
    final = json.loads(frames[-2])["choices"][0]
    assert final["finish_reason"] == "length"


def test_interrupt_before_tokenizing_is_a_503_after_is_a_cut_answer() -> None:
    aborts = AbortBox()
    waiting = OutputSlot("a", Reservation(None, None), aborts)
    waiting.interrupt(ShuttingDown())
    with pytest.raises(ShuttingDown):
        trio.run(waiting.wait_accepted)

    running = OutputSlot("b", Reservation(None, None), aborts, n=2)
    running.accept(3)
    running.push("Once", 1, choice=1)
    running.finish("stop", choice=0)
    running.interrupt(ShuttingDown())
    updates = trio.run(running.next_choices)
    assert updates is not None
    assert [(u.index, u.text, u.finish_reason) for u in updates] == [
        (0, "", "stop"),
        (1, "Once", "length"),
    ]
    assert running.interrupted
    assert aborts.drain() == {"a", "b"}

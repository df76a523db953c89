"""The Responses API through the official openai SDK (strict validation) against a real
`mlxcel serve` on loopback with the tiny random llama; its store lives in a temporary cache dir,
and a restart on the same dir must keep what was stored."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.support.metrics import slots_idle

_OPEN: list[openai.OpenAI] = []


def sdk(server: ServerProcess) -> openai.OpenAI:
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    )
    _OPEN.append(client)
    return client


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    # A client left to the garbage collector warns about its pooled socket in whichever test
    # runs then (filterwarnings = error), e.g. after its server was killed.
    yield
    while _OPEN:
        _OPEN.pop().close()


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


def start(model: Path, store: Path, *extra: str) -> ServerProcess:
    return ServerProcess(
        ["-m", str(model), "--cache-dir", str(store), "--sse-ping-interval", "1", *extra]
    )


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, store_dir: Path) -> Iterator[ServerProcess]:
    s = start(tiny_model_dir, store_dir)
    yield s
    s.stop()


def test_create_with_a_string_and_with_items(server: ServerProcess) -> None:
    client = sdk(server)
    r = client.responses.create(model="default", input="Hello!", max_output_tokens=8)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 8 and r.output_text
    items: Any = [
        {"role": "system", "content": "You are terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]
    r2 = client.responses.create(model="default", input=items, max_output_tokens=4, temperature=0)
    r3 = client.responses.create(model="default", input=items, max_output_tokens=4, temperature=0)
    assert r2.output_text == r3.output_text  # greedy is deterministic
    assert r2.usage is not None and r2.usage.input_tokens > 5


def test_stream_events_in_order_and_stored_afterwards(server: ServerProcess) -> None:
    client = sdk(server)
    with client.responses.stream(
        model="default", input="Tell me a story.", max_output_tokens=12
    ) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    got = client.responses.retrieve(final.id)
    assert got.output_text == text and got.status == "incomplete"


def test_previous_response_id_chains_turns(server: ServerProcess) -> None:
    client = sdk(server)
    first = client.responses.create(
        model="default", input="My name is Ada.", max_output_tokens=6, temperature=0
    )
    second = client.responses.create(
        model="default",
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    alone = client.responses.input_tokens.count(model="default", input="What is my name?")
    chained = client.responses.input_tokens.count(
        model="default", input="What is my name?", previous_response_id=first.id
    )
    assert first.usage is not None and second.usage is not None
    # The second prompt holds the first turn's question and answer.
    assert second.usage.input_tokens == chained.input_tokens
    assert chained.input_tokens >= alone.input_tokens + first.usage.output_tokens + 4
    assert second.previous_response_id == first.id
    # The chained prompt starts with the first turn's: the prompt cache serves that prefix.
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_conversation_parameter_chains_turns(server: ServerProcess) -> None:
    client = sdk(server)
    conv = client.conversations.create()
    a = client.responses.create(
        model="default", input="One.", conversation=conv.id, max_output_tokens=4
    )
    b = client.responses.create(
        model="default", input="Two.", conversation={"id": conv.id}, max_output_tokens=4
    )
    assert a.usage is not None and b.usage is not None
    assert b.usage.input_tokens > a.usage.input_tokens + a.usage.output_tokens
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [getattr(i, "role", None) for i in items] == ["user", "assistant", "user", "assistant"]
    client.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_delete_and_input_items(server: ServerProcess) -> None:
    client = sdk(server)
    r = client.responses.create(model="default", input="Bye.", max_output_tokens=2)
    (item,) = client.responses.input_items.list(r.id).data
    assert item.type == "message" and item.role == "user"  # type: ignore[union-attr]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_cancel_an_in_flight_stream(server: ServerProcess) -> None:
    client = sdk(server)
    events: list[Any] = []
    started = threading.Event()

    def consume() -> None:
        with client.responses.stream(
            model="default", input="Go on forever.", max_output_tokens=100_000, temperature=0
        ) as stream:
            for e in stream:
                events.append(e)
                if e.type == "response.output_text.delta":
                    started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(120)
    rid = events[0].response.id
    cancelled = httpx.post(f"{server.base_url}/v1/responses/{rid}/cancel", timeout=60).json()
    reader.join(60)
    assert not reader.is_alive()
    assert cancelled["status"] == "cancelled"
    assert events[-1].response.status == "cancelled"
    assert client.responses.retrieve(rid).status == "cancelled"
    n = sum(e.type == "response.output_text.delta" for e in events)
    assert n < 10_000


def _until_done(client: openai.OpenAI, rid: str) -> tuple[Any, set[str]]:
    seen: set[str] = set()
    for _ in range(600):
        r = client.responses.retrieve(rid)
        seen.add(r.status or "")
        if r.status not in ("queued", "in_progress"):
            return r, seen
        time.sleep(0.05)
    raise AssertionError(f"{rid} still {r.status} after 30 s")


def _wait_running(client: openai.OpenAI, rid: str) -> None:
    for _ in range(600):
        running = client.responses.retrieve(rid)
        if running.status == "in_progress" and running.output_text:
            return
        time.sleep(0.05)
    raise AssertionError(f"{rid} never showed output")


def test_a_background_response_is_polled_to_its_end(server: ServerProcess) -> None:
    client = sdk(server)
    r = client.responses.create(
        model="default", input="Tell me a long story.", background=True, max_output_tokens=300
    )
    assert r.status == "queued" and r.background is True and r.output == []
    final, seen = _until_done(client, r.id)
    assert "in_progress" in seen  # it ran after the request had been answered
    assert final.status == "incomplete" and final.background is True
    assert final.usage is not None and final.usage.output_tokens == 300 and final.output_text
    (item,) = client.responses.input_items.list(r.id).data
    assert item.type == "message"


def test_a_background_response_is_cancelled(server: ServerProcess) -> None:
    client = sdk(server)
    r = client.responses.create(
        model="default",
        input="Go on forever.",
        background=True,
        max_output_tokens=100_000,
        temperature=0,  # greedy never samples EOS on this model; sampling might
    )
    _wait_running(client, r.id)
    cancelled = client.responses.cancel(r.id)
    got = client.responses.retrieve(r.id)
    assert cancelled.status == "cancelled" and got.status == "cancelled"
    assert got.usage is not None and 0 < got.usage.output_tokens < 100_000
    assert slots_idle(server.base_url)


def test_a_background_stream_outlives_its_client_and_resumes(server: ServerProcess) -> None:
    body = {
        "model": "default",
        "input": "Tell me a story.",
        "background": True,
        "stream": True,
        "max_output_tokens": 200,
        "temperature": 0,
    }
    first: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                first.append(json.loads(line[6:]))
                if len(first) == 8:
                    break  # the client leaves: the response goes on
    rid = first[0]["response"]["id"]
    assert first[0]["response"]["status"] == "queued"
    assert [e["sequence_number"] for e in first] == list(range(8))
    client = sdk(server)
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=7))
    assert [e.sequence_number for e in rest] == list(range(8, 8 + len(rest)))
    assert rest[-1].type == "response.incomplete"
    deltas = [e["delta"] for e in first if e["type"] == "response.output_text.delta"]
    deltas += [e.delta for e in rest if e.type == "response.output_text.delta"]
    stored = client.responses.retrieve(rid)
    assert "".join(deltas) == stored.output_text and stored.usage is not None
    assert stored.usage.output_tokens == 200
    # From the start, all of it again.
    again = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in again] == list(range(8 + len(rest)))
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.retrieve(rid, stream=True, starting_after="x")  # type: ignore[arg-type]
    assert bad.value.body["param"] == "starting_after"  # type: ignore[index]


def test_deleting_a_running_background_response_stops_it(server: ServerProcess) -> None:
    client = sdk(server)
    r = client.responses.create(
        model="default",
        input="Go on forever.",
        background=True,
        max_output_tokens=100_000,
        temperature=0,  # greedy never samples EOS on this model; sampling might
    )
    _wait_running(client, r.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    assert slots_idle(server.base_url)


def test_error_envelopes(server: ServerProcess) -> None:
    client = sdk(server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="default", input="x", background=True, store=False)
    assert bad.value.body["param"] == "background"  # type: ignore[index]
    r = client.responses.create(model="default", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as again:
        client.responses.retrieve(r.id, stream=True)
    assert again.value.body["param"] == "stream"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as tool:
        client.responses.create(model="default", input="x", tools=[{"type": "web_search"}])
    assert "web_search" in tool.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="default", input="x", previous_response_id="resp_missing")


def test_restart_keeps_stored_responses(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = start(tiny_model_dir, tmp_path)
    try:
        r = sdk(first).responses.create(model="default", input="Remember me.", max_output_tokens=3)
    finally:
        first.proc.kill()  # no graceful shutdown: what was answered must already be on disk
        first.stop()
    second = start(tiny_model_dir, tmp_path)
    try:
        got = sdk(second).responses.retrieve(r.id)
        chained = sdk(second).responses.create(
            model="default", input="Again.", previous_response_id=r.id, max_output_tokens=2
        )
    finally:
        second.stop()
    assert got.output_text == r.output_text and got.status == r.status
    assert chained.previous_response_id == r.id


def test_a_shutdown_ends_and_stores_a_background_response(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    first = start(tiny_model_dir, tmp_path, "--graceful-timeout", "4")
    try:
        client = sdk(first)
        r = client.responses.create(
            model="default",
            input="Go on forever.",
            background=True,
            max_output_tokens=100_000,
            temperature=0,  # greedy never samples EOS on this model; sampling might
        )
        _wait_running(client, r.id)
    finally:
        status = first.stop()  # SIGTERM: the drain ends the generation
    second = start(tiny_model_dir, tmp_path)
    try:
        got = sdk(second).responses.retrieve(r.id)
    finally:
        second.stop()
    assert status == 0
    assert got.status == "incomplete" and got.output_text
    assert got.usage is not None and 0 < got.usage.output_tokens < 100_000


def test_store_off_says_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    s = start(tiny_model_dir, tmp_path, "--responses-store-max-entries", "0")
    try:
        client = sdk(s)
        r = client.responses.create(model="default", input="Hi", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as off:
            client.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as background:
            client.responses.create(model="default", input="Hi", background=True)
    finally:
        s.stop()
    assert r.store is False
    assert "--responses-store-max-entries" in off.value.message
    assert background.value.body["param"] == "background"  # type: ignore[index]

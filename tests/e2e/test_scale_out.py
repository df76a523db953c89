"""Two `mlxcel serve` replicas on one PostgreSQL store behind HAProxy, all real, on loopback.

HAProxy runs tools/scale-out/haproxy.cfg itself (ports come in through its environment). The
checks go through the balancer and, to prove the replicas are different processes, to each
replica directly: a response stored on one is retrieved, chained, cancelled and deleted through
the other; a stream running on one is cancelled through the other; the store answers 503 while
PostgreSQL is down and the server keeps serving the rest; a replica killed mid-stream leaves the
other serving through the balancer and the store missing nothing. PostgreSQL or HAProxy missing
is a failure that names the package, never a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import REPO, ServerProcess, free_port
from tests.support.metrics import slots_idle
from tests.support.postgres import PostgresServer

CONFIG = REPO / "tools" / "scale-out" / "haproxy.cfg"


class Balancer:
    def __init__(self, replicas: list[ServerProcess], log: Path) -> None:
        binary = shutil.which("haproxy")
        assert binary, "HAProxy is not installed: `apt-get install -y haproxy` (.ci/run does this)"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "MLXCEL_LB_BIND": f"127.0.0.1:{self.port}",
            "MLXCEL_REPLICA_1": f"127.0.0.1:{replicas[0].port}",
            "MLXCEL_REPLICA_2": f"127.0.0.1:{replicas[1].port}",
        }
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [binary, "-db", "-f", str(CONFIG)], env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"haproxy exited: {log.read_text()}"
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "haproxy did not start"
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self._log.close()


class Cluster:
    def __init__(self, pg: PostgresServer, a: ServerProcess, b: ServerProcess, lb: Balancer):
        self.pg, self.a, self.b, self.lb = pg, a, b, lb


@pytest.fixture(scope="module")
def cluster(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, postgres: PostgresServer
) -> Iterator[Cluster]:
    assert shutil.which("haproxy"), (
        "HAProxy is not installed: `apt-get install -y haproxy` (.ci/run does this)"
    )
    pg = postgres
    replicas: list[ServerProcess] = []
    lb = None
    try:
        for _ in range(2):
            replicas.append(
                ServerProcess(
                    [
                        "-m",
                        str(tiny_model_dir),
                        "--store",
                        pg.url,
                        "--sse-ping-interval",
                        "1",
                        "--cache-dir",
                        str(tmp_path_factory.mktemp("cache")),
                    ]
                )  # fmt: skip
            )
        lb = Balancer(replicas, tmp_path_factory.mktemp("lb") / "haproxy.log")
        yield Cluster(pg, replicas[0], replicas[1], lb)
    finally:
        if lb is not None:
            lb.stop()
        for r in replicas:
            r.stop()


_OPEN: list[openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def sdk(base_url: str) -> openai.OpenAI:
    client = openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True
    )
    _OPEN.append(client)
    return client


def stream_until_started(base_url: str, events: list[Any]) -> tuple[threading.Thread, str]:
    """A long stream in a thread; returns once text flows, with the response id."""
    started = threading.Event()

    def consume() -> None:
        try:
            with sdk(base_url).responses.stream(
                model="default", input="Go on forever.", max_output_tokens=100_000, temperature=0
            ) as stream:
                for e in stream:
                    events.append(e)
                    if e.type == "response.output_text.delta":
                        started.set()
        except (openai.APIError, httpx.HTTPError) as error:  # the killed replica's stream
            events.append(error)
            started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(120)
    return reader, events[0].response.id


def test_the_replicas_are_two_processes_and_headers_pin_a_replica(cluster: Cluster) -> None:
    assert cluster.a.proc.pid != cluster.b.proc.pid
    seen: dict[str, set[str]] = {}
    for conv in ("conv_alpha", "conv_beta", "conv_gamma", "conv_delta"):
        for _ in range(3):
            r = httpx.get(f"{cluster.lb.base_url}/health", headers={"X-Conversation-Id": conv})
            assert r.status_code == 200
            seen.setdefault(conv, set()).add(r.headers["X-Served-By"])
    # One replica per conversation, always the same.
    assert all(len(servers) == 1 for servers in seen.values()), seen
    # Without the header, requests go round-robin over both.
    plain = {httpx.get(f"{cluster.lb.base_url}/health").headers["X-Served-By"] for _ in range(4)}
    assert plain == {"replica1", "replica2"}


def test_a_dropped_stream_resumes_through_the_balancer(cluster: Cluster) -> None:
    lb = cluster.lb.base_url
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "stream": True,
        "max_tokens": 64,
    }
    # Several ids: a replay sent to a replica at random would miss for some of them.
    for cid in ("conv_one", "conv_two", "conv_three", "conv_four"):
        with httpx.stream(
            "POST", f"{lb}/v1/chat/completions", json=body,
            headers={"X-Conversation-Id": cid}, timeout=60,
        ) as r:  # fmt: skip
            assert r.status_code == 200
            served = r.headers["X-Served-By"]
            for _ in r.iter_raw():
                break  # hang up after the first bytes; the generation runs on
        # The replay names the id only in its query: it reaches the replica that holds it.
        replay = httpx.get(f"{lb}/v1/stream", params={"conv_id": cid}, timeout=60)
        assert replay.status_code == 200, (cid, replay.text)
        assert replay.headers["X-Served-By"] == served
        assert replay.content.rstrip().endswith(b"data: [DONE]")


def test_stored_on_one_replica_used_through_the_other(cluster: Cluster) -> None:
    a, b = sdk(cluster.a.base_url), sdk(cluster.b.base_url)
    first = a.responses.create(model="default", input="Hello", max_output_tokens=8)
    assert first.status in ("completed", "incomplete")
    got = b.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    # Chained on B from A's response: B reads A's context from the shared store.
    second = b.responses.create(
        model="default", input="And then?", previous_response_id=first.id, max_output_tokens=8
    )
    items = a.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"]
    assert sdk(cluster.lb.base_url).responses.retrieve(second.id).previous_response_id == first.id
    # Cancelling a finished response on B marks it, as on one server; A sees the mark.
    assert b.responses.cancel(first.id).status == "cancelled"
    assert a.responses.retrieve(first.id).status == "cancelled"
    # Deleted through B, gone for A.
    assert b.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)


def test_a_conversation_is_shared(cluster: Cluster) -> None:
    a, b = sdk(cluster.a.base_url), sdk(cluster.b.base_url)
    conv = a.conversations.create(metadata={"topic": "scale-out"})
    # A turn on B, and another on A, both land in the one conversation.
    b.responses.create(model="default", input="One", conversation=conv.id, max_output_tokens=4)
    a.responses.create(model="default", input="Two", conversation=conv.id, max_output_tokens=4)
    items = b.conversations.items.list(conv.id, order="asc").data
    users = [i.model_dump() for i in items if i.type == "message" and i.role == "user"]
    assert [u["content"][0]["text"] for u in users] == ["One", "Two"]
    assert b.conversations.retrieve(conv.id).metadata == {"topic": "scale-out"}
    b.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        a.conversations.retrieve(conv.id)


def test_a_stream_on_one_replica_is_cancelled_through_the_other(cluster: Cluster) -> None:
    events: list[Any] = []
    reader, rid = stream_until_started(cluster.a.base_url, events)
    # B shows it running (as it started), then cancels it on A by NOTIFY.
    shown = httpx.get(f"{cluster.b.base_url}/v1/responses/{rid}", timeout=10).json()
    assert shown["status"] == "in_progress"
    cancelled = httpx.post(f"{cluster.b.base_url}/v1/responses/{rid}/cancel", timeout=30)
    reader.join(30)
    assert not reader.is_alive()
    assert cancelled.json()["status"] == "cancelled"
    assert events[-1].response.status == "cancelled"
    assert sdk(cluster.lb.base_url).responses.retrieve(rid).status == "cancelled"
    # Far less than the 100 000 tokens asked for: the generation stopped on A.
    assert sum(e.type == "response.output_text.delta" for e in events) < 10_000


def test_a_background_response_on_one_replica_is_cancelled_through_the_other(
    cluster: Cluster,
) -> None:
    a, b = sdk(cluster.a.base_url), sdk(cluster.b.base_url)
    r = a.responses.create(
        model="default",
        input="Go on forever.",
        background=True,
        max_output_tokens=100_000,
        temperature=0,  # greedy never samples EOS on this model; sampling might
    )
    assert r.status == "queued"
    deadline = time.monotonic() + 60
    while not (running := a.responses.retrieve(r.id)).output_text:
        assert time.monotonic() < deadline and running.status == "in_progress"
        time.sleep(0.05)
    assert b.responses.retrieve(r.id).status == "in_progress"  # B sees it as it runs on A
    cancelled = b.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    # A stopped it (NOTIFY) and stored what it had made: both replicas read the same object.
    on_a, on_b = a.responses.retrieve(r.id), b.responses.retrieve(r.id)
    assert on_a.status == on_b.status == "cancelled" and on_b.background is True
    assert on_b.output_text == on_a.output_text != ""
    assert on_b.usage is not None and 0 < on_b.usage.output_tokens < 100_000
    assert slots_idle(cluster.a.base_url)


def test_database_down_is_a_503_for_the_store_only(cluster: Cluster) -> None:
    kept = sdk(cluster.a.base_url).responses.create(
        model="default", input="Hi", max_output_tokens=4
    )
    cluster.pg.stop()
    try:
        r = httpx.get(f"{cluster.lb.base_url}/v1/responses/{kept.id}", timeout=30)
        assert r.status_code == 503
        assert "PostgreSQL" in r.json()["error"]["message"]
        chat = httpx.post(
            f"{cluster.lb.base_url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=60,
        )
        assert chat.status_code == 200
        assert httpx.get(f"{cluster.a.base_url}/health").status_code == 200
    finally:
        cluster.pg.start()
    deadline = time.monotonic() + 20
    while (r := httpx.get(f"{cluster.b.base_url}/v1/responses/{kept.id}")).status_code == 503:
        assert time.monotonic() < deadline, "the store did not come back"
        time.sleep(0.2)
    assert r.json()["id"] == kept.id


def test_a_replica_killed_mid_stream(cluster: Cluster) -> None:
    lb = sdk(cluster.lb.base_url)
    stored = [
        lb.responses.create(model="default", input=f"Item {i}", max_output_tokens=4).id
        for i in range(4)
    ]
    events: list[Any] = []
    reader, rid = stream_until_started(cluster.a.base_url, events)
    cluster.a.proc.send_signal(signal.SIGKILL)
    cluster.a.proc.wait(10)
    reader.join(30)
    assert not reader.is_alive()
    # The balancer keeps serving (a connection refused is retried on the other replica).
    for i in range(4):
        r = lb.responses.create(model="default", input=f"After {i}", max_output_tokens=4)
        stored.append(r.id)
    # Nothing that was stored is lost; all of it through the balancer.
    for sid in stored:
        assert lb.responses.retrieve(sid).id == sid
    # The killed stream was never stored, and is not shown as running any more.
    deadline = time.monotonic() + 10
    while (r := httpx.get(f"{cluster.lb.base_url}/v1/responses/{rid}")).status_code != 404:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)

"""Resumable streams: `X-Conversation-Id`, `GET`/`DELETE /v1/stream`, `/v1/streams/lookup`,
on the real server (the tiny model: fast, and it rambles until max_tokens)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ServerProcess

KEEPALIVE = b": keepalive\n\n"


def _cid() -> str:
    return f"conv-{uuid.uuid4().hex[:8]}"


def _chat(max_tokens: int) -> dict[str, object]:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "stream": True,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
    }


def _read_some(url: str, body: dict[str, object], headers: dict[str, str], n: int) -> bytes:
    """Start a stream, keep its first ``n``-odd bytes, and hang up."""
    got = b""
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_raw():
            got += chunk
            if len(got) >= n:
                break
    return got


def _frames(raw: bytes) -> list[bytes]:
    return [f for f in raw.replace(KEEPALIVE, b"").split(b"\n\n") if f]


def _wait_done(base: str, cid: str, headers: dict[str, str] | None = None) -> dict[str, object]:
    deadline = time.monotonic() + 60
    while True:
        found = httpx.post(
            f"{base}/v1/streams/lookup", json={"conversation_ids": [cid]}, headers=headers
        ).json()
        assert len(found) == 1, found
        if found[0]["is_done"] or time.monotonic() > deadline:
            return dict(found[0])
        time.sleep(0.2)


def test_a_dropped_chat_stream_runs_on_and_resumes_from_the_last_byte(
    tiny_server: ServerProcess,
) -> None:
    base, cid = tiny_server.base_url, _cid()
    seen = _read_some(f"{base}/v1/chat/completions", _chat(200), {"X-Conversation-Id": cid}, 600)
    # The client is gone; the generation is not: it finishes on its own.
    status = _wait_done(base, cid)
    assert status["conversation_id"] == cid and status["completed_at"] >= status["started_at"]
    seen = seen.replace(KEEPALIVE, b"")
    rest = httpx.get(f"{base}/v1/stream", params={"conv_id": cid, "from": len(seen)}).content
    whole = seen + rest
    assert len(whole) == status["total_bytes"]
    frames = _frames(whole)
    assert frames[-1] == b"data: [DONE]"
    chunks = [json.loads(f[len(b"data: ") :]) for f in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert finish[0]["choices"][0]["finish_reason"] == "length"
    # Every token arrived exactly once across the cut: the usage counts all 200.
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text
    # A replay from 0 is the very same bytes.
    assert httpx.get(f"{base}/v1/stream", params={"conv_id": cid}).content == whole


def test_the_openai_sdk_streams_normally_with_a_conversation_id(
    openai_client: openai.OpenAI,
) -> None:
    stream = openai_client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        max_tokens=12,
        extra_headers={"X-Conversation-Id": _cid()},
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.mark.parametrize(
    ("path", "body", "last"),
    [
        ("/completion", {"prompt": "Once", "n_predict": 40, "stream": True}, b'"stop":true'),
        ("/v1/completions", {"prompt": "Once", "max_tokens": 40, "stream": True}, b"[DONE]"),
        (
            "/v1/messages",
            {
                "model": "default",
                "max_tokens": 40,
                "stream": True,
                "messages": [{"role": "user", "content": "Hi"}],
            },
            b"event: message_stop",
        ),
        (
            "/v1/responses",
            {"model": "default", "input": "Hi", "max_output_tokens": 40, "stream": True},
            b"event: response.incomplete",
        ),
    ],
)
def test_every_stream_family_replays_byte_for_byte(
    tiny_server: ServerProcess, path: str, body: dict[str, object], last: bytes
) -> None:
    base, cid = tiny_server.base_url, _cid()
    with httpx.stream(
        "POST", f"{base}{path}", json=body, headers={"X-Conversation-Id": cid}, timeout=60
    ) as r:
        assert r.status_code == 200
        live = r.read().replace(KEEPALIVE, b"")
    assert last in _frames(live)[-1]
    assert httpx.get(f"{base}/v1/stream", params={"conv_id": cid}).content == live


def test_delete_stops_a_live_generation_and_forgets_it(tiny_server: ServerProcess) -> None:
    base, cid = tiny_server.base_url, _cid()
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        json=_chat(4000),
        headers={"X-Conversation-Id": cid},
        timeout=60,
    ) as r:
        stream = r.iter_raw()
        first = next(stream)
        assert first.startswith(b"data: ")
        assert httpx.delete(f"{base}/v1/stream", params={"conv_id": cid}).status_code == 204
        rest = b"".join(stream)
    # The reader was ended mid-answer: no finish, no [DONE].
    assert b"[DONE]" not in first + rest
    assert httpx.post(f"{base}/v1/streams/lookup", json={"conversation_ids": [cid]}).json() == []
    r = httpx.get(f"{base}/v1/stream", params={"conv_id": cid})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "Stream not found or expired"
    # The generation itself stopped: every slot is free again, long before 4,000 tokens.
    deadline = time.monotonic() + 10
    while any(s["is_processing"] for s in httpx.get(f"{base}/slots").json()):
        assert time.monotonic() < deadline, "the generation kept running after DELETE"
        time.sleep(0.1)
    # Idempotent, and unknown ids are fine too.
    assert httpx.delete(f"{base}/v1/stream", params={"conv_id": cid}).status_code == 204


def test_a_new_stream_under_the_same_id_replaces_the_old_one(tiny_server: ServerProcess) -> None:
    base, cid = tiny_server.base_url, _cid()
    headers = {"X-Conversation-Id": cid}
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=_chat(4000), headers=headers, timeout=60
    ) as old:
        stream = old.iter_raw()
        next(stream)
        short = httpx.post(
            f"{base}/v1/chat/completions", json=_chat(8), headers=headers, timeout=60
        )
        assert _frames(short.content)[-1] == b"data: [DONE]"
        assert b"[DONE]" not in b"".join(stream)
    found = httpx.post(f"{base}/v1/streams/lookup", json={"conversation_ids": [cid]}).json()
    assert len(found) == 1 and found[0]["total_bytes"] == len(short.content.replace(KEEPALIVE, b""))


def test_lookup_matches_model_variants_and_lists_only_what_was_asked(
    tiny_server: ServerProcess,
) -> None:
    base, cid = tiny_server.base_url, _cid()
    for variant in (cid, f"{cid}::m1", f"{cid}x"):
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json=_chat(4),
            headers={"X-Conversation-Id": variant},
            timeout=60,
        )
        assert r.status_code == 200
    found = httpx.post(
        f"{base}/v1/streams/lookup", json={"conversation_ids": [cid, "never-seen"]}
    ).json()
    assert sorted(s["conversation_id"] for s in found) == [cid, f"{cid}::m1"]
    assert all(s["is_done"] and s["total_bytes"] > 0 for s in found)


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "message"),
    [
        ("GET", "/v1/stream", {}, 400, "Missing conversation id"),
        ("GET", "/v1/stream", {"params": {"conv_id": "nope"}}, 404, "Stream not found"),
        ("DELETE", "/v1/stream", {}, 400, "Missing conversation id"),
        ("POST", "/v1/streams/lookup", {"json": {"conversation_ids": "x"}}, 400, "list"),
        ("POST", "/v1/streams/lookup", {"content": b"{"}, 400, "Invalid JSON"),
    ],
)
def test_bad_stream_requests_get_openai_errors(
    tiny_server: ServerProcess,
    method: str,
    path: str,
    kwargs: dict[str, object],
    status: int,
    message: str,
) -> None:
    r = httpx.request(method, f"{tiny_server.base_url}{path}", **kwargs)  # type: ignore[arg-type]
    assert r.status_code == status
    error = r.json()["error"]
    assert message in error["message"] and error["type"] and "code" in error


def test_offsets_past_the_buffer_and_bad_offsets(tiny_server: ServerProcess) -> None:
    base, cid = tiny_server.base_url, _cid()
    r = httpx.post(f"{base}/v1/chat/completions", json=_chat(4), headers={"X-Conversation-Id": cid})
    size = len(r.content.replace(KEEPALIVE, b""))
    assert httpx.get(f"{base}/v1/stream", params={"conv_id": cid, "from": size}).content == b""
    for bad in ("-1", "abc", "1.5"):
        r = httpx.get(f"{base}/v1/stream", params={"conv_id": cid, "from": bad})
        assert r.status_code == 400 and r.json()["error"]["message"] == "Invalid 'from' offset"
    r = httpx.post(
        f"{base}/v1/chat/completions", json=_chat(4000), headers={"X-Conversation-Id": "x" * 300}
    )
    assert r.status_code == 400 and "X-Conversation-Id" in r.json()["error"]["message"]
    # Nothing was left running for the refused request.
    deadline = time.monotonic() + 10
    while any(s["is_processing"] for s in httpx.get(f"{base}/slots").json()):
        assert time.monotonic() < deadline, "a refused stream left its generation running"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        ["-m", str(tiny_model_dir), "--api-key", "alice", "--api-key", "bob", "--no-audio"]
    )
    yield server
    server.stop()


def test_a_stream_is_visible_only_to_the_key_that_started_it(
    keyed_server: ServerProcess,
) -> None:
    base, cid = keyed_server.base_url, _cid()
    alice = {"Authorization": "Bearer alice"}
    bob = {"X-Api-Key": "bob"}
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json=_chat(6),
        headers={**alice, "X-Conversation-Id": cid},
        timeout=60,
    )
    assert r.status_code == 200
    # Bob gets what an unknown id gets, and cannot stop Alice's stream.
    assert httpx.get(f"{base}/v1/stream", params={"conv_id": cid}, headers=bob).status_code == 404
    lookup = {"conversation_ids": [cid]}
    assert httpx.post(f"{base}/v1/streams/lookup", json=lookup, headers=bob).json() == []
    assert (
        httpx.delete(f"{base}/v1/stream", params={"conv_id": cid}, headers=bob).status_code == 204
    )
    assert len(httpx.post(f"{base}/v1/streams/lookup", json=lookup, headers=alice).json()) == 1
    replay = httpx.get(f"{base}/v1/stream", params={"conv_id": cid}, headers=alice)
    assert replay.content == r.content.replace(KEEPALIVE, b"")
    # No key at all: the usual 401.
    assert httpx.get(f"{base}/v1/stream", params={"conv_id": cid}).status_code == 401

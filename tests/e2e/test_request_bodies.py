"""Request bodies on the wire: chunked uploads, the size limit, and keep-alive after any answer."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess

LIMIT = 2 * 1024 * 1024  # tiny_server runs with the default --max-request-bytes
TIMEOUT = 10

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
# A route, its family's envelope, and a body it accepts.
BODY_ROUTES: list[tuple[str, str, dict[str, Any]]] = [
    ("/v1/chat/completions", "openai", CHAT),
    ("/v1/completions", "openai", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/messages", "anthropic", {**CHAT, "model": "default"}),
    ("/completion", "native", {"prompt": "hi", "n_predict": 1}),
    ("/tokenize", "native", {"content": "hi"}),
    ("/v1/audio/speech", "openai", {"model": "tts-1", "input": "hi", "voice": "alloy"}),
]


def over_limit() -> Iterator[bytes]:
    """A JSON body past the limit in 64 KiB chunks: httpx sends it chunked, no Content-Length."""
    yield b'{"prompt": "'
    for _ in range(LIMIT // 65536 + 16):
        yield b"x" * 65536
    yield b'"}'


def chunked(body: dict[str, Any]) -> Iterator[bytes]:
    raw = json.dumps(body).encode()
    for at in range(0, len(raw), 7):
        yield raw[at : at + 7]


def assert_413(r: httpx.Response, family: str) -> None:
    assert r.status_code == 413, r.text
    if family == "anthropic":
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "request_too_large"
    elif family == "native":
        assert r.json()["error"]["code"] == 413
    else:
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert "--max-request-bytes" in json.dumps(r.json())


@pytest.mark.parametrize(("path", "family", "_body"), BODY_ROUTES)
def test_chunked_body_over_the_limit_is_413(
    tiny_server: ServerProcess, path: str, family: str, _body: Any
) -> None:
    # One keep-alive client: the 413 closes its connection and the next request opens another
    # (it used to be answered on a connection that then never answered again).
    with httpx.Client(base_url=tiny_server.base_url, timeout=TIMEOUT) as client:
        for _ in range(2):
            r = client.post(
                path, content=over_limit(), headers={"content-type": "application/json"}
            )
            assert_413(r, family)
            assert client.get("/health").status_code == 200
            assert r.headers["connection"] == "close"


@pytest.mark.parametrize(("path", "family", "body"), BODY_ROUTES)
def test_chunked_body_under_the_limit_is_served(
    tiny_server: ServerProcess, path: str, family: str, body: dict[str, Any]
) -> None:
    with httpx.Client(base_url=tiny_server.base_url, timeout=TIMEOUT) as client:
        r = client.post(path, content=chunked(body), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert "connection" not in r.headers
        assert client.get("/health").status_code == 200


def test_content_length_over_the_limit_is_413_before_the_body_is_sent(
    tiny_server: ServerProcess,
) -> None:
    # The declared length alone earns the 413: the answer comes with no body byte sent.
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=TIMEOUT) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {LIMIT + 1}\r\n\r\n".encode()
        )
        head, body = read_answer(s)
        assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        assert s.recv(65536) == b""


def test_413_comes_as_the_limit_is_passed_and_then_the_connection_closes(
    tiny_server: ServerProcess,
) -> None:
    # The client has not finished its body: the 413 must not wait for the end, and the
    # connection must then close (it stayed open, its bytes read and dropped, forever).
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=TIMEOUT) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 65536
        for _ in range(LIMIT // len(chunk) + 2):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        head, body = read_answer(s)
        assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
        assert "--max-request-bytes" in json.loads(body)["error"]["message"]
        assert s.recv(65536) == b""


def read_answer(s: socket.socket) -> tuple[bytes, bytes]:
    """One answer with a Content-Length, read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = s.recv(65536)
        assert more, data
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    assert length is not None, head
    while len(body) < int(length[1]):
        more = s.recv(65536)
        assert more, body
        body += more
    return head, body


def _routes() -> list[tuple[str, str]]:
    """Every HTTP route of the real app, enumerated from its URL map, with its path filled in."""
    from mlxcel.http.app import create_app
    from mlxcel.http.context import ServerContext
    from mlxcel.runtime.settings import Settings

    ctx: Any = ServerContext.__new__(ServerContext)
    object.__setattr__(ctx, "settings", Settings())
    out = set()
    for rule in create_app(ctx).url_map.iter_rules():
        if rule.endpoint == "static" or rule.websocket:
            continue
        path = re.sub(r"<int:[^>]+>", "0", re.sub(r"<(?!int:)[^>]+>", "x", rule.rule))
        out.update((method, path) for method in rule.methods or () if method != "HEAD")
    return sorted(out)


def test_every_route_with_a_body_leaves_the_connection_usable(tiny_server: ServerProcess) -> None:
    # Whatever a route does with a body (reads it, answers before reading it, takes none), the
    # next request on the same keep-alive connection is answered. POST /v1/cache/reset and
    # DELETE /v1/responses/{id} left it unanswered; the trickled body arrives after the answer
    # is ready, which is when it went wrong.
    routes = _routes()
    assert len(routes) > 40
    body = json.dumps({"n_predict": 1, "max_tokens": 1}).encode()

    def trickled() -> Iterator[bytes]:
        yield body[:5]
        time.sleep(0.1)
        yield body[5:]

    with httpx.Client(base_url=tiny_server.base_url, timeout=TIMEOUT) as client:
        for method, path in routes:
            for content in (body, trickled()):
                headers = {"content-type": "application/json"}
                r = client.request(method, path, content=content, headers=headers)
                assert r.status_code != 413, (method, path)
                assert "connection" not in r.headers, (method, path)
                assert client.get("/health").status_code == 200, (method, path)

"""Keep-alive connections: an early answer must not wedge them; idle ones close after --timeout."""

from __future__ import annotations

import socket
import time

import httpx

from tests.conftest import ServerProcess

# Large enough that the body is still arriving when the early answer goes out.
BIG = {"input": ["word " * 4000] * 16, "model": "x"}


def test_next_request_on_the_connection_after_an_early_error(tiny_server: ServerProcess) -> None:
    # tiny_server has no embedder: /v1/embeddings answers 501 without needing the body. The
    # same connection must then serve the next request (it used to time out).
    with httpx.Client(base_url=tiny_server.base_url, timeout=10) as client:
        for _ in range(5):
            r = client.post("/v1/embeddings", json=BIG)
            assert r.status_code == 501
            assert r.json()["error"]["type"] == "not_implemented"
            health = client.get("/health")
            assert health.status_code == 200


def test_next_request_after_a_401(tiny_model_dir: object) -> None:
    server = ServerProcess(["-m", str(tiny_model_dir), "--api-key", "k", "--no-audio"])
    try:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            for _ in range(3):
                r = client.post("/v1/chat/completions", json=BIG)
                assert r.status_code == 401
                ok = client.get("/v1/models", headers={"Authorization": "Bearer k"})
                assert ok.status_code == 200
    finally:
        server.stop()


def test_idle_keep_alive_connection_closes_after_timeout(tiny_model_dir: object) -> None:
    # --timeout is the keep-alive timeout. Its timer is restarted when a request ends, and
    # that restart used to be cancelled, so a connection idle after its first request stayed
    # open for ever.
    server = ServerProcess(["-m", str(tiny_model_dir), "--timeout", "2", "--no-audio"])
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):
                more = s.recv(1024)
                assert more, answer
                answer += more
            tic = time.monotonic()
            assert s.recv(1024) == b""
            assert 1.5 < time.monotonic() - tic < 6
    finally:
        server.stop()

"""Queue limits, disconnects, shutdown and the CLI, against real `mlxcel serve` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


def busy_slots(server: ServerProcess) -> int:
    return sum(1 for s in httpx.get(f"{server.base_url}/slots").json() if s["is_processing"])


def wait_for(condition: Any, what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` (a look at the server, as an operator's probe would) until true."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def draining(server: ServerProcess) -> bool:
    return httpx.get(f"{server.base_url}/health").status_code == 503


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, **kw}


@pytest.fixture(scope="module")
def single_slot_server(tiny_model_dir: Path) -> Any:
    server = ServerProcess(
        ["-m", str(tiny_model_dir), "--parallel", "1", "--max-queue-depth", "1", "-c", "8192"]
    )
    yield server
    server.stop()


def test_full_queue_is_503_before_any_byte(single_slot_server: ServerProcess) -> None:
    url = f"{single_slot_server.base_url}/v1/chat/completions"
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
        with a.stream(
            "POST", url, json=chat_body(stream=True, max_tokens=6000, ignore_eos=True)
        ) as running:
            running_lines = running.iter_lines()  # keep a reference: dropping it disconnects
            next(running_lines)  # the running request has its slot
            with b.stream(
                "POST", url, json=chat_body(stream=True, max_tokens=6000, ignore_eos=True)
            ) as queued:
                assert queued.status_code == 200
                queued_lines = queued.iter_lines()
                next(queued_lines)  # role chunk: it is tokenized and waiting
                r = httpx.post(url, json=chat_body(stream=True, max_tokens=5))
                assert r.status_code == 503, r.text
                assert r.headers["content-type"].startswith("application/json")
                assert r.json()["error"]["type"] == "server_busy"
                assert r.headers["Retry-After"] == "1"
                # Liveness is not saturation: /health stays 200 while the queue is full.
                assert httpx.get(f"{single_slot_server.base_url}/health").status_code == 200
                assert next(running_lines) is not None  # both are still being served
    # Both disconnected: the server is free again at once.
    r = httpx.post(url, json=chat_body(max_tokens=3), timeout=10)
    assert r.status_code == 200


def test_disconnect_mid_stream_frees_the_slot(single_slot_server: ServerProcess) -> None:
    url = f"{single_slot_server.base_url}/v1/chat/completions"
    with httpx.stream(
        "POST", url, json=chat_body(stream=True, max_tokens=7000, ignore_eos=True), timeout=60
    ) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    # 7000 tokens would take the only slot for tens of seconds; the abort frees it now.
    tic = time.monotonic()
    r2 = httpx.post(url, json=chat_body(max_tokens=3), timeout=30)
    assert r2.status_code == 200
    assert time.monotonic() - tic < 5


def test_disconnect_non_streaming_frees_the_slot(single_slot_server: ServerProcess) -> None:
    url = f"{single_slot_server.base_url}/v1/chat/completions"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=chat_body(max_tokens=7000, ignore_eos=True), timeout=0.5)
    tic = time.monotonic()
    assert httpx.post(url, json=chat_body(max_tokens=3), timeout=30).status_code == 200
    assert time.monotonic() - tic < 5


def test_sigterm_finishes_in_flight_requests_then_exits_0(tiny_model_dir: Path) -> None:
    server = ServerProcess(["-m", str(tiny_model_dir), "--graceful-timeout", "20"])
    url = f"{server.base_url}/v1/chat/completions"
    result: dict[str, Any] = {}

    def in_flight() -> None:
        result["r"] = httpx.post(
            url, json=chat_body(max_tokens=400, temperature=0, ignore_eos=True), timeout=60
        )

    t = threading.Thread(target=in_flight)
    t.start()
    wait_for(lambda: busy_slots(server) == 1, "the request to run")
    server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: draining(server), "/health to say it drains")
    refused = httpx.post(url, json=chat_body(max_tokens=2), timeout=10)
    t.join(60)
    code = server.proc.wait(timeout=60)
    server.stop()
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "unavailable_error"
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 400
    assert code == 0


def test_sigterm_with_only_idle_keepalive_connections_exits_at_once(tiny_model_dir: Path) -> None:
    server = ServerProcess(["-m", str(tiny_model_dir), "--graceful-timeout", "30"])
    with httpx.Client() as client:  # keeps its connection open after the response
        client.post(f"{server.base_url}/v1/chat/completions", json=chat_body(max_tokens=2))
        tic = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert time.monotonic() - tic < 10, "an idle keep-alive connection held up the shutdown"
    server.stop()


def test_sigterm_ends_requests_past_the_graceful_timeout(tiny_model_dir: Path) -> None:
    server = ServerProcess(["-m", str(tiny_model_dir), "--graceful-timeout", "1", "-c", "8192"])
    url = f"{server.base_url}/v1/chat/completions"
    done = threading.Event()
    result: dict[str, Any] = {}

    def endless() -> None:
        try:
            result["r"] = httpx.post(
                url, json=chat_body(max_tokens=8000, ignore_eos=True), timeout=120
            )
        except httpx.HTTPError as error:
            result["error"] = error
        done.set()

    threading.Thread(target=endless, daemon=True).start()
    wait_for(lambda: busy_slots(server) == 1, "the request to run")
    tic = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0
    assert time.monotonic() - tic < 15
    assert done.wait(10)
    server.stop()
    # Cut by the drain, but answered: the text so far, as if max_tokens had been reached.
    assert "error" not in result, result
    assert result["r"].status_code == 200
    assert result["r"].json()["choices"][0]["finish_reason"] == "length"
    assert 0 < result["r"].json()["usage"]["completion_tokens"] < 8000


def test_bad_model_path_is_a_clear_error_without_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    p = subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", "-m", str(missing), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert p.returncode != 0
    assert str(missing) in p.stderr or "nope.gguf" in p.stderr
    assert "Traceback" not in p.stderr


def test_help_lists_the_flags() -> None:
    for cmd in (["mlxcel", "serve", "--help"], ["mlxcel-server", "--help"]):
        exe = Path(sys.executable).parent / cmd[0]
        out = subprocess.run(
            [str(exe), *cmd[1:]], capture_output=True, text=True, timeout=60
        ).stdout
        for flag in (
            "--model",
            "--alias",
            "--ctx-size",
            "--n-predict",
            "--parallel",
            "--max-queue-depth",
            "--prefill-chunk-size",
            "--sse-ping-interval",
            "--no-warmup",
            "--graceful-timeout",
            "LLAMA_ARG_CTX_SIZE",
        ):
            assert flag in out, (cmd, flag)


def test_llama_arg_env_sets_the_alias(tiny_model_dir: Path) -> None:
    os.environ["LLAMA_ARG_ALIAS"] = "my-alias"
    try:
        server = ServerProcess(["-m", str(tiny_model_dir), "--no-warmup", "--no-audio"])
    finally:
        del os.environ["LLAMA_ARG_ALIAS"]
    try:
        ids = [m["id"] for m in httpx.get(f"{server.base_url}/v1/models").json()["data"]]
        assert ids == ["my-alias"]
        r = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": "my-alias", **chat_body(max_tokens=2)},
        )
        assert r.status_code == 200 and r.json()["model"] == "my-alias"
    finally:
        server.stop()


def test_the_server_keeps_the_open_file_limit_it_was_given(
    single_slot_server: ServerProcess,
) -> None:
    # mlx_lm lowers RLIMIT_NOFILE to (2048, 4096) when imported (models/fd_limit.py); a server
    # holds a descriptor per connection, so it must keep what the operator gave it.
    import resource

    single_slot_server.proc.poll()
    httpx.post(
        single_slot_server.base_url + "/completion", json={"prompt": "Hi", "n_predict": 1}
    ).raise_for_status()  # the model (and mlx_lm) is loaded by now
    limits = Path(f"/proc/{single_slot_server.proc.pid}/limits").read_text()
    line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
    soft, hard = (int(v) for v in line.split()[3:5])
    assert (soft, hard) == resource.getrlimit(resource.RLIMIT_NOFILE)

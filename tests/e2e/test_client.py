"""The Python client (`mlxcel.LLM`, `mlxcel.AsyncLLM`) against real `mlxcel serve` processes.

Lifecycle corner cases (startup timeout, the finaliser, interpreter exit, SIGKILL escalation) use
a fake server script as `binary=`: a few lines of Python answering /health, so they take
milliseconds. Everything a user would notice about serving uses the tiny model.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import mlxcel
from tests.conftest import REPO, ServerProcess

HELLO = [{"role": "user", "content": "Hello"}]


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def server_children() -> list[int]:
    """Live `serve` processes whose parent is this test process (sorted)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == os.getpid() and b"serve" in cmdline and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


def _one_slot_server(tiny_model_dir: Path, n_predict: int | None) -> mlxcel.LLM:
    # One slot and a one-deep queue. No audio models, so /v1/models lists the chat model alone.
    # Without speculation: the tiny model falls into loops that n-grams predict, and would
    # finish a 900-token request in a few dozen steps.
    return mlxcel.LLM(
        tiny_model_dir,
        alias="tiny",
        ctx_size=1024,
        n_predict=n_predict,
        warmup=False,
        extra_args=["--parallel", "1", "--max-queue-depth", "1", "--no-audio", "--no-spec-ngram"],
        max_retries=0,
        startup_timeout=120,
    )


@pytest.fixture(scope="module")
def managed(tiny_model_dir: Path) -> Iterator[mlxcel.LLM]:
    # --n-predict 12 keeps every answer short (and is itself under test).
    with _one_slot_server(tiny_model_dir, 12) as llm:
        yield llm


# -- managed mode, Unix socket (the default) ---------------------------------------------------


def test_managed_server_listens_on_a_private_unix_socket(managed: mlxcel.LLM) -> None:
    path = managed.socket_path
    assert path is not None and re.fullmatch(rf"/tmp/mlxcel-{os.getpid()}-[0-9a-f]+\.sock", path)
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert managed.base_url == "http://localhost/v1"
    assert managed.server_pid in server_children()


def test_generate_chat_and_streams(managed: mlxcel.LLM) -> None:
    text = managed.generate("def fib(n):", max_tokens=8, temperature=0.7)
    assert isinstance(text, str) and text
    assert managed.chat(HELLO, max_tokens=8)
    deltas = list(managed.stream("def fib(n):", max_tokens=6, temperature=0))
    assert len(deltas) > 1 and all(isinstance(d, str) and d for d in deltas)
    assert "".join(deltas) == managed.generate("def fib(n):", max_tokens=6, temperature=0)
    chat_deltas = list(managed.chat_stream(HELLO, max_tokens=6, temperature=0))
    assert len(chat_deltas) > 1
    assert "".join(chat_deltas) == managed.chat(HELLO, max_tokens=6, temperature=0)


def test_server_options_are_forwarded(managed: mlxcel.LLM) -> None:
    assert managed.model == "tiny"  # alias=
    assert managed.models() == ["tiny"]
    entry = managed.openai_client.models.list().data[0]
    assert (entry.model_extra or {})["meta"]["n_ctx"] == 1024  # ctx_size=
    reply = managed.openai_client.completions.create(
        model=managed.model, prompt="Once", extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 12  # n_predict=


def test_sampling_fields_reach_the_server(managed: mlxcel.LLM) -> None:
    seeded = [
        managed.generate("The", max_tokens=8, temperature=1.0, top_p=0.9, seed=3) for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    # llama-server knobs travel in extra_body and reach the sampler: top_k=1 is greedy.
    greedy = managed.generate("The", max_tokens=8, temperature=0)
    assert managed.generate("The", max_tokens=8, temperature=2.0, top_k=1) == greedy
    knobs = {"min_p": 0.05, "repetition_penalty": 1.1, "dry_multiplier": 0.8, "typical_p": 0.9}
    assert managed.chat(HELLO, max_tokens=2, **knobs) is not None
    # The server names an out-of-range or unknown knob in its 400: proof it was forwarded.
    for knob, value in (("top_k", -1), ("min_p", 2.0), ("made_up_knob", 1)):
        with pytest.raises(openai.BadRequestError, match=knob):
            managed.generate("The", max_tokens=2, **{knob: value})


def test_explicit_extra_body_wins(managed: mlxcel.LLM) -> None:
    # The keyword is valid; only the extra_body value, if it is the one sent, is rejected.
    with pytest.raises(openai.BadRequestError, match="temperature"):
        managed.generate("The", max_tokens=2, temperature=0.0, extra_body={"temperature": "hot"})
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        managed.chat(HELLO, max_tokens=2, extra_body={"max_tokens": "many"})


def test_tokenize_and_detokenize(managed: mlxcel.LLM) -> None:
    ids = managed.tokenize("Hello world")
    assert ids and all(isinstance(i, int) for i in ids)
    assert managed.detokenize(ids) == "Hello world"
    assert len(managed.tokenize("Hello world", add_special=True)) >= len(ids)


@pytest.fixture(scope="module")
def one_slot(tiny_model_dir: Path) -> Iterator[mlxcel.LLM]:
    # No --n-predict cap (the `managed` server's 12 would end the running request in a tenth
    # of a second): the 503 test fills the slot and the queue with two requests.
    with _one_slot_server(tiny_model_dir, None) as llm:
        yield llm


def test_full_queue_is_a_503_api_status_error(one_slot: mlxcel.LLM) -> None:
    managed = one_slot
    # One slot, one queue place (see the fixture): a running and a queued request fill both.
    # The running one takes ~5 s for its 900 tokens here.
    running = managed.stream(
        "Tell me a long story.", max_tokens=900, extra_body={"ignore_eos": True}
    )
    next(running)
    queued = managed.openai_client.chat.completions.create(
        model=managed.model,
        messages=HELLO,
        stream=True,
        max_tokens=900,
        extra_body={"ignore_eos": True},
    )  # returns with the response headers: admitted and waiting for the slot
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            managed.generate("x", max_tokens=1)
        assert caught.value.status_code == 503
        assert "server_busy" in str(caught.value.body)
    finally:
        running.close()
        queued.close()
    assert managed.generate("x", max_tokens=1) is not None  # both slots freed by the disconnects


# -- connect mode -------------------------------------------------------------------------------


def test_connect_over_unix_socket(managed: mlxcel.LLM) -> None:
    assert managed.socket_path is not None
    with mlxcel.LLM(socket=managed.socket_path) as llm:
        assert llm.server_pid is None
        assert llm.model == "tiny"
        assert llm.generate("Hi", max_tokens=3)
        assert llm.detokenize(llm.tokenize("a b c")) == "a b c"
    assert managed.chat(HELLO, max_tokens=2) is not None  # closing a connected client stops nothing


@pytest.mark.parametrize("suffix", ["", "/v1", "/v1/"])
def test_connect_over_tcp(tiny_server: ServerProcess, suffix: str) -> None:
    with mlxcel.LLM(base_url=tiny_server.base_url + suffix) as llm:
        assert llm.base_url == f"{tiny_server.base_url}/v1"
        assert llm.chat(HELLO, max_tokens=3)
        assert "".join(llm.stream("Hi", max_tokens=3))
        assert llm.tokenize("Hello") == [19556]


def test_connect_to_nothing_is_a_connection_error(tmp_path: Path) -> None:
    with mlxcel.LLM(base_url="http://127.0.0.1:9", max_retries=0) as llm:
        with pytest.raises(openai.APIConnectionError):
            llm.models()


def test_async_client(managed: mlxcel.LLM) -> None:
    assert managed.socket_path is not None

    async def main() -> dict[str, Any]:
        async with mlxcel.AsyncLLM(socket=managed.socket_path) as llm:
            out: dict[str, Any] = {"model": await llm.resolve_model(), "cached": llm.model}
            out["generate"] = await llm.generate("def fib(n):", max_tokens=6, temperature=0)
            out["stream"] = [
                t async for t in llm.stream("def fib(n):", max_tokens=6, temperature=0)
            ]
            out["chat"] = await llm.chat(HELLO, max_tokens=6, temperature=0)
            out["chat_stream"] = [
                t async for t in llm.chat_stream(HELLO, max_tokens=6, temperature=0)
            ]
            deltas = llm.chat_stream(HELLO, max_tokens=50)
            out["first"] = await anext(deltas)
            await deltas.aclose()  # stopping early is clean
            out["tokens"] = await llm.tokenize("Hello world")
            out["text"] = await llm.detokenize(out["tokens"])
            out["models"] = await llm.models()
            try:
                await llm.generate("x", top_k=-2)
            except openai.BadRequestError as error:
                out["error"] = error.message
        out["closed"] = llm.closed
        return out

    out = asyncio.run(main())
    assert out["model"] == out["cached"] == "tiny"
    assert "".join(out["stream"]) == out["generate"] != ""
    assert "".join(out["chat_stream"]) == out["chat"] != ""
    assert out["first"]
    assert out["text"] == "Hello world" and out["models"] == ["tiny"]
    assert "top_k" in out["error"]
    assert out["closed"]


# -- managed mode over TCP, with an API key; close() ------------------------------------------


def test_managed_tcp_with_api_key_then_close(tiny_model_dir: Path) -> None:
    llm = mlxcel.LLM(tiny_model_dir, host="127.0.0.1", api_key="sekrit-key", warmup=False)
    pid = llm.server_pid
    assert pid is not None
    try:
        assert llm.socket_path is None
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", llm.base_url)
        # The key is in the server's environment, not on its command line.
        assert b"sekrit-key" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"LLAMA_API_KEY=sekrit-key\0" in Path(f"/proc/{pid}/environ").read_bytes()
        assert llm.chat(HELLO, max_tokens=3)
        assert llm.detokenize(llm.tokenize("Hi there")) == "Hi there"  # native routes carry it too
        # (/models is public, as llama-server's: a route that is not.)
        assert httpx.post(f"{llm.base_url}/chat/completions", json={}).status_code == 401
        stranger = openai.OpenAI(base_url=llm.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.completions.create(model="default", prompt="Hi", max_tokens=1)
        stranger.close()
    finally:
        llm.close()
    assert not pid_alive(pid)
    assert llm.closed
    with pytest.raises(mlxcel.MlxcelError, match="closed"):
        llm.generate("Hi")
    llm.close()  # idempotent


def test_startup_failure_carries_the_server_output(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    before = server_children()
    with pytest.raises(mlxcel.MlxcelServerError) as caught:
        mlxcel.LLM(missing, warmup=False, startup_timeout=120)
    assert not isinstance(caught.value, mlxcel.MlxcelTimeoutError)
    assert f"model path '{missing}' does not exist" in caught.value.stderr
    assert "exited with code 1" in str(caught.value) and "does not exist" in str(caught.value)
    assert server_children() == before


# -- lifecycle with a fake server --------------------------------------------------------------

FAKE_SERVER = textwrap.dedent(
    """\
    #!{python}
    # Stands in for `mlxcel serve`: answers GET /health once up, optionally stubborn or silent.
    import http.server, os, signal, socketserver, sys, time
    args = sys.argv[1:]
    host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
    print("fake server starting", args, file=sys.stderr, flush=True)
    if os.environ.get("FAKE_MODE") == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("FAKE_MODE") == "exit":
        print("fatal: cannot load", file=sys.stderr, flush=True)
        sys.exit(3)
    if os.environ.get("FAKE_MODE") == "hang":
        time.sleep(600)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{{"status":"ok"}}'
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

        def address_string(self):
            return "local"

    if port == 0:
        server = socketserver.UnixStreamServer(host, Health)
    else:
        server = http.server.HTTPServer((host, port), Health)
    print("fake server ready", file=sys.stderr, flush=True)
    server.serve_forever()
    """
)


@pytest.fixture
def fake_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "fake-mlxcel"
    path.write_text(FAKE_SERVER.format(python=sys.executable))
    path.chmod(0o755)
    return path


def test_startup_timeout_kills_the_child(
    fake_binary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "hang")
    before = server_children()
    started = time.monotonic()
    with pytest.raises(mlxcel.MlxcelTimeoutError) as caught:
        mlxcel.LLM("m", binary=fake_binary, startup_timeout=1.0)
    assert time.monotonic() - started < 5
    assert "fake server starting" in caught.value.stderr
    assert "not healthy after 1 s" in str(caught.value)
    assert server_children() == before


def test_early_exit_is_a_server_error(fake_binary: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MODE", "exit")
    with pytest.raises(mlxcel.MlxcelServerError) as caught:
        mlxcel.LLM("m", binary=fake_binary, startup_timeout=30)
    assert caught.value.stderr.endswith("fatal: cannot load")
    assert "exited with code 3" in str(caught.value)


def test_server_output_goes_to_the_logger(
    fake_binary: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="mlxcel.server"):
        with mlxcel.LLM("m", binary=fake_binary, port=0):
            pass
    lines = [r.getMessage() for r in caplog.records if r.name == "mlxcel.server"]
    assert "fake server ready" in lines


def test_a_dead_server_is_reported_before_the_next_call(fake_binary: Path) -> None:
    with mlxcel.LLM("m", binary=fake_binary) as llm:
        assert llm.server_pid is not None
        os.kill(llm.server_pid, 9)
        deadline = time.monotonic() + 10
        while pid_alive(llm.server_pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(mlxcel.MlxcelServerError, match="exited with code -9 while in use"):
            llm.generate("Hi")


def test_sigkill_after_the_grace_period(fake_binary: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MODE", "ignore-term")
    llm = mlxcel.LLM("m", binary=fake_binary, shutdown_grace=0.3)
    pid, sock = llm.server_pid, llm.socket_path
    assert pid is not None and sock is not None and os.path.exists(sock)
    started = time.monotonic()
    llm.close()
    assert 0.3 <= time.monotonic() - started < 5
    assert not pid_alive(pid)
    assert not os.path.exists(sock)  # removed for the server, which could not


def test_the_finaliser_stops_a_forgotten_server(fake_binary: Path) -> None:
    import gc

    llm = mlxcel.LLM("m", binary=fake_binary)
    pid, sock = llm.server_pid, llm.socket_path
    assert pid is not None and sock is not None
    del llm
    gc.collect()
    assert not pid_alive(pid)
    assert not os.path.exists(sock)


def test_no_orphan_after_the_interpreter_exits(fake_binary: Path) -> None:
    # atexit, through weakref.finalize: the child never closes its client.
    make = f"mlxcel.LLM('m', binary={str(fake_binary)!r})"
    code = f"import mlxcel\nllm = {make}\nprint(llm.server_pid, llm.socket_path, flush=True)\n"
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert child.returncode == 0, child.stderr
    pid_text, sock = child.stdout.split()
    pid = int(pid_text)
    try:
        assert not pid_alive(pid)
        assert not os.path.exists(sock)
    finally:
        if pid_alive(pid):
            os.kill(pid, 9)


# -- the how-to page ---------------------------------------------------------------------------


def test_python_client_doc_examples_run(
    tiny_model_dir: Path,
    tiny_server: ServerProcess,
    managed: mlxcel.LLM,
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = (REPO / "docs" / "how-to" / "python-client.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.DOTALL)
    assert len(blocks) >= 4
    assert managed.socket_path is not None
    before = server_children()
    for block in blocks:
        code = (
            block.replace('"<model>"', repr(str(tiny_model_dir)))
            .replace("http://localhost:8080/v1", f"{tiny_server.base_url}/v1")
            .replace("/tmp/mlxcel.sock", managed.socket_path)
        )
        exec(compile(code, "python-client.md", "exec"), {"__name__": "__doc_example__"})
    out = capsys.readouterr().out
    assert "tiny-llama" in out  # llm.model of the first example
    assert "the server did not start: error: model path '/no/such/model' does not exist" in out
    assert "400 Error code: 400 - top_k must be >= 0" in out
    assert "CompletionUsage(" in out
    assert server_children() == before  # every managed example stopped its server

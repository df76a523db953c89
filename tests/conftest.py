"""Shared fixtures: the real SmolLM2 tokenizer, the tiny random model, servers on loopback."""

from __future__ import annotations

# Before anything imports mlx.core: loads OpenBLAS with RTLD_GLOBAL (see mlxcel/models/blas.py).
import mlxcel.models  # noqa: F401  isort: skip  (OpenBLAS before mlx)

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxcel.paths import default_cache_dir

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return default_cache_dir()


@pytest.fixture(scope="session")
def default_model_dir(cache_dir: Path) -> Path:
    from mlxcel.models.resolve import resolve_model

    return resolve_model(None, cache_dir).path


@pytest.fixture(scope="session")
def smollm_tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_healthy(base_url: str, exited: Callable[[], bool], timeout: float) -> str | None:
    """Poll /health until it answers 200 (None), the server exits ("exited early") or
    ``timeout`` passes ("did not start")."""
    deadline = time.monotonic() + timeout
    while True:
        if exited():
            return "exited early"
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return None
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            return "did not start"
        time.sleep(0.2)


class ServerProcess:
    """`mlxcel serve` in a child process, as a user starts it."""

    def __init__(
        self, args: list[str], *, timeout: float = 180.0, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"mlxcel-test-{self.port}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxcel", "serve", "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=None if env is None else {**os.environ, **env},
        )
        why = wait_until_healthy(self.base_url, lambda: self.proc.poll() is not None, timeout)
        if why is not None:
            text = self.log()
            self.stop()  # ended or ending: its log file is closed here, not left to the GC
            raise RuntimeError(f"server {why}:\n{text}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


# The generation paths a server can take on the CPU: with mlxcel's native kernels (the default
# on AVX-512 or AVX2 Linux), and without them ("portable": mlx's own ops, the path Apple silicon
# and other CPUs take). Tests of generation that matter most (chat, batching and seeds,
# speculation, cancellation) run their server once per path (issue 37).
KERNEL_PATHS = {"native": None, "portable": {"MLXCEL_NATIVE": "0"}}


@pytest.fixture(scope="module")
def postgres() -> Iterator[Any]:
    """A throwaway PostgreSQL on loopback (fails, never skips, when it is not installed)."""
    from tests.support.postgres import PostgresServer

    server = PostgresServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        ["-m", str(tiny_model_dir), "--parallel", "4", "--sse-ping-interval", "1"]
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def openai_client(tiny_server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(
        base_url=f"{tiny_server.base_url}/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    )

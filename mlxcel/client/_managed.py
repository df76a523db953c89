"""A managed ``mlxcel serve`` child: find the binary, spawn, wait until healthy, shut down.

Synchronous on purpose (``AsyncLLM`` starts it from its constructor too): startup is a
one-time blocking wait, and shutdown must also work from ``atexit`` and the finaliser, where no
event loop runs.
"""

from __future__ import annotations

import collections
import http.client
import logging
import os
import secrets
import shutil
import signal
import socket as socketlib
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import IO

from mlxcel.client._transport import UDS_ORIGIN, Target
from mlxcel.client.errors import MlxcelError, MlxcelServerError, MlxcelTimeoutError

log = logging.getLogger("mlxcel.server")

STDERR_LINES = 50
MAX_SOCKET_PATH = 100  # bytes; sun_path is 104 (macOS) or 108 (Linux) with the NUL
_BACKOFF_START, _BACKOFF_MAX = 0.05, 1.0


def find_binary(binary: str | os.PathLike[str] | Sequence[str] | None = None) -> list[str]:
    """The command that runs mlxcel: ``binary=``, ``$MLXCEL_BIN``, ``mlxcel`` on PATH, else
    this interpreter's ``-m mlxcel`` (the server ships in the same package as the client)."""
    if binary is not None:
        if isinstance(binary, str | os.PathLike):
            return [os.fspath(binary)]
        return [os.fspath(part) for part in binary]
    if env := os.environ.get("MLXCEL_BIN"):
        return [env]
    if found := shutil.which("mlxcel"):
        return [found]
    return [sys.executable, "-m", "mlxcel"]


def default_socket_path() -> str:
    # /tmp rather than $TMPDIR: macOS's per-user TMPDIR alone is ~50 bytes of the 100.
    return f"/tmp/mlxcel-{os.getpid()}-{secrets.token_hex(4)}.sock"


def free_port(host: str) -> int:
    family = socketlib.AF_INET6 if ":" in host else socketlib.AF_INET
    with socketlib.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ManagedServer:
    """One ``mlxcel serve`` child process, owned by one client.

    ``start()`` blocks until ``GET /health`` answers 200. ``close()`` is idempotent and
    thread-safe (the finaliser may run it from the garbage collector's thread).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        binary: str | os.PathLike[str] | Sequence[str] | None = None,
        host: str | None = None,
        port: int | None = None,
        socket: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
        ctx_size: int | None = None,
        n_predict: int | None = None,
        alias: str | None = None,
        warmup: bool | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 600.0,
        shutdown_grace: float = 5.0,
    ) -> None:
        use_tcp = host is not None or port is not None or os.name == "nt"
        if use_tcp:
            if socket is not None:
                raise MlxcelError("socket= and host=/port= both choose the transport: pass one")
            host = host or "127.0.0.1"
            port = port or free_port(host)
            self.socket_path: str | None = None
            # A wildcard bind is reached through loopback.
            reach = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
            url_host = f"[{reach}]" if ":" in reach else reach
            self.target = Target(f"http://{url_host}:{port}/v1")
            bind = [host, str(port)]
        else:
            path = os.fspath(socket) if socket is not None else default_socket_path()
            if (size := len(os.fsencode(path))) > MAX_SOCKET_PATH:
                raise MlxcelServerError(
                    f"socket path is {size} bytes, over the {MAX_SOCKET_PATH}-byte "
                    f"limit of Unix sockets: {path!r}; pass a shorter socket= or use host=/port="
                )
            self.socket_path = path
            self.target = Target(f"{UDS_ORIGIN}/v1", uds=path)
            bind = [path, "0"]
        self.argv = [
            *find_binary(binary),
            "serve",
            "-m",
            os.fspath(model),
            "--host",
            bind[0],
            "--port",
            bind[1],
        ]
        if ctx_size is not None:
            self.argv += ["--ctx-size", str(ctx_size)]
        if n_predict is not None:
            self.argv += ["--n-predict", str(n_predict)]
        if alias is not None:
            self.argv += ["--alias", alias]
        if warmup is not None:
            self.argv.append("--warmup" if warmup else "--no-warmup")
        self.argv += list(extra_args)
        self._env = dict(os.environ)
        if api_key:
            self._env["LLAMA_API_KEY"] = api_key  # never on argv: `ps` shows argv to every user
        self.startup_timeout = startup_timeout
        self.shutdown_grace = shutdown_grace
        self._lines: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._proc: subprocess.Popen[bytes] | None = None
        self._drain: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def stderr_tail(self) -> str:
        return "\n".join(self._lines)

    def start(self) -> None:
        """Spawn the server and wait for it to be healthy; on any failure the child is gone."""
        try:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self._env,
                # Its own session: a terminal's Ctrl-C reaches only us, and we stop it in order.
                start_new_session=True,
            )
        except OSError as error:
            raise MlxcelServerError(
                f"cannot run {self.argv[0]!r}: {error}. Install mlxcel (pip install "
                "'mlxcel[cpu]', or 'mlxcel[cuda12]' for an NVIDIA GPU), "
                "or point binary= or MLXCEL_BIN at the mlxcel executable"
            ) from error
        assert self._proc.stdout is not None
        self._drain = threading.Thread(
            target=self._drain_output,
            args=(self._proc.stdout,),
            name="mlxcel-server-output",
            daemon=True,
        )
        self._drain.start()
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise

    def _drain_output(self, stream: IO[bytes]) -> None:
        # Read until EOF so the child never blocks on a full pipe.
        for raw in stream:
            line = raw.decode("utf-8", "replace").rstrip()
            self._lines.append(line)
            log.info("%s", line)

    def _exit_error(self, returncode: int, when: str) -> MlxcelServerError:
        if self._drain is not None:
            self._drain.join(timeout=5)  # the whole tail, up to the child's last line
        return MlxcelServerError(
            f"mlxcel serve exited with code {returncode} {when} ({' '.join(self.argv)})",
            stderr=self.stderr_tail,
        )

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        delay = _BACKOFF_START
        while True:
            if (code := self._proc.poll()) is not None:
                raise self._exit_error(code, "before it became ready")
            # 503 (anything but 200) means "starting"; so does no listener yet.
            if self._health_status() == 200:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._kill()
                raise MlxcelTimeoutError(
                    f"mlxcel serve was not healthy after {self.startup_timeout:g} s "
                    f"({' '.join(self.argv)}); it has been killed",
                    stderr=self.stderr_tail,
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _BACKOFF_MAX)

    def _health_status(self) -> int | None:
        # http.client rather than httpx: httpcore leaks the socket (a ResourceWarning) each time
        # a Unix-socket connect fails, which is every probe until the server listens.
        conn: http.client.HTTPConnection
        if self.socket_path is not None:
            conn = _UnixHTTPConnection(self.socket_path, timeout=5.0)
        else:
            parts = urllib.parse.urlsplit(self.target.root)
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5.0)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            return response.status
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def ensure_alive(self) -> None:
        if self._closed:
            raise MlxcelError("the client is closed")
        assert self._proc is not None
        if (code := self._proc.poll()) is not None:
            raise self._exit_error(code, "while in use")

    def _kill(self) -> None:
        assert self._proc is not None
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def close(self) -> None:
        """SIGTERM, up to ``shutdown_grace`` seconds to drain, then SIGKILL; remove the socket."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            proc = self._proc
            if proc is not None:
                if proc.poll() is None:
                    try:
                        proc.send_signal(signal.SIGTERM)
                        proc.wait(timeout=self.shutdown_grace)
                    except subprocess.TimeoutExpired:
                        log.warning("mlxcel serve (pid %d) ignored SIGTERM; killing it", proc.pid)
                    except ProcessLookupError:
                        pass
                    self._kill()
                if self._drain is not None:
                    self._drain.join(timeout=5)
                if proc.stdout is not None:
                    proc.stdout.close()
            if self.socket_path is not None and proc is not None:
                try:
                    os.unlink(self.socket_path)  # the server removes it, unless it was killed
                except FileNotFoundError:
                    pass


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def start_or_connect(
    model: str | os.PathLike[str] | None,
    *,
    base_url: str | None,
    socket: str | os.PathLike[str] | None,
    transport: object,
    api_key: str | None,
    startup_timeout: float,
    shutdown_grace: float,
    server_options: dict[str, object],
) -> tuple[Target, ManagedServer | None]:
    """Validate the mode; in managed mode start the server (blocking until it is healthy)."""
    from mlxcel.client._transport import choose_mode, connect_target

    if not choose_mode(
        None if model is None else os.fspath(model),
        base_url,
        None if socket is None else os.fspath(socket),
        transport,
    ):
        if server_options:
            raise MlxcelError(
                f"{sorted(server_options)[0]}= configures a server the client starts; in connect "
                "mode (no model) there is none"
            )
        return connect_target(base_url, None if socket is None else os.fspath(socket)), None
    assert model is not None
    server = ManagedServer(
        model,
        socket=socket,
        api_key=api_key,
        startup_timeout=startup_timeout,
        shutdown_grace=shutdown_grace,
        **server_options,  # type: ignore[arg-type]  # the clients' typed options, less unset
    )
    server.start()
    return server.target, server

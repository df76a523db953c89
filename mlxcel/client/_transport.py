"""Mode selection and the HTTP plumbing shared by ``LLM`` and ``AsyncLLM``.

A :class:`Target` is where the server is: an OpenAI base URL, plus a Unix socket path when the
connection goes through one (the URL's host is then a placeholder never resolved).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxcel.client.errors import MlxcelError

if TYPE_CHECKING:
    import httpx

#: Placeholder origin for Unix-socket connections (routing is by the socket path).
UDS_ORIGIN = "http://localhost"


@dataclass(frozen=True)
class Target:
    base_url: str  # the OpenAI SDK's base URL, ending in /v1
    uds: str | None = None

    @property
    def root(self) -> str:
        """The server root, where the native routes (/health, /tokenize) live."""
        return self.base_url.removesuffix("/v1")


def choose_mode(
    model: str | None, base_url: str | None, socket: str | None, transport: object
) -> bool:
    """True for managed mode (a model: spawn a server), False for connect mode.

    With a model, ``socket=`` is the path the spawned server binds; ``base_url=`` or
    ``transport=`` would contradict it. Without one, exactly one of ``base_url=`` / ``socket=``
    names the server (``transport=`` may stand in for both, as in tests).
    """
    if model is not None:
        if base_url is not None or transport is not None:
            raise MlxcelError(
                "pass either a model (managed mode: the client starts `mlxcel serve`) or "
                "base_url=/transport= (connect mode), not both; with a model, socket= is the "
                "path the started server binds"
            )
        return True
    if base_url is not None and socket is not None:
        raise MlxcelError("pass either base_url= or socket= to connect, not both")
    if base_url is None and socket is None and transport is None:
        raise MlxcelError(
            "nothing to run or connect to: pass a model (a folder, .gguf file or hub repo id) to "
            "start a server, or base_url= / socket= to connect to a running one"
        )
    return False


def connect_target(base_url: str | None, socket: str | None) -> Target:
    if socket is not None:
        return Target(f"{UDS_ORIGIN}/v1", uds=os.fspath(socket))
    if base_url is None:
        return Target(f"{UDS_ORIGIN}/v1")  # an injected transport decides where it goes
    trimmed = base_url.rstrip("/")
    return Target(trimmed if trimmed.endswith("/v1") else f"{trimmed}/v1")


def default_timeout() -> httpx.Timeout:
    import httpx

    # A long read: the first token of a long prompt on a slow machine can take minutes.
    return httpx.Timeout(connect=10.0, read=600.0, write=30.0, pool=10.0)


def sync_http_client(target: Target, timeout: Any, transport: Any = None) -> httpx.Client:
    import httpx

    if transport is None and target.uds is not None:
        transport = httpx.HTTPTransport(uds=target.uds)
    return httpx.Client(transport=transport, timeout=timeout)


def async_http_client(target: Target, timeout: Any, transport: Any = None) -> httpx.AsyncClient:
    import httpx

    if transport is None and target.uds is not None:
        transport = httpx.AsyncHTTPTransport(uds=target.uds)
    return httpx.AsyncClient(transport=transport, timeout=timeout)


def resolve_api_key(api_key: str | None) -> str | None:
    # Same source as the server's: a managed server inherits LLAMA_API_KEY from this
    # environment, so the client must present it too.
    return api_key if api_key is not None else (os.environ.get("LLAMA_API_KEY") or None)

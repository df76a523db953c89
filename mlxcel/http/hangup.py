"""Dropping a WebSocket whose client stopped reading: Hypercorn has no write timeout.

Hypercorn writes every frame with ``send_all`` inside a *shielded* cancel scope, so a handler
whose client reads nothing waits in ``websocket.send`` until the client goes, and cannot be
cancelled meanwhile: a realtime session would keep its place, its tasks and its queued audio
for as long as a hostile client likes (measured: a non-reading client's session outlived its
5 s idle timeout). Closing the socket is what ends such a write: trio wakes the blocked writer
with ``ClosedResourceError``, Hypercorn treats that as the client leaving, and the app is told
that the client disconnected. nginx's ``send_timeout`` (60 s without the client taking a byte)
drops the connection the same way.

Hypercorn does not give the app its socket, so ``Hangups`` (ASGI middleware, WebSockets only)
finds it through the ``send`` callable that Hypercorn hands the app (``WSStream.app_send`` ->
the protocol's ``stream_send`` -> ``TCPServer.protocol_send``, whose server holds the stream;
Hypercorn 0.18, HTTP/1.1 and HTTP/2) and puts a ``hang_up()`` callable in the scope under
``HANG_UP``. Where that chain is not there (another server or version), the scope has none and
the app can only wait for the client to go, as before.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any, cast

import trio
from hypercorn.typing import ASGIFramework, ASGIReceiveCallable, ASGISendCallable, Scope

log = logging.getLogger(__name__)

# The scope key of a WebSocket's hang_up() (absent where the socket cannot be found).
HANG_UP = "mlxcel.hang_up"


class Hangups:
    """ASGI middleware: every WebSocket scope gets ``HANG_UP`` where Hypercorn's socket is
    reachable; everything else passes through untouched."""

    def __init__(self, app: ASGIFramework) -> None:
        self._app = app
        self._warned = False

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "websocket":
            stream = _socket_stream(send)
            if stream is not None:
                # ASGI's scope types name no extra keys; this one is ours.
                scope = cast(Scope, {**scope, HANG_UP: _hang_up(stream)})
            elif not self._warned:
                self._warned = True
                log.warning(
                    "cannot reach the WebSocket's socket (not Hypercorn 0.18?): a realtime "
                    "client that stops reading holds its session until it goes"
                )
        await self._app(scope, receive, send)


def _socket_stream(send: ASGISendCallable) -> trio.SocketStream | None:
    """The TCP stream under the connection that ``send`` writes to, or None."""
    app_send: Any = send
    try:
        ws_stream = app_send.__self__  # WSStream (app_send)
        protocol = ws_stream.send.__self__  # H11Protocol / H2Protocol (stream_send)
        server = protocol.send.__self__  # TCPServer (protocol_send)
        stream = server.stream
    except AttributeError:
        return None
    while isinstance(stream, trio.SSLStream):  # TLS: abort the TCP stream under it
        stream = stream.transport_stream
    return stream if isinstance(stream, trio.SocketStream) else None


def _hang_up(stream: trio.SocketStream) -> Callable[[], None]:
    def hang_up() -> None:
        """Close the socket now: a reset, not a close handshake (the client reads nothing,
        and the kernel drops what it still holds for it instead of retrying it)."""
        sock = stream.socket
        with contextlib.suppress(OSError):  # e.g. a Unix socket: a plain close then
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()

    return hang_up


__all__ = ["HANG_UP", "Hangups"]

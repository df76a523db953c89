"""Counts the HTTP requests in flight, so the shutdown drain waits for every one of them
(a transcription, an embedding batch), not only the generations that admission knows about."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import trio
from hypercorn.typing import ASGIFramework, ASGIReceiveCallable, ASGISendCallable, Scope


class InFlight:
    """ASGI middleware around the app; WebSockets and lifespan pass through uncounted (the
    drain closes realtime sessions itself).

    ``scope`` is entered around every request and WebSocket session (the model registry's
    leases: a model is not unloaded while a response that uses it is still being sent)."""

    def __init__(
        self,
        app: ASGIFramework,
        scope: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self._app = app
        self._scope = scope
        self.active = 0
        self._idle = trio.Event()
        self._idle.set()

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "websocket":
            with self._scope():
                await self._app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if self.active == 0:
            self._idle = trio.Event()
        self.active += 1
        try:
            with self._scope():
                await self._app(scope, receive, send)
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no HTTP request is in flight."""
        await self._idle.wait()

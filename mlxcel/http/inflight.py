"""Counts the HTTP requests in flight, so the shutdown drain waits for every one of them
(a transcription, an embedding batch), not only the generations that admission knows about."""

from __future__ import annotations

import trio
from hypercorn.typing import ASGIFramework, ASGIReceiveCallable, ASGISendCallable, Scope


class InFlight:
    """ASGI middleware around the app; WebSockets and lifespan pass through uncounted (the
    drain closes realtime sessions itself)."""

    def __init__(self, app: ASGIFramework) -> None:
        self._app = app
        self.active = 0
        self._idle = trio.Event()
        self._idle.set()

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if self.active == 0:
            self._idle = trio.Event()
        self.active += 1
        try:
            await self._app(scope, receive, send)
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no HTTP request is in flight."""
        await self._idle.wait()

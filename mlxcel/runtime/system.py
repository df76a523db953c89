"""Process-level lifecycle: signals and the graceful-shutdown sequence.

The root nursery is one-for-all: an actor that dies takes the process down with its cause
logged. Shutdown (``server.serve``) is a deadline, ``--graceful-timeout`` seconds after the
signal: stop admitting (503 with Retry-After; /health 503), let in-flight requests finish
until shortly before the deadline, then end the ones still running as if they had reached
their token limit, so every response and stream closes with its family's final event; then
close realtime sessions (1001), stop Hypercorn, and only then cancel the actors.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

import trio

log = logging.getLogger(__name__)


async def wait_for_stop_signal(
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Return at the first SIGINT or SIGTERM (installed before ``started`` is reported)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            log.info("received %s: draining", signal.Signals(signum).name)
            return


class LongLived:
    """Connections that outlive any one request (realtime WebSockets): the drain closes them
    itself, with a reason the client can read, instead of leaving Hypercorn to drop them."""

    def __init__(self) -> None:
        self._closers: dict[object, Callable[[], None]] = {}
        self._empty = trio.Event()
        self._empty.set()

    @contextlib.contextmanager
    def hold(self, close: Callable[[], None]) -> Iterator[None]:
        """Register ``close`` (sync, idempotent) for the duration of the block."""
        key = object()
        self._closers[key] = close
        self._empty = trio.Event()
        try:
            yield
        finally:
            del self._closers[key]
            if not self._closers:
                self._empty.set()

    def close_all(self) -> None:
        for close in list(self._closers.values()):
            close()

    async def wait_closed(self) -> None:
        """Return once every held connection has left its block."""
        await self._empty.wait()

"""Process-level lifecycle: signals and the graceful-shutdown sequence.

The root nursery is one-for-all: an actor that dies takes the process down with its cause
logged. Shutdown is ordered: stop admitting (503), let Hypercorn finish in-flight requests
until the graceful deadline (then it cancels them, which aborts their generations), and only
then cancel the actors.
"""

from __future__ import annotations

import logging
import signal

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

"""The graceful shutdown after SIGTERM/SIGINT: every response in flight ends properly.

Policy (documented in docs/reference/cli.md): llama-server has none (its streams are cut);
vLLM and Hypercorn give running work a grace period. Ours is ``--graceful-timeout`` seconds
for the whole drain, so an orchestrator's kill deadline set above it is never reached.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from mlxcel.http.inflight import InFlight
from mlxcel.runtime.system import LongLived

log = logging.getLogger(__name__)

# Of the graceful timeout, the part kept for handlers to write their endings once the
# generations still running have been stopped.
CLOSE_MARGIN = 2.0


class Admissions(Protocol):
    """Every model's admission at once (``actors.registry.Registry``)."""

    @property
    def active(self) -> int: ...
    def drain(self) -> None: ...
    def interrupt_all(self) -> None: ...
    async def wait_idle(self) -> None: ...


async def drain(
    admission: Admissions, long_lived: LongLived, requests: InFlight, graceful_timeout: float
) -> None:
    """Everything in flight ends properly within ``graceful_timeout`` seconds.

    Admission refuses new work (503 + Retry-After) and /health says 503 at once. Requests run
    on until ``CLOSE_MARGIN`` before the deadline; the generations still running then end as if
    they had reached their token limit (finish reason "length"), so each stream still gets its
    final event and terminator, and other requests (audio, embeddings) run on to the deadline.
    Realtime sessions are closed (error event, then 1001) once no HTTP request is left. Past
    the deadline, what remains is Hypercorn's to cancel.

    Cancellation (an actor died and the root nursery is failing): returns at once; Hypercorn
    and the handlers are cancelled with everything else.
    """
    deadline = trio.current_time() + graceful_timeout
    admission.drain()
    with trio.move_on_at(deadline - min(CLOSE_MARGIN, graceful_timeout / 2)):
        # Admission too: realtime answers are generations without an HTTP request. Its count
        # never goes back up once it drains; new HTTP requests are refused or answered at once.
        await admission.wait_idle()
        await requests.wait_idle()
    if admission.active:
        log.info("grace period over: ending %d running generations", admission.active)
        admission.interrupt_all()
    with trio.move_on_at(deadline):
        await admission.wait_idle()
        await requests.wait_idle()
        long_lived.close_all()
        await long_lived.wait_closed()

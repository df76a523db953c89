"""The admission actor: the gate between HTTP and the pipeline.

``submit`` is synchronous and runs inside the HTTP handler, before any response byte: it
validates the request, reserves a place in the bounded queue (a full queue is ``ServerBusy``,
503) and hands the request on without blocking. The reservation travels with the request's
OutputSlot and is released by whoever takes it out of the queue (the scheduler when it starts
running, or any stage that drops it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import attrs
import trio

from mlxcel.runtime.errors import InvalidRequest, ServerBusy, ShuttingDown
from mlxcel.runtime.lora import LoraTable
from mlxcel.runtime.messages import GenerationRequest, Submit
from mlxcel.runtime.sampling_rules import MAX_STOP_STRINGS
from mlxcel.runtime.slot import AbortBox, OutputSlot, Reservation


def validate(request: GenerationRequest) -> None:
    """Range checks that need no model. Raises InvalidRequest naming the field."""
    # Sampling settings were range-checked where they were parsed (http.sampling_wire).
    if request.max_tokens is not None and request.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    if len(request.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(not s for s in request.stop):
        raise InvalidRequest("stop strings must not be empty", param="stop")


class Admission:
    def __init__(
        self,
        *,
        max_queue_depth: int,
        outbox: trio.MemorySendChannel[Submit],
        aborts: AbortBox,
        parallel: int = 0,
        free_slots: Callable[[], int] = lambda: 0,
        lora: LoraTable | None = None,
    ) -> None:
        """``max_queue_depth`` counts requests waiting for a slot: a request admitted while
        ``free_slots()`` (at most ``parallel``) are free is on its way to one, not waiting,
        so 64 requests arriving at once at a ``--parallel 64`` server all run."""
        self._lora = lora
        self._depth = max_queue_depth
        self._parallel = parallel
        self._free_slots = free_slots
        self._limiter = trio.CapacityLimiter(max_queue_depth + parallel)
        # Every item in the lane holds a reservation, so the lane can never be full.
        self._lane_tx, self._lane_rx = trio.open_memory_channel[Submit](max_queue_depth + parallel)
        self._outbox = outbox
        self._aborts = aborts
        self._draining = False
        self._ids = itertools.count()
        # Requests whose handler has not finished yet (queued, running, or streaming out).
        self.active = 0
        self._live: set[OutputSlot] = set()
        self._idle = trio.Event()
        self._idle.set()

    @property
    def queued(self) -> int:
        return int(self._limiter.borrowed_tokens)

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Stop admitting: every later submit is 503 while in-flight work finishes."""
        self._draining = True

    def interrupt_all(self) -> None:
        """End every admitted request now (``OutputSlot.interrupt``): the grace period is over.
        Their handlers still write a proper ending; ``wait_idle`` returns once they have."""
        for slot in list(self._live):
            slot.interrupt(ShuttingDown())

    def submit(self, request: GenerationRequest) -> OutputSlot:
        if self._draining:
            raise ShuttingDown()
        validate(request)
        if request.lora is None and self._lora is not None:
            # The global adapter scales as they are now: a later POST /lora-adapters
            # changes only requests admitted after it.
            request = attrs.evolve(request, lora=self._lora.current())
        borrower = (request.request_id, next(self._ids))
        free = max(0, min(self._free_slots(), self._parallel))
        if self.queued >= self._depth + free:
            raise ServerBusy()
        try:
            self._limiter.acquire_on_behalf_of_nowait(borrower)
        except trio.WouldBlock:
            raise ServerBusy() from None
        slot = OutputSlot(
            request.request_id,
            Reservation(self._limiter, borrower),
            self._aborts,
            lambda: self._closed(slot),
            n=request.n,
        )
        self._live.add(slot)
        self.active += 1
        self._idle = trio.Event()
        self._lane_tx.send_nowait(Submit(request, slot))
        return slot

    def _closed(self, slot: OutputSlot) -> None:
        self._live.discard(slot)
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once every admitted request's handler has finished."""
        await self._idle.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Forward admitted requests to the tokenizer in order until cancelled."""
        task_status.started()
        async for sub in self._lane_rx:
            await self._outbox.send(sub)

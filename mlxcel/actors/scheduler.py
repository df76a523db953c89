"""The scheduler actor: continuous batching, one step at a time.

Loop: take what the tokenizer sent, drain the AbortBox, ask the pure policy for a plan, hand
the plan to the model runner, wait for its output, pass the tokens to the streamer. Aborts
(client disconnects, matched stop strings) are therefore applied at step boundaries, which
include the boundaries between prefill chunks.
"""

from __future__ import annotations

import logging

import attrs
import trio

from mlxcel.actors.scheduling import policy
from mlxcel.runtime.messages import (
    CacheStats,
    CloseStream,
    ResetCache,
    SchedulerInbox,
    OpenStream,
    StepOutput,
    StepPlan,
    StepTokens,
    StreamerInbox,
)
from mlxcel.runtime.slot import AbortBox

log = logging.getLogger(__name__)

_PROMPT_TAIL = 6


class Scheduler:
    def __init__(
        self,
        *,
        parallel: int,
        inbox: trio.MemoryReceiveChannel[SchedulerInbox],
        plans: trio.MemorySendChannel[StepPlan],
        outputs: trio.MemoryReceiveChannel[StepOutput],
        streamer: trio.MemorySendChannel[StreamerInbox],
        aborts: AbortBox,
    ) -> None:
        self._state = policy.SchedulerState(parallel=parallel)
        self._inbox = inbox
        self._plans = plans
        self._outputs = outputs
        self._streamer = streamer
        self._aborts = aborts
        self._resets: list[trio.Event] = []
        self.steps = 0
        self.cache_stats = CacheStats()

    @property
    def running(self) -> int:
        return len(self._state.running)

    @property
    def waiting(self) -> int:
        return len(self._state.waiting)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Schedule until cancelled. Cancellation lands while waiting for work or for a step's
        output; the runner finishes the step it is in (mlx work cannot be interrupted)."""
        task_status.started()
        while True:
            if self._state.idle and not self._resets:
                self._enqueue(await self._inbox.receive())
            while True:
                try:
                    self._enqueue(self._inbox.receive_nowait())
                except trio.WouldBlock:
                    break
            aborted = self._aborts.drain()
            decision = policy.plan(self._state, aborted)
            if log.isEnabledFor(logging.DEBUG) and (aborted or decision.started or decision.dropped):
                log.debug(
                    "plan: start %s, remove %s, drop %s; %d running, %d waiting",
                    [i.request.request_id for i in decision.started],
                    decision.plan.removes,
                    [i.request.request_id for i in decision.dropped],
                    len(self._state.running),
                    len(self._state.waiting),
                )
            for item in decision.dropped:
                item.slot.reservation.release()
            for rid in decision.plan.removes:
                await self._streamer.send(CloseStream(rid, "abort"))
            for item in decision.started:
                item.slot.reservation.release()
                await self._streamer.send(
                    OpenStream(
                        item.request.request_id,
                        item.slot,
                        item.request.stop,
                        item.prompt_tokens[-_PROMPT_TAIL:],
                    )
                )
            plan = decision.plan
            resets, self._resets = self._resets, []
            if resets:
                plan = attrs.evolve(plan, reset_cache=True)
            if not self._state.running and not plan.removes and not resets:
                continue
            await self._plans.send(plan)
            output = await self._outputs.receive()
            self.steps += 1
            for done in resets:
                done.set()
            if output.cache is not None:
                self.cache_stats = output.cache
            for rid, n in output.cached:
                if (item := self._state.running.get(rid)) is not None:
                    item.slot.cached_tokens = n
            finished = policy.complete(self._state, output)
            if finished and log.isEnabledFor(logging.DEBUG):
                log.debug("finished %s", finished)
            if output.tokens:
                await self._streamer.send(StepTokens(output.tokens))
            for rid, error in output.errors:
                await self._streamer.send(CloseStream(rid, "error", error))

    def _enqueue(self, msg: SchedulerInbox) -> None:
        if isinstance(msg, ResetCache):
            self._resets.append(msg.done)
            return
        item = msg
        if item.slot.cancelled:
            item.slot.reservation.release()
            return
        self._state.enqueue(item)

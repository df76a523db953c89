"""The scheduler actor: continuous batching, one step at a time.

Loop: take what the tokenizer sent, drain the AbortBox, ask the pure policy for a plan, hand
the plan to the model runner, wait for its output, pass the tokens to the streamer. Aborts
(client disconnects, matched stop strings) are therefore applied at step boundaries, which
include the boundaries between prefill chunks.
"""

from __future__ import annotations

import logging
import time

import attrs
import trio

from mlxcel.actors.scheduling import policy
from mlxcel.runtime.messages import (
    CacheStats,
    ChatPrompt,
    CloseStream,
    EndReasoning,
    OpenStream,
    ResetCache,
    SchedulerInbox,
    SchedulerStatistics,
    SlotAction,
    SlotStatistics,
    StepOutput,
    StepPlan,
    StepTokens,
    StreamerInbox,
    Tokenized,
)
from mlxcel.runtime.metrics import Metrics
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
        metrics: Metrics | None = None,
        join_window: float = 0.0,
    ) -> None:
        self._state = policy.SchedulerState(parallel=parallel, join_window=join_window)
        self._inbox = inbox
        self._plans = plans
        self._outputs = outputs
        self._streamer = streamer
        self._aborts = aborts
        self._metrics = metrics or Metrics()
        self._resets: list[trio.Event] = []
        self._slot_actions: list[SlotAction] = []
        self._end_reasoning: list[str] = []
        self._prefilled: dict[str, int] = {}
        self._cache_stats = CacheStats()

    # --- what others may see ----------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        """A frozen copy of the state (counts, busy slots, prompt cache) for /slots, /metrics
        and the control route. Taken between two steps: the loop never yields mid-update."""
        state = self._state
        slots: list[SlotStatistics | None] = []
        for held in self.slot_items():
            if held is None:
                slots.append(None)
                continue
            item, choice = held
            slots.append(
                SlotStatistics(
                    request=item.request,
                    choice=choice,
                    prompt_tokens=len(item.prompt_tokens),
                    cached_tokens=item.slot.cached_tokens,
                    decoded_tokens=item.slot.choice_tokens(choice),
                    max_tokens=item.max_tokens,
                )
            )
        return SchedulerStatistics(
            running=len(state.running),
            waiting=len(state.waiting),
            rows=state.rows,
            slots=tuple(slots),
            cache=self._cache_stats,
        )

    def free_rows(self) -> int:
        """Batch rows no running request holds (admission: requests queued beyond these are
        the ones waiting for a slot)."""
        return self._state.parallel - self._state.rows

    def slot_items(self) -> list[tuple[Tokenized, int] | None]:
        """Per slot: the request in it and which of its choices, or None when free. Live
        objects, for this actor and the tests; everyone else reads ``statistics()``."""
        state = self._state
        return [
            (state.running[rid], choice) if rid is not None and rid in state.running else None
            for rid, choice in zip(state.slots, state.slot_choices, strict=True)
        ]

    # --- the loop -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Schedule until cancelled. Cancellation lands while waiting for work or for a step's
        output; the runner finishes the step it is in (mlx work cannot be interrupted)."""
        task_status.started()
        while True:
            if self._state.idle and not self._resets and not self._slot_actions:
                self._enqueue(await self._inbox.receive())
            while True:
                try:
                    self._enqueue(self._inbox.receive_nowait())
                except trio.WouldBlock:
                    break
            plan = await self._decide()
            resets, self._resets = self._resets, []
            if resets:
                plan = attrs.evolve(plan, reset_cache=True)
            ends, self._end_reasoning = self._end_reasoning, []
            if ends:
                plan = attrs.evolve(plan, end_reasoning=tuple(ends))
            actions, self._slot_actions = self._slot_actions, []
            if actions:
                plan = attrs.evolve(plan, slot_actions=tuple(actions))
            if not self._state.running and not plan.removes and not resets and not actions:
                continue
            busy = self._state.rows
            tic = time.perf_counter()
            await self._plans.send(plan)
            output = await self._outputs.receive()
            for done in resets:
                done.set()
            for action in actions:
                action.reply.done.set()
            await self._after(output, busy, time.perf_counter() - tic)

    def _enqueue(self, msg: SchedulerInbox) -> None:
        if isinstance(msg, ResetCache):
            self._resets.append(msg.done)
        elif isinstance(msg, SlotAction):
            self._slot_actions.append(msg)
        elif isinstance(msg, EndReasoning):
            if msg.request_id in self._state.running:
                self._end_reasoning.append(msg.request_id)
        elif msg.slot.done:  # its reader left, or the drain ended it while it was tokenized
            msg.slot.reservation.release()
        else:
            self._state.enqueue(msg, time.monotonic())

    async def _decide(self) -> StepPlan:
        aborted = self._aborts.drain()
        stopped = self._aborts.drain_choices()
        abandoned = sum(
            1
            for rid in aborted
            if (item := self._state.running.get(rid)) is not None and item.slot.cancelled
        )
        decision = policy.plan(self._state, aborted, time.monotonic(), stopped)
        self._metrics.aborts.inc(abandoned + len(decision.dropped))
        if log.isEnabledFor(logging.DEBUG) and (aborted or decision.started):
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
            self._prefilled.pop(rid, None)
            await self._streamer.send(CloseStream(rid, "abort"))
        slots = {seq.request_id: seq.slot for seq in decision.plan.inserts}
        for item in decision.started:
            item.slot.started_at = time.monotonic()
            item.slot.context_shifted = item.truncated
            item.slot.id_slot = slots[item.request.request_id]
            item.slot.reservation.release()
            await self._streamer.send(
                OpenStream(
                    item.request.request_id,
                    item.slot,
                    item.request.stop,
                    item.prompt_tokens[-_PROMPT_TAIL:],
                    parse_tools=item.request.parse_tools,
                    single_tool_call=item.request.single_tool_call,
                    reasoning_open=item.reasoning_open,
                    n=item.request.n,
                    loop_limit=item.request.loop_limit,
                    tools=(
                        item.request.prompt.tools
                        if isinstance(item.request.prompt, ChatPrompt)
                        else None
                    ),
                )
            )
        return decision.plan

    async def _after(self, output: StepOutput, busy: int, seconds: float) -> None:
        if output.cache is not None:
            self._cache_stats = output.cache
        for rid, n in output.cached:
            if (item := self._state.running.get(rid)) is not None:
                item.slot.placed(n)
                self._metrics.record_cached(n)
        for rid, proposed, accepted in output.drafts:
            self._metrics.record_drafts(output.proposer, proposed, accepted)
            if (item := self._state.running.get(rid)) is not None:
                item.slot.drafted(proposed, accepted)
        for rid in output.shifted:
            if (item := self._state.running.get(rid)) is not None:
                item.slot.context_shifted = True
        prefill = 0
        for p in output.prefill:
            prefill += p.done - self._prefilled.get(p.request_id, 0)
            self._prefilled[p.request_id] = p.done
            if (item := self._state.running.get(p.request_id)) is not None:
                # The backend counts the tokens it read; the cached ones came first. The
                # prompt's last token is read with the first generated one, which reports it:
                # so a prompt of b chunks gets b reports, as llama-server's does.
                read = item.slot.cached_tokens + p.done
                if read < item.slot.prompt_tokens - 1:
                    item.slot.prefilled(read)
        self._metrics.record_step(
            seconds=seconds, busy=busy, prefill=prefill, decoded=len(output.tokens)
        )
        finished = policy.complete(self._state, output)
        for rid in finished:
            self._prefilled.pop(rid, None)
        if finished and log.isEnabledFor(logging.DEBUG):
            log.debug("finished %s", finished)
        if output.tokens:
            await self._streamer.send(StepTokens(output.tokens))
        for rid, error in output.errors:
            self._prefilled.pop(rid, None)
            await self._streamer.send(CloseStream(rid, "error", error))

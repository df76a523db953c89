"""Continuous-batching policy: who runs next, who leaves, decided between steps.

The scheduler actor calls ``plan`` at every step boundary with the ids aborted since the last
one. Aborted running sequences are removed in the same plan, so a disconnected request stops
consuming compute within one step (one decode step or one prefill chunk). Queued requests are
admitted FIFO while fewer than ``parallel`` sequences run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import attrs

from mlxcel.runtime.messages import InsertSequence, StepOutput, StepPlan, Tokenized


@attrs.define
class SchedulerState:
    parallel: int
    waiting: deque[Tokenized] = attrs.field(factory=deque)
    running: dict[str, Tokenized] = attrs.field(factory=dict)
    # Seconds a request may wait so that arrivals join the running batch together: every
    # insertion copies the batch's KV cache, so one insertion of many beats many of one.
    join_window: float = 0.0
    arrived: dict[str, float] = attrs.field(factory=dict)
    # Slot positions as llama-server numbers them (/slots): the request id in each, or None.
    slots: list[str | None] = attrs.field()

    @slots.default
    def _no_slots(self) -> list[str | None]:
        return [None] * self.parallel

    def _leave(self, rid: str) -> None:
        self.running.pop(rid, None)
        if rid in self.slots:
            self.slots[self.slots.index(rid)] = None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def enqueue(self, item: Tokenized, now: float = 0.0) -> None:
        self.waiting.append(item)
        self.arrived[item.request.request_id] = now

    def may_join(self, now: float) -> bool:
        """Start waiting requests now? Yes when idle, when they fill every free slot, or once
        the oldest has waited out the join window."""
        if not self.running or self.join_window <= 0:
            return True
        free = self.parallel - len(self.running)
        if len(self.waiting) >= free:
            return True
        oldest = min(self.arrived[i.request.request_id] for i in self.waiting)
        return now - oldest >= self.join_window


@attrs.frozen
class Decision:
    plan: StepPlan
    # Requests that left the queue without running (their reservation must be released).
    dropped: tuple[Tokenized, ...]
    # Requests that start running with this plan.
    started: tuple[Tokenized, ...]


def plan(state: SchedulerState, aborted: Iterable[str], now: float = 0.0) -> Decision:
    aborted = set(aborted)
    removes = tuple(rid for rid in aborted if rid in state.running)
    for rid in removes:
        state._leave(rid)

    dropped = tuple(item for item in state.waiting if item.request.request_id in aborted)
    if dropped:
        state.waiting = deque(i for i in state.waiting if i.request.request_id not in aborted)

    for item in dropped:
        state.arrived.pop(item.request.request_id, None)
    started: list[Tokenized] = []
    # Decided once per plan: when the window opens, everyone waiting joins together.
    join = bool(state.waiting) and state.may_join(now)
    while join and state.waiting and len(state.running) < state.parallel:
        # Strict priority between lanes, FIFO within a lane (no ageing, as llama-server).
        best = min(range(len(state.waiting)), key=lambda i: state.waiting[i].request.priority)
        item = state.waiting[best]
        del state.waiting[best]
        state.running[item.request.request_id] = item
        state.slots[state.slots.index(None)] = item.request.request_id
        state.arrived.pop(item.request.request_id, None)
        started.append(item)

    inserts = tuple(
        InsertSequence(
            request_id=item.request.request_id,
            prompt_tokens=item.prompt_tokens,
            max_tokens=item.max_tokens,
            sampling=item.request.sampling,
            ignore_eos=item.request.ignore_eos,
            cache_key=item.request.cache_key,
            logprobs=item.request.logprobs,
            grammar=item.grammar,
            thinking_budget=item.request.thinking_budget,
            reasoning_open=item.reasoning_open,
        )
        for item in started
    )
    return Decision(StepPlan(removes=removes, inserts=inserts), dropped, tuple(started))


def complete(state: SchedulerState, output: StepOutput) -> tuple[str, ...]:
    """Forget the sequences that finished in this step; return their ids."""
    finished = [t.request_id for t in output.tokens if t.finish_reason is not None]
    finished += [rid for rid, _ in output.errors]
    for rid in finished:
        state._leave(rid)
    return tuple(finished)

"""Continuous-batching policy: who runs next, who leaves, decided between steps.

The scheduler actor calls ``plan`` at every step boundary with the ids aborted since the last
one. Aborted running sequences are removed in the same plan, so a disconnected request stops
consuming compute within one step (one decode step or one prefill chunk). Queued requests are
admitted FIFO while their batch rows fit in ``parallel``: a request with n choices takes n rows
(one per choice) and gives each back as that choice finishes.
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
    # The window applies only with at least this many rows decoding. A join stalls every
    # running row for one extra model pass and one copy of the batch's KV cache, so grouping
    # arrivals saves that many rows' time; with a few rows running, the arrival's own wait
    # costs more than it saves (measured: see docs/performance.md, "join window").
    join_min_rows: int = 8
    arrived: dict[str, float] = attrs.field(factory=dict)
    # Slot positions as llama-server numbers them (/slots): the request id in each, or None.
    # A request with n choices holds n slots; ``slot_choices`` says which choice is in each.
    slots: list[str | None] = attrs.field()
    slot_choices: list[int] = attrs.field()
    # The choices of each running request that are still decoding.
    live: dict[str, set[int]] = attrs.field(factory=dict)

    @slots.default
    def _no_slots(self) -> list[str | None]:
        return [None] * self.parallel

    @slot_choices.default
    def _no_choices(self) -> list[int]:
        return [0] * self.parallel

    def _leave(self, rid: str) -> None:
        self.running.pop(rid, None)
        self.live.pop(rid, None)
        for i, held in enumerate(self.slots):
            if held == rid:
                self.slots[i] = None

    def _occupy(self, item: Tokenized) -> int:
        """Give the request its slots (choice 0 in ``id_slot`` when it names one); return the
        slot of choice 0."""
        rid, n = item.request.request_id, item.request.n
        self.running[rid] = item
        self.live[rid] = set(range(n))
        free = [i for i, held in enumerate(self.slots) if held is None]
        # Slots that waiting requests name go last, so that those find theirs free.
        wanted = {w.request.id_slot for w in self.waiting}
        free.sort(key=lambda i: i in wanted)
        pinned = item.request.id_slot
        if pinned is not None and pinned in free:
            free.remove(pinned)
            free.insert(0, pinned)
        for choice, i in zip(range(n), free, strict=False):
            self.slots[i], self.slot_choices[i] = rid, choice
        return free[0] if free else 0

    def _end_choice(self, rid: str, choice: int) -> bool:
        """One choice stopped decoding; True when that was the request's last one."""
        live = self.live.get(rid)
        if live is None or choice not in live:
            return False
        live.discard(choice)
        for i, held in enumerate(self.slots):
            if held == rid and self.slot_choices[i] == choice:
                self.slots[i] = None
        if live:
            return False
        self._leave(rid)
        return True

    @property
    def rows(self) -> int:
        """Batch rows in use: one per choice still decoding."""
        return sum(len(live) for live in self.live.values())

    def _slot_busy(self, item: Tokenized) -> bool:
        """It names a slot (id_slot) that another request holds."""
        pinned = item.request.id_slot
        return pinned is not None and pinned < self.parallel and self.slots[pinned] is not None

    def _fits(self, item: Tokenized) -> bool:
        # A request wider than the batch (HTTP rejects those) still runs once alone.
        return self.rows + item.request.n <= self.parallel or not self.running

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def enqueue(self, item: Tokenized, now: float = 0.0) -> None:
        self.waiting.append(item)
        self.arrived[item.request.request_id] = now

    def may_join(self, now: float) -> bool:
        """Start waiting requests now? Yes when idle or with few rows decoding, when they fill
        every free slot, when a high-priority one waits (a live voice turn, ``X-Priority: 0``:
        its first word is worth more than the copy saved), or once the oldest has waited out
        the join window."""
        if not self.running or self.join_window <= 0 or self.rows < self.join_min_rows:
            return True
        if any(i.request.priority == 0 for i in self.waiting):
            return True
        free = self.parallel - self.rows
        if sum(i.request.n for i in self.waiting) >= free:
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


def plan(
    state: SchedulerState,
    aborted: Iterable[str],
    now: float = 0.0,
    stopped: Iterable[tuple[str, int]] = (),
) -> Decision:
    """``aborted``: request ids to end; ``stopped``: single choices to end (stop strings)."""
    aborted = set(aborted)
    removes = [rid for rid in aborted if rid in state.running]
    for rid in removes:
        state._leave(rid)
    stop_choices = []
    for rid, choice in sorted(stopped):
        if state._end_choice(rid, choice):
            removes.append(rid)  # its last choice: drop whatever of it is left
        elif rid in state.running:
            stop_choices.append((rid, choice))

    dropped = tuple(item for item in state.waiting if item.request.request_id in aborted)
    if dropped:
        state.waiting = deque(i for i in state.waiting if i.request.request_id not in aborted)

    for item in dropped:
        state.arrived.pop(item.request.request_id, None)
    started: list[Tokenized] = []
    slot_of: dict[str, int] = {}
    # Decided once per plan: when the window opens, everyone waiting joins together.
    join = bool(state.waiting) and state.may_join(now)
    while join and state.waiting and state.rows < state.parallel:
        # Strict priority between lanes, FIFO within a lane (no ageing, as llama-server).
        # A request whose slot (id_slot) is busy is passed over, as llama-server defers it.
        ready = [i for i, w in enumerate(state.waiting) if not state._slot_busy(w)]
        if not ready:
            break
        best = min(ready, key=lambda i: state.waiting[i].request.priority)
        item = state.waiting[best]
        if not state._fits(item):
            break  # the head of the line waits for rows; nobody overtakes it
        del state.waiting[best]
        slot_of[item.request.request_id] = state._occupy(item)
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
            n=item.request.n,
            grammar=item.grammar,
            thinking_budget=item.request.thinking_budget,
            reasoning_open=item.reasoning_open,
            reasoning_control=item.request.reasoning_control is not None,
            slot=slot_of[item.request.request_id],
            n_keep=item.request.n_keep if item.request.n_keep is not None else 0,
            n_discard=item.request.n_discard,
            priority=item.request.priority,
            images=item.images,
            lora=item.request.lora or (),
        )
        for item in started
    )
    step = StepPlan(removes=tuple(removes), inserts=inserts, stop_choices=tuple(stop_choices))
    return Decision(step, dropped, tuple(started))


def complete(state: SchedulerState, output: StepOutput) -> tuple[str, ...]:
    """Forget the choices that finished in this step; return the requests that are done."""
    finished = [
        t.request_id
        for t in output.tokens
        if t.finish_reason is not None and state._end_choice(t.request_id, t.choice)
    ]
    for rid, _ in output.errors:
        if rid in state.running:
            state._leave(rid)
            finished.append(rid)
    return tuple(finished)

"""The pure scheduling policy: FIFO admission into `parallel` slots, aborts at boundaries."""

from __future__ import annotations

from typing import Any

from mlxcel.actors.scheduling import policy
from mlxcel.runtime.messages import (
    GenerationRequest,
    SamplingParams,
    StepOutput,
    TextPrompt,
    Tokenized,
    TokenOut,
)


def item(rid: str, n_prompt: int = 3, priority: int = 1) -> Tokenized:
    req = GenerationRequest(
        request_id=rid,
        prompt=TextPrompt(text="x"),
        sampling=SamplingParams(),
        max_tokens=5,
        priority=priority,
    )
    slot: Any = object()  # the policy never touches slots
    return Tokenized(req, slot, tuple(range(n_prompt)), 5)


def ids(items: Any) -> list[str]:
    return [i.request.request_id for i in items]


def test_admits_fifo_up_to_parallel() -> None:
    state = policy.SchedulerState(parallel=2)
    for rid in "abc":
        state.enqueue(item(rid))
    d = policy.plan(state, ())
    assert [s.request_id for s in d.plan.inserts] == ["a", "b"]
    assert ids(d.started) == ["a", "b"]
    assert ids(state.waiting) == ["c"]
    assert policy.plan(state, ()).plan.inserts == ()


def test_finished_sequence_frees_a_slot_for_the_next_in_line() -> None:
    state = policy.SchedulerState(parallel=1)
    for rid in "ab":
        state.enqueue(item(rid))
    policy.plan(state, ())
    done = policy.complete(state, StepOutput(tokens=(TokenOut("a", 7, "length"),)))
    assert done == ("a",)
    assert [s.request_id for s in policy.plan(state, ()).plan.inserts] == ["b"]


def test_abort_of_running_sequence_is_removed_in_the_next_plan() -> None:
    state = policy.SchedulerState(parallel=2)
    state.enqueue(item("a"))
    state.enqueue(item("b"))
    policy.plan(state, ())
    d = policy.plan(state, {"a"})
    assert d.plan.removes == ("a",)
    assert list(state.running) == ["b"]


def test_abort_of_queued_request_drops_it_without_running_it() -> None:
    state = policy.SchedulerState(parallel=1)
    for rid in "abc":
        state.enqueue(item(rid))
    policy.plan(state, ())
    d = policy.plan(state, {"b"})
    assert ids(d.dropped) == ["b"]
    assert d.plan.removes == ()
    assert ids(state.waiting) == ["c"]


def test_abort_frees_slot_for_waiting_request_in_same_plan() -> None:
    state = policy.SchedulerState(parallel=1)
    state.enqueue(item("a"))
    state.enqueue(item("b"))
    policy.plan(state, ())
    d = policy.plan(state, {"a", "unknown"})
    assert d.plan.removes == ("a",)
    assert [s.request_id for s in d.plan.inserts] == ["b"]


def test_errors_in_a_step_end_those_sequences() -> None:
    state = policy.SchedulerState(parallel=2)
    state.enqueue(item("a"))
    policy.plan(state, ())
    assert policy.complete(state, StepOutput(errors=(("a", "boom"),))) == ("a",)
    assert state.idle


def test_slots_are_numbered_lowest_free_first() -> None:
    state = policy.SchedulerState(parallel=3)
    for rid in "abcd":
        state.enqueue(item(rid))
    policy.plan(state, ())
    assert state.slots == ["a", "b", "c"]
    policy.plan(state, {"b"})  # b leaves, d takes its place
    assert state.slots == ["a", "d", "c"]
    policy.complete(state, StepOutput(tokens=(TokenOut("a", 1, "stop"),)))
    assert state.slots == [None, "d", "c"]


def test_priority_lanes_are_strict_and_fifo_within_a_lane() -> None:
    import attrs

    def prio(rid: str, p: int) -> Tokenized:
        t = item(rid)
        return attrs.evolve(t, request=attrs.evolve(t.request, priority=p))

    state = policy.SchedulerState(parallel=1)
    state.enqueue(prio("running", 1))
    policy.plan(state, ())
    for rid, p in [("low1", 2), ("norm1", 1), ("high1", 0), ("norm2", 1), ("high2", 0)]:
        state.enqueue(prio(rid, p))
    order = []
    for _ in range(5):
        rid = next(iter(state.running))
        policy.complete(state, StepOutput(tokens=(TokenOut(rid, 1, "stop"),)))
        order.append(policy.plan(state, ()).plan.inserts[0].request_id)
    assert order == ["high1", "high2", "norm1", "norm2", "low1"]


def test_join_window_groups_arrivals_into_the_running_batch() -> None:
    state = policy.SchedulerState(parallel=4, join_window=0.5, join_min_rows=1)
    state.enqueue(item("a"), now=0.0)
    assert [s.request_id for s in policy.plan(state, (), now=0.0).plan.inserts] == [
        "a"
    ]  # idle: at once
    state.enqueue(item("b"), now=1.0)
    assert policy.plan(state, (), now=1.2).plan.inserts == ()  # waits for company
    state.enqueue(item("c"), now=1.3)
    assert [s.request_id for s in policy.plan(state, (), now=1.5).plan.inserts] == ["b", "c"]
    for rid in "def":
        state.enqueue(item(rid), now=2.0)
    # Enough arrivals to fill every free slot: no reason to wait.
    assert [s.request_id for s in policy.plan(state, (), now=2.0).plan.inserts] == ["d"]


def test_with_few_rows_decoding_an_arrival_does_not_wait_for_company() -> None:
    state = policy.SchedulerState(parallel=16, join_window=0.5, join_min_rows=3)
    state.enqueue(item("a"), now=0.0)
    state.enqueue(item("b"), now=0.0)
    policy.plan(state, (), now=0.0)
    state.enqueue(item("c"), now=1.0)
    # Two rows decoding, under join_min_rows: joining costs them less than c would wait.
    assert [s.request_id for s in policy.plan(state, (), now=1.0).plan.inserts] == ["c"]
    state.enqueue(item("d"), now=2.0)
    # Three rows now: d waits for company (the window), up to 0.5 s.
    assert policy.plan(state, (), now=2.1).plan.inserts == ()
    assert [s.request_id for s in policy.plan(state, (), now=2.5).plan.inserts] == ["d"]


def test_a_high_priority_arrival_joins_at_once_and_brings_the_waiting_along() -> None:
    state = policy.SchedulerState(parallel=4, join_window=0.5, join_min_rows=1)
    state.enqueue(item("a"), now=0.0)
    policy.plan(state, (), now=0.0)
    state.enqueue(item("b"), now=1.0)
    assert policy.plan(state, (), now=1.1).plan.inserts == ()
    # A live voice turn (priority 0) does not wait for company.
    state.enqueue(item("voice", priority=0), now=1.2)
    assert [s.request_id for s in policy.plan(state, (), now=1.2).plan.inserts] == [
        "voice",
        "b",
    ]

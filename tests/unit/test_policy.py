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


def item(rid: str, n_prompt: int = 3) -> Tokenized:
    req = GenerationRequest(
        request_id=rid, prompt=TextPrompt(text="x"), sampling=SamplingParams(), max_tokens=5
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

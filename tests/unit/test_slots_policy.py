"""`id_slot` in the pure policy, and the token arithmetic of context shift (no mlx model)."""

from __future__ import annotations

from typing import Any

import attrs

from mlxcel.actors.model_runner.slots import shifted
from mlxcel.actors.scheduling import policy
from mlxcel.actors.tokenizer import truncate_prompt
from mlxcel.runtime.messages import (
    GenerationRequest,
    SamplingParams,
    StepOutput,
    TextPrompt,
    Tokenized,
    TokenOut,
)


def item(rid: str, id_slot: int | None = None, priority: int = 1) -> Tokenized:
    req = GenerationRequest(
        request_id=rid,
        prompt=TextPrompt(text="x"),
        sampling=SamplingParams(),
        max_tokens=5,
        id_slot=id_slot,
        priority=priority,
    )
    slot: Any = object()  # the policy never touches output slots
    return Tokenized(req, slot, (1, 2, 3), 5)


def test_a_request_runs_in_the_slot_it_names() -> None:
    state = policy.SchedulerState(parallel=3)
    state.enqueue(item("a", id_slot=2))
    state.enqueue(item("b"))
    d = policy.plan(state, ())
    assert {s.request_id: s.slot for s in d.plan.inserts} == {"a": 2, "b": 0}
    assert state.slots == ["b", None, "a"]


def test_a_pinned_request_waits_for_its_slot_while_others_go_ahead() -> None:
    state = policy.SchedulerState(parallel=3)
    state.enqueue(item("a", id_slot=0))
    policy.plan(state, ())
    state.enqueue(item("b", id_slot=0))
    state.enqueue(item("c"))
    d = policy.plan(state, ())  # slot 0 is busy: b waits (llama-server defers it), c runs
    assert [(s.request_id, s.slot) for s in d.plan.inserts] == [("c", 1)]
    assert [w.request.request_id for w in state.waiting] == ["b"]
    policy.complete(state, StepOutput(tokens=(TokenOut("a", 7, "length"),)))
    state.enqueue(item("d"))
    d = policy.plan(state, ())
    # b first: the slot it waited for is its own, and d takes the one left.
    assert [(s.request_id, s.slot) for s in d.plan.inserts] == [("b", 0), ("d", 2)]


def test_inserts_carry_the_shift_fields() -> None:
    state = policy.SchedulerState(parallel=1)
    base = item("a")
    state.enqueue(attrs.evolve(base, request=attrs.evolve(base.request, n_keep=-1, n_discard=9)))
    (seq,) = policy.plan(state, ()).plan.inserts
    assert (seq.n_keep, seq.n_discard) == (-1, 9)


def test_shift_keeps_n_keep_and_drops_half_of_the_rest_by_default() -> None:
    tokens = list(range(128))
    out = shifted(tokens, 128, n_keep=10, n_discard=0, n_prompt=20)
    assert out == tokens[:10] + tokens[10 + 59 :]
    assert shifted(tokens, 128, n_keep=-1, n_discard=8, n_prompt=20) == tokens[:20] + tokens[28:]
    # n_keep is at most the context less 4, and something is always dropped.
    assert len(shifted(tokens, 128, n_keep=500, n_discard=0, n_prompt=20)) < 128


def test_a_long_prompt_is_cut_as_llama_server_cuts_it() -> None:
    # llama.cpp's own test: 301 prompt tokens in a 128-token context keep the last 109.
    tokens = list(range(301))
    assert truncate_prompt(tokens, 128, 0) == tokens[-109:]
    kept = truncate_prompt(tokens, 128, 5)
    assert kept[:5] == tokens[:5] and len(kept) < 128 and kept[-1] == 300


def test_others_leave_free_the_slot_a_waiting_request_names() -> None:
    state = policy.SchedulerState(parallel=3)
    state.enqueue(item("a", id_slot=0))
    state.enqueue(item("b"))
    policy.plan(state, ())  # a in 0, b in 1
    state.enqueue(item("d", id_slot=0))
    assert policy.plan(state, ()).plan.inserts == ()  # d waits for slot 0
    policy.complete(state, StepOutput(tokens=(TokenOut("a", 7, "length"),)))
    state.enqueue(item("e", priority=0))  # goes first, and must not take slot 0
    d = policy.plan(state, ())
    assert [(s.request_id, s.slot) for s in d.plan.inserts] == [("e", 2), ("d", 0)]

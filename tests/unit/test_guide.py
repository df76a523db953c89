"""The per-row guide on the compute thread's side: forced end-of-thinking tokens, grammar masks,
and a matcher error that ends the row instead of the batch step."""

from __future__ import annotations

# Before anything imports mlx.core: loads OpenBLAS with RTLD_GLOBAL (see mlxcel/models/blas.py).
import mlxcel.models  # noqa: F401  isort: skip  (OpenBLAS before mlx)

import concurrent.futures
import json
from typing import Any

import mlx.core as mx
import pytest

from mlxcel.actors.grammars import schema_grammar
from mlxcel.actors.model_runner.guide import GuideKit

V = 49152
START, END = (100,), (101, 102)  # stand-ins for the <think> / </think> token sequences


@pytest.fixture(scope="module")
def kit(smollm_tokenizer: Any) -> GuideKit:
    return GuideKit(smollm_tokenizer, vocab_size=V, eos_token_ids=[2], think=(START, END))


def _allowed(logits: mx.array) -> list[int]:
    return [i for i, v in enumerate(logits[0].tolist()) if v != float("-inf")]


class Row:
    """Feeds a guide the way mlx-lm's batch step does: a growing context, one token a step."""

    def __init__(self, guide: Any, prompt: list[int]) -> None:
        self.guide, self.context = guide, list(prompt)

    def step(self, token: int | None = None) -> list[int]:
        if token is not None:
            self.context.append(token)
        return _allowed(self.guide(mx.array(self.context), mx.zeros((1, V))))


def test_rows_without_grammar_or_thinking_get_no_guide(smollm_tokenizer: Any) -> None:
    plain = GuideKit(smollm_tokenizer, vocab_size=V, eos_token_ids=[2], think=None)
    # A budget on a template that does not think has nothing to close.
    assert plain.guide(grammar=None, budget=3, reasoning_open=False) is None
    assert plain.guide(grammar=None, budget=None, reasoning_open=False) is None


def test_budget_forces_the_end_marker_after_n_thinking_tokens(kit: GuideKit) -> None:
    row = Row(kit.guide(grammar=None, budget=2, reasoning_open=True), [1, 5, 100])
    assert len(row.step()) == V
    assert len(row.step(7)) == V
    assert row.step(8) == [101]  # two thinking tokens: close now
    assert row.step(101) == [102]
    assert len(row.step(102)) == V  # answer: free again


def test_budget_zero_closes_at_once_and_on_a_late_opening(kit: GuideKit) -> None:
    row = Row(kit.guide(grammar=None, budget=0, reasoning_open=True), [1, 100])
    assert row.step() == [101]
    row = Row(kit.guide(grammar=None, budget=0, reasoning_open=False), [1, 5])
    assert len(row.step()) == V
    assert row.step(100) == [101]  # the model opened thinking itself


def test_grammar_waits_for_thinking_then_masks(kit: GuideKit, smollm_tokenizer: Any) -> None:
    grammar = schema_grammar(json.dumps({"type": "object", "properties": {}}))
    row = Row(kit.guide(grammar=grammar, budget=1, reasoning_open=True), [1, 100])
    assert len(row.step()) == V
    assert row.step(9) == [101]
    assert row.step(101) == [102]
    allowed = row.step(102)
    assert 0 < len(allowed) < 100
    assert all(smollm_tokenizer.decode([t]).startswith("{") for t in allowed)


def test_a_token_the_grammar_refuses_fails_the_row_with_eos(kit: GuideKit) -> None:
    grammar = schema_grammar(json.dumps({"type": "integer"}))
    guide = kit.guide(grammar=grammar, budget=None, reasoning_open=False)
    assert guide is not None
    row = Row(guide, [1, 5])
    assert 0 < len(row.step()) < V
    assert guide.error is None
    assert row.step(100) == [2]  # not a digit: the row can only end
    assert guide.error is not None and "Constrained decoding failed" in guide.error


def test_a_failed_row_leaves_the_batch_and_is_reported(tiny_model_dir: Any) -> None:
    # A backend lives on its own thread, as under the model runner: closing it releases that
    # thread's mlx streams, which must not be the test runner's.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(_fail_one_row, tiny_model_dir).result()


def _fail_one_row(tiny_model_dir: Any) -> None:
    from mlxcel.actors.model_runner.mlx_backend import MlxBackend
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model
    from mlxcel.runtime.messages import InsertSequence, SamplingParams, StepPlan
    from mlxcel.runtime.settings import Settings

    backend = MlxBackend(load_model(resolve_model(str(tiny_model_dir))), Settings(warmup=False))
    try:
        greedy = SamplingParams(temperature=0.0)
        grammar = schema_grammar(json.dumps({"type": "array", "items": {"type": "integer"}}))
        plan = StepPlan(
            inserts=(
                InsertSequence("json", (1, 5, 9), 50, greedy, ignore_eos=True, grammar=grammar),
                InsertSequence("free", (1, 5, 9), 50, greedy, ignore_eos=True),
            )
        )
        seen: dict[str, list[int]] = {"json": [], "free": []}
        for _ in range(4):
            out = backend.apply(plan)
            plan = StepPlan()
            assert not out.errors
            for t in out.tokens:
                seen[t.request_id].append(t.token)
        assert seen["json"] and seen["free"]
        # Stand in for an llguidance failure (resource limits, an internal error): the row
        # must fail alone, reported once, while the batch goes on.
        (uid,) = backend._uids_by_rid["json"]
        backend._guides[uid].fail("simulated")
        out = backend.apply(StepPlan())
        assert out.errors == (("json", "Constrained decoding failed: simulated"),)
        assert [t.request_id for t in out.tokens] == ["free"]
        out = backend.apply(StepPlan())
        assert not out.errors and [t.request_id for t in out.tokens] == ["free"]
    finally:
        backend.close()


def test_reasoning_control_ends_the_thinking_on_request(kit: GuideKit) -> None:
    # Armed without a budget: free thinking until asked, then the end marker is forced.
    guide = kit.guide(grammar=None, budget=None, reasoning_open=True, controllable=True)
    assert guide is not None
    row = Row(guide, [1, 5, 100])
    for token in (7, 8, 9):
        assert len(row.step(token)) == V
    guide.end_thinking()
    assert row.step(10) == [101]
    assert row.step(101) == [102]
    assert len(row.step(102)) == V  # answer: free again
    guide.end_thinking()  # after the block: nothing more to close in the answer
    assert len(row.step(11)) == V


def test_reasoning_control_before_the_block_opens_closes_it_at_once(kit: GuideKit) -> None:
    guide = kit.guide(grammar=None, budget=None, reasoning_open=False, controllable=True)
    assert guide is not None
    row = Row(guide, [1, 5])
    assert len(row.step()) == V
    guide.end_thinking()
    assert len(row.step(7)) == V  # not thinking yet: nothing to force
    assert row.step(100) == [101]  # the block opens: closed at once
    assert row.step(101) == [102]


def test_reasoning_control_needs_thinking_markers(smollm_tokenizer: Any) -> None:
    plain = GuideKit(smollm_tokenizer, vocab_size=V, eos_token_ids=[2], think=None)
    assert plain.guide(grammar=None, budget=None, reasoning_open=False, controllable=True) is None

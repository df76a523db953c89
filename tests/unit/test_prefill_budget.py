"""The prefill budget: while rows decode, reading prompts takes at most its share of the
runner's time, urgent prompts excepted, and no token changes for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxcel.actors.model_runner.mlx_backend import MlxBackend
from mlxcel.actors.model_runner.prefill_budget import MIN_CHUNK, PrefillBudget
from mlxcel.runtime.messages import InsertSequence, SamplingParams, StepPlan
from mlxcel.runtime.settings import Settings


def test_reading_takes_its_share_of_the_time_while_rows_decode() -> None:
    budget = PrefillBudget(share=0.2, burst=1.0)
    clock = decode_time = read_time = 0.0
    # A long prompt against running rows: decode steps of 0.1 s, chunks of 0.5 s.
    while clock < 600:
        if budget.may_read(decoding=True, urgent=False):
            budget.read(0.5, 128, decoding=True)
            read_time += 0.5
            clock += 0.5
        budget.decoded(0.1)
        decode_time += 0.1
        clock += 0.1
    assert read_time / clock == pytest.approx(0.2, abs=0.01)


def test_an_idle_spell_refills_the_credit_and_a_short_prompt_starts_at_once() -> None:
    budget = PrefillBudget(share=0.2, burst=1.0)
    budget.read(3.0, 1000, decoding=True)
    assert not budget.may_read(decoding=True, urgent=False)
    # Urgent rows (a voice turn) and a batch with nothing decoding read regardless.
    assert budget.may_read(decoding=True, urgent=True)
    assert budget.may_read(decoding=False, urgent=False)
    assert budget.credit == 1.0
    assert budget.may_read(decoding=True, urgent=False)


def test_chunks_are_cut_to_a_slice_of_time_only_while_rows_decode() -> None:
    budget = PrefillBudget(share=0.2, slice_s=0.5)
    assert budget.chunk(decoding=True, rows=1, full=512) == 512  # no rate measured yet
    budget.read(1.0, 400, decoding=False)  # 400 tokens/s
    assert budget.chunk(decoding=True, rows=1, full=512) == 200
    assert budget.chunk(decoding=True, rows=2, full=512) == 100
    assert budget.chunk(decoding=True, rows=64, full=512) == MIN_CHUNK
    assert budget.chunk(decoding=False, rows=1, full=512) == 512
    assert budget.chunk(decoding=True, rows=1, full=16) == 16
    assert PrefillBudget(share=1.0).chunk(decoding=True, rows=1, full=512) == 512


def _reading_share(budget: PrefillBudget, waiting: int, decoding: int, step_s: float) -> float:
    """Simulate 600 s of decode steps of ``step_s`` with prompts read in the chunks the budget
    cuts (at 100 tokens/s) whenever it lets them: the share of the time spent reading."""
    clock = read_time = 0.0
    budget.read(1.0, 100, decoding=False)  # the measured rate: 100 tokens/s
    while clock < 600:
        budget.rows(waiting, decoding)
        if budget.may_read(decoding=True, urgent=False):
            seconds = budget.chunk(True, waiting, 512) * waiting / 100
            budget.read(seconds, int(seconds * 100), decoding=True)
            read_time += seconds
            clock += seconds
        budget.decoded(step_s)
        clock += step_s
    return read_time / clock


def test_rows_waiting_get_their_fair_part_when_it_is_above_the_share() -> None:
    # One row decoding, 15 prompts waiting: held to 0.2, the batch ran nearly empty while
    # they waited; each row's equal part gives reading 15/16 of the time.
    assert _reading_share(PrefillBudget(share=0.2), 15, 1, 0.08) == pytest.approx(15 / 16, abs=0.02)
    assert _reading_share(PrefillBudget(share=0.2), 4, 4, 0.2) == pytest.approx(0.5, abs=0.02)
    # One long prompt beside 16 running rows: the configured share protects them.
    assert _reading_share(PrefillBudget(share=0.2), 1, 16, 0.3) == pytest.approx(0.2, abs=0.02)
    budget = PrefillBudget(share=0.2)
    assert budget.rows(15, 1) == 15 / 16
    assert budget.rows(1, 16) == 0.2
    assert budget.rows(3, 0) == 1.0  # nothing decoding: nobody to protect


def test_a_short_prompt_is_one_that_reads_in_the_burst() -> None:
    budget = PrefillBudget(share=0.2, burst=1.0)
    assert budget.short(decoding=True, full=512) == 512  # no rate measured yet
    budget.read(1.0, 90, decoding=False)  # 90 tokens/s (a 1B model here)
    assert budget.short(decoding=True, full=512) == 90
    assert budget.short(decoding=False, full=512) == 512
    assert budget.short(decoding=True, full=64) == 64
    budget.read(1.0, 10, decoding=False)  # a slow model: never below one minimum chunk
    budget.rate = 10.0
    assert budget.short(decoding=True, full=512) == MIN_CHUNK


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> Any:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    return load_model(resolve_model(str(tiny_model_dir)))


GREEDY = SamplingParams(temperature=0.0)


def _run(
    loaded: Any, share: float, priority: int, length: int = 600
) -> tuple[dict[str, list[int]], list[int]]:
    """Two rows decoding, then a prompt of ``length`` tokens (read 32 a step) arrives: each
    request's tokens, and the steps in which the running rows got tokens before the new
    prompt's first."""
    backend = MlxBackend(
        loaded,
        Settings(
            parallel=4,
            cache_ram_mib=0,
            prefill_chunk_size=32,
            prefill_share=share,
            spec_ngram=False,
        ),
    )
    budget = backend._gen._budget
    budget.burst = budget.credit = 1e-3  # no head start: the share alone decides
    plan = StepPlan(
        inserts=tuple(
            InsertSequence(f"r{i}", (5 + i, 6, 7), 2000, GREEDY, ignore_eos=True) for i in range(2)
        )
    )
    said: dict[str, list[int]] = {}
    steps_before_first = []
    for step in range(5000):
        out = backend.apply(plan)
        plan = StepPlan()
        if step == 2:
            long = InsertSequence(
                "long",
                tuple(range(100, 100 + length)),
                4,
                GREEDY,
                ignore_eos=True,
                priority=priority,
            )
            plan = StepPlan(inserts=(long,))
        for t in out.tokens:
            said.setdefault(t.request_id, []).append(t.token)
        if step > 2 and "long" not in said:
            steps_before_first.append(sum(1 for t in out.tokens if t.request_id != "long"))
        if "long" in said and len(said["long"]) == 4:
            break
    return said, steps_before_first


def test_running_rows_keep_decoding_while_a_long_prompt_is_read(loaded: Any) -> None:
    free, free_steps = _run(loaded, 1.0, priority=1)
    held, held_steps = _run(loaded, 0.1, priority=1)
    # Without a budget the long prompt is read a chunk a step (19 steps of 32 tokens); with
    # one, running rows decode in steps that read nothing between its chunks.
    assert len(free_steps) <= 20
    assert len(held_steps) > 2 * len(free_steps)
    assert all(n == 2 for n in held_steps)
    # Reading in another order changes no token.
    assert held["long"] == free["long"]
    for rid in ("r0", "r1"):
        n = min(len(held[rid]), len(free[rid]))
        assert held[rid][:n] == free[rid][:n]


def test_an_urgent_prompt_is_read_past_the_budget(loaded: Any) -> None:
    free, free_steps = _run(loaded, 1.0, priority=1)
    urgent, urgent_steps = _run(loaded, 0.1, priority=0)
    assert len(urgent_steps) == len(free_steps)
    assert urgent["long"] == free["long"]


def test_a_prompt_that_fits_in_one_chunk_is_read_at_once(loaded: Any) -> None:
    free, free_steps = _run(loaded, 1.0, priority=1, length=30)
    short, short_steps = _run(loaded, 0.1, priority=1, length=30)
    assert len(short_steps) == len(free_steps) <= 2
    assert short["long"] == free["long"]

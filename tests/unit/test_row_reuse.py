"""Row reuse on the tiny random llama: with many rows decoding, a finished row stays as a hole
and a joining row is written into it in place; every row's tokens are the same as when each
join and leave copies the batch (mlx-lm's way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm.generate import StopSequences

from mlxcel.actors.model_runner import row_reuse
from mlxcel.actors.model_runner.eager_start import EagerStartBatchGenerator
from mlxcel.models import mlx_lm_compat as compat


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    return load_model(resolve_model(str(tiny_model_dir))).model


def _churn(
    model: Any, *, reuse: bool, monkeypatch: pytest.MonkeyPatch, steps: int = 90, **insert: Any
) -> tuple[dict[int, list[int]], Any]:
    """16 rows decode with answers of different lengths; every step, as many new rows join as
    left (shorter prompts than the running rows, so they fit into holes); a few are removed
    by the caller mid-answer (cancellation). Returns each row's tokens and the final batch."""
    monkeypatch.setattr(row_reuse, "enabled", reuse)
    gen = EagerStartBatchGenerator(
        model, max_tokens=64, completion_batch_size=24, prefill_step_size=64, hold=lambda u: False
    )
    tokens: dict[int, list[int]] = {}
    made = 0

    def join(n: int) -> None:
        nonlocal made
        prompts = [
            [(7 * (made + k) + j) % 250 + 3 for j in range(8 + (made + k) % 9)] for k in range(n)
        ]
        limits = [6 + (made + k) * 5 % 17 for k in range(n)]
        made += n
        per_row = {k: v * n for k, v in insert.items()}
        for uid in gen.insert(prompts, max_tokens=limits, **per_row):
            tokens[uid] = []

    gen.insert(
        [list(range(3, 60 + 3 * k)) for k in range(16)], max_tokens=[40 + k for k in range(16)]
    )
    tokens.update({uid: [] for uid in range(16)})
    for step in range(steps):
        _, generated = gen.next()
        finished = 0
        for r in generated:
            tokens[r.uid].append(r.token)
            finished += r.finish_reason is not None
        if step % 11 == 5:  # a client leaves mid-answer
            batch = compat.generation_batch(gen)
            live = sorted(u for i, u in enumerate(batch.uids) if not batch.is_hole(i))
            if live:
                gen.remove([live[len(live) // 2]])
                finished += 1
        if finished and step < steps - 30:
            # Now and then one more joins than left: the holes are filled, the rest appended.
            join(finished + (step % 7 == 3))
    return tokens, compat.generation_batch(gen)


def test_joins_fill_holes_and_every_token_is_the_same(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    copied, plain = _churn(model, reuse=False, monkeypatch=monkeypatch)
    reused, batch = _churn(model, reuse=True, monkeypatch=monkeypatch)
    assert plain.reused_rows == 0
    assert batch.reused_rows > 10  # joins went into holes, not onto the end
    assert reused == copied
    assert sum(map(len, reused.values())) > 500


def test_stop_sequences_and_processors_see_the_same_tokens(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(repetition_penalty=1.3, repetition_context_size=8)
    stops = StopSequences([[50, 51], [17]])
    extra = {"logits_processors": [processors], "stop_sequences": [stops]}
    copied, _ = _churn(model, reuse=False, monkeypatch=monkeypatch, **extra)
    reused, batch = _churn(model, reuse=True, monkeypatch=monkeypatch, **extra)
    assert batch.reused_rows > 0
    assert reused == copied


def test_few_rows_leave_no_holes(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(row_reuse, "enabled", True)
    gen = EagerStartBatchGenerator(
        model, max_tokens=64, completion_batch_size=8, prefill_step_size=64, hold=lambda u: False
    )
    gen.insert([list(range(3, 20 + k)) for k in range(4)], max_tokens=[3, 20, 20, 20])
    for _ in range(6):
        gen.next()
    batch = compat.generation_batch(gen)
    assert len(batch) == len(batch.uids) == 3  # compacted: below MIN_ROWS a copy is cheap


@pytest.mark.parametrize(
    ("physical", "holes", "live", "ended", "padding", "expected"),
    [
        (32, 0, 31, 1, 0, True),
        (32, 7, 24, 1, 0, True),  # 8 of 32: a quarter
        (32, 8, 23, 1, 0, False),  # past a quarter: compact
        (8, 0, 7, 1, 0, False),  # too few rows left
        (32, 0, 31, 1, row_reuse.TRIM_PADDING, False),  # trimming pays
    ],
)
def test_when_holes_stay(
    physical: int, holes: int, live: int, ended: int, padding: int, expected: bool
) -> None:
    counts = {"physical": physical, "holes": holes, "live": live, "ended": ended}
    got = row_reuse.may_leave_holes(reusable=True, live_padding=padding, **counts)
    assert got is expected
    assert not row_reuse.may_leave_holes(reusable=False, live_padding=0, **counts)


def _serve(loaded: Any, *, reuse: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """The model runner's backend under churn, with what rides on a row: seeded sampling,
    penalties, log-probabilities, n choices, grammars, the prompt cache (finished and
    cancelled rows donate), cancellations. Returns what each (request, choice) got, and the
    generation batch."""
    from mlxcel.actors.model_runner.mlx_backend import MlxBackend
    from mlxcel.runtime.messages import InsertSequence, SamplingParams, StepPlan
    from mlxcel.runtime.settings import Settings

    monkeypatch.setattr(row_reuse, "enabled", reuse)
    backend = MlxBackend(loaded, Settings(parallel=32, cache_ram_mib=64, prefill_chunk_size=16))
    got: dict[tuple[str, int], list[Any]] = {}
    greedy = SamplingParams(temperature=0.0)
    kinds = [
        {},
        {"sampling": SamplingParams(temperature=0.9, seed=5, top_k=20)},
        {"sampling": SamplingParams(temperature=0.0, repetition_penalty=1.4)},
        {"logprobs": 3},
        {"n": 2, "sampling": SamplingParams(temperature=1.0, seed=9)},
        {"grammar": 'start: "yes" | "no" | /[a-z ]{3,40}/'},
    ]

    def request(k: int, length: int, limit: int) -> InsertSequence:
        fields: dict[str, Any] = {"sampling": greedy, **kinds[k % len(kinds)]}
        prompt = tuple((11 * k + j) % 300 + 5 for j in range(length))
        return InsertSequence(f"q{k}", prompt, limit, ignore_eos=True, cache_key="t", **fields)

    plan = StepPlan(inserts=tuple(request(k, 50 + k, 30 + 2 * k) for k in range(16)))
    made = 16
    for step in range(120):
        out = backend.apply(plan)
        plan = StepPlan()
        ended = 0
        for t in out.tokens:
            got.setdefault((t.request_id, t.choice), []).append(
                (t.token, t.finish_reason, t.logprob)
            )
            ended += t.finish_reason is not None and t.choice == 0
        removes: tuple[str, ...] = ()
        if step % 13 == 7:
            live = sorted({r for r in backend._rid_by_uid.values()})
            if live:
                removes = (live[len(live) // 2],)
        joins = tuple(
            request(made + i, 12 + (made + i) % 20, 4 + (made + i) % 23)
            for i in range(ended + len(removes))
        )
        made += len(joins)
        if step < 90:
            plan = StepPlan(removes=removes, inserts=joins)
    while backend._rid_by_uid:
        for t in backend.apply(StepPlan()).tokens:
            got.setdefault((t.request_id, t.choice), []).append(
                (t.token, t.finish_reason, t.logprob)
            )
    return got, compat.generation_batch(backend._gen)


def test_the_backend_gives_every_request_the_same_answer(
    model: Any, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    loaded = load_model(resolve_model(str(tiny_model_dir)))
    copied, _ = _serve(loaded, reuse=False, monkeypatch=monkeypatch)
    reused, batch = _serve(loaded, reuse=True, monkeypatch=monkeypatch)
    assert batch.reused_rows > 10
    assert reused.keys() == copied.keys()
    for key, answer in copied.items():
        tokens = [t for t, _, _ in answer]
        assert [t for t, _, _ in reused[key]] == tokens, key
        assert [f for _, f, _ in reused[key]] == [f for _, f, _ in answer], key
        for (_, _, a), (_, _, b) in zip(reused[key], answer, strict=True):
            assert (a is None) == (b is None) and (a is None or abs(a - b) < 1e-4), key

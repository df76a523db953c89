"""Decode attention in groups of rows of similar length (``mlxcel.models.ragged``): the plan
cuts only where it saves reads, and grouped attention gives every row what the padded batch
gives it, in the model too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlxcel.models  # noqa: F401  isort: skip  (OpenBLAS before mlx)

import numpy as np
import pytest

from mlxcel.actors.model_runner.mlx_backend import MlxBackend
from mlxcel.models import fast_math, ragged
from mlxcel.models.mlx_setup import mx
from mlxcel.runtime.messages import InsertSequence, SamplingParams, StepPlan
from mlxcel.runtime.settings import Settings


def test_rows_of_one_length_stay_one_group() -> None:
    assert ragged.plan([0] * 16, 500) is None
    # A few rows a little shorter: cutting saves less than another call costs.
    assert ragged.plan([0, 0, 3, 5], 500) is None
    assert ragged.plan([7], 900) is None


def test_a_long_row_among_short_ones_is_cut_off() -> None:
    pads = [1973] * 8 + [0] + [1970] * 7
    groups = ragged.plan(pads, 2010)
    assert groups is not None
    by_rows = {g.rows: g.start for g in groups}
    short = tuple(i for i in range(16) if i != 8)
    assert by_rows == {short: 1970, (8,): 0}


def test_groups_cover_every_row_once_and_start_at_their_longest_row() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        rows = int(rng.integers(2, 65))
        kv_len = int(rng.integers(50, 4000))
        pads = [int(p) for p in rng.integers(0, kv_len, size=rows)]
        groups = ragged.plan(pads, kv_len)
        if groups is None:
            continue
        assert 2 <= len(groups) <= ragged.MAX_GROUPS
        assert sorted(i for g in groups for i in g.rows) == list(range(rows))
        for g in groups:
            assert g.start == min(pads[i] for i in g.rows)
        # Fewer key reads than the padded batch, by more than the extra calls cost.
        reads = sum(len(g.rows) * (kv_len - g.start) for g in groups)
        assert rows * kv_len - reads > ragged.OVERHEAD_KEYS * (len(groups) - 1) / 2


def _mask(pads: list[int], n: int, kv_len: int) -> mx.array:
    """mlx-lm's batch mask: left padding, and causal over the ``n`` new positions."""
    q_pos = np.arange(kv_len - n, kv_len)[:, None]
    k_pos = np.arange(kv_len)[None, :]
    keep = (k_pos <= q_pos)[None] & (k_pos >= np.array(pads)[:, None, None])
    return mx.array(keep[:, None])


@pytest.mark.parametrize("n", [1, 5])
def test_grouped_attention_equals_the_padded_batch(n: int) -> None:
    rng = np.random.default_rng(n)
    b, heads, kv_heads, d, kv_len = 7, 9, 3, 64, 700
    # Long rows in the middle and at the ends: groups of rows that are not neighbours.
    pads = [660, 0, 650, 655, 20, 640, 690 - n]
    q = mx.array(rng.normal(size=(b, heads, n, d)).astype(np.float32))
    k, v = (mx.array(rng.normal(size=(b, kv_heads, kv_len, d)).astype(np.float32)) for _ in "kv")
    mask = _mask(pads, n, kv_len)
    groups = ragged.plan(pads, kv_len)
    assert groups is not None and any(len(g.rows) > 1 for g in groups)

    def attend(q: mx.array, k: mx.array, v: mx.array, *, mask: Any) -> mx.array:
        return fast_math.attention(q, k, v, scale=d**-0.5, mask=mask)

    padded = np.array(attend(q, k, v, mask=mask))
    grouped = np.array(ragged.attend_grouped(groups, attend, q, k, v, mask))
    assert grouped.shape == padded.shape
    assert np.abs(grouped - padded).max() < 2e-6


def _tokens(loaded: Any, inserts: list[InsertSequence]) -> dict[str, list[Any]]:
    backend = MlxBackend(loaded, Settings(parallel=8, cache_ram_mib=0, spec_ngram=False))
    out: dict[str, list[Any]] = {}
    plan = StepPlan(inserts=tuple(inserts[:-1]))
    for step in range(200):
        result = backend.apply(plan)
        # The long prompt joins rows that are already decoding.
        plan = StepPlan(inserts=(inserts[-1],)) if step == 3 else StepPlan()
        for t in result.tokens:
            out.setdefault(t.request_id, []).append((t.token, t.logprob))
        if step > 4 and not backend._rid_by_uid:
            break
    return out


def test_the_model_says_the_same_with_and_without_groups(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    loaded = load_model(resolve_model(str(tiny_model_dir)))
    greedy = SamplingParams(temperature=0.0)
    inserts = [
        InsertSequence(
            f"s{i}", tuple(range(10 + i, 30 + 3 * i)), 24, greedy, logprobs=1, ignore_eos=True
        )
        for i in range(5)
    ]
    inserts.append(
        InsertSequence("long", tuple(range(100, 900)), 24, greedy, logprobs=1, ignore_eos=True)
    )
    # Grouping is the path where the native attention node does not run (it skips padded keys
    # by itself): off here, then compared with the native path at the end.
    monkeypatch.setenv("MLXCEL_NATIVE", "0")
    calls = []
    real = ragged.attend_grouped
    monkeypatch.setattr(
        ragged, "attend_grouped", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    grouped = _tokens(loaded, inserts)
    assert calls, "the long row never made the batch attend in groups"
    monkeypatch.setattr(ragged, "enabled", False)
    calls.clear()
    padded = _tokens(loaded, inserts)
    assert not calls
    assert set(grouped) == {f"s{i}" for i in range(5)} | {"long"}
    for rid, said in padded.items():
        assert [t for t, _ in grouped[rid]] == [t for t, _ in said], rid
        assert np.allclose([lp for _, lp in grouped[rid]], [lp for _, lp in said], atol=1e-4)
    monkeypatch.delenv("MLXCEL_NATIVE")
    native = _tokens(loaded, inserts)
    assert not calls
    for rid, said in native.items():
        assert [t for t, _ in grouped[rid]] == [t for t, _ in said], rid
        assert np.allclose([lp for _, lp in grouped[rid]], [lp for _, lp in said], atol=1e-4)

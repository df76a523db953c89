"""The encoder's GELU, exp and softmax against float64 references, and the trace bound."""

from __future__ import annotations

import math

import mlxcel.models  # noqa: F401  isort: skip  (OpenBLAS before mlx)

import numpy as np
import pytest

from mlxcel.models import fast_math
from mlxcel.models.mlx_setup import mx


def _exact_gelu(x: np.ndarray) -> np.ndarray:
    return np.array([0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x.tolist()])


def test_gelu_matches_erf_gelu() -> None:
    x = np.concatenate(
        [np.linspace(-12, 12, 48_001), [0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 1e4, -1e4]]
    ).astype(np.float32)
    got = np.array(fast_math.gelu(mx.array(x)), dtype=np.float64)
    want = _exact_gelu(x.astype(np.float64))
    err = np.abs(got - want)
    assert err.max() <= 1.2e-6 * np.maximum(1.0, np.abs(want)).max()
    assert np.all(err <= 1.2e-6 * np.maximum(1.0, np.abs(want)))
    assert got[-2] == pytest.approx(1e4) and got[-1] == 0.0


def test_gelu_keeps_shape_across_many_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Past the trace limit a fresh compiled function takes over; values stay right.
    monkeypatch.setattr(fast_math, "TRACE_LIMIT", 3)
    rng = np.random.default_rng(0)
    for rows in range(1, 9):
        x = rng.normal(scale=3.0, size=(rows, 5)).astype(np.float32)
        got = np.array(fast_math.gelu(mx.array(x)))
        assert got.shape == x.shape
        want = _exact_gelu(x.reshape(-1).astype(np.float64)).reshape(x.shape)
        assert np.abs(got - want).max() < 2e-6
    assert len(fast_math._gelu._shapes) <= 3


def test_exp_is_accurate_where_a_softmax_needs_it() -> None:
    x = np.linspace(-80, 0, 160_001).astype(np.float32)
    got = np.array(fast_math.exp_nonpositive(mx.array(x)), dtype=np.float64)
    want = np.exp(x.astype(np.float64))
    assert (np.abs(got - want) / want).max() < 2.5e-7
    assert got[-1] == 1.0
    below = np.array(fast_math.exp_nonpositive(mx.array([-100.0, -1e9, -np.inf])))
    assert np.all(below >= 0) and np.all(below < 1e-34)


def test_softmax_and_attention_match_mlx() -> None:
    rng = np.random.default_rng(1)
    b, h, n, d = 3, 4, 9, 8
    q, k, v = (mx.array(rng.normal(size=(b, h, n, d)).astype(np.float32)) for _ in range(3))
    keep = np.ones((b, n), dtype=bool)
    keep[1, 5:] = False  # a padded row: its keys must get no weight
    mask = mx.array(np.where(keep, 0.0, -1e9)[:, None, None, :].astype(np.float32))
    scores = np.array(rng.normal(scale=8.0, size=(5, 17)).astype(np.float32))
    got = np.array(fast_math.softmax(mx.array(scores)), dtype=np.float64)
    s64 = scores.astype(np.float64)
    want = np.exp(s64 - s64.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    assert np.abs(got - want).max() < 1e-6
    ours = fast_math.attention(q, k, v, scale=d**-0.5, mask=mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask)
    assert np.abs(np.array(ours) - np.array(theirs)).max() < 1e-5
    # The padded keys of row 1 change nothing: attention over its first 5 keys alone.
    alone = fast_math.attention(q[1:2], k[1:2, :, :5], v[1:2, :, :5], scale=d**-0.5, mask=None)
    assert np.abs(np.array(alone) - np.array(ours[1:2])).max() < 1e-6


def test_uncompiled_fallback_gives_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_toolchain(fn: object, *args: object, **kwargs: object) -> object:
        raise RuntimeError("no C++ compiler")

    x = mx.array(np.linspace(-6, 6, 1001).astype(np.float32))
    compiled = np.array(fast_math.gelu(x))
    monkeypatch.setattr(mx, "compile", no_toolchain)
    shaped = fast_math._PerShape(fast_math._gelu_graph)
    assert np.abs(np.array(shaped(x)) - compiled).max() < 1e-6

"""The one-copy ``BatchKVCache.extend`` holds exactly what mlx-lm's own gives, for a joining
row longer or shorter than the batch, and with either buffer the larger."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxcel.models import mlx_lm_compat

H, D = 2, 4


def _batch(lengths: list[int], extra: int, seed: int) -> BatchKVCache:
    """A batch of rows holding ``lengths`` tokens, then ``extra`` decoded tokens each."""
    mx.random.seed(seed)
    rows = []
    for n in lengths:
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
        rows.append(c)
    batch = BatchKVCache.merge(rows)
    for _ in range(extra):
        b = len(lengths)
        batch.update_and_fetch(mx.random.normal((b, H, 1, D)), mx.random.normal((b, H, 1, D)))
    return batch


def _valid(cache: BatchKVCache) -> list[tuple[list[float], list[float]]]:
    pads = cache.left_padding.tolist()
    return [
        (cache.keys[i, :, p : cache._idx].tolist(), cache.values[i, :, p : cache._idx].tolist())
        for i, p in enumerate(pads)
    ]


@pytest.mark.parametrize(
    ("running", "joining"),
    [
        (([30, 20, 25], 3), ([40], 1)),  # the newcomer is longer: the batch is padded
        (([30, 20, 25], 300), ([40], 1)),  # the batch's buffer is the larger
        (([30, 20], 3), ([12], 1)),  # the newcomer is shorter: mlx-lm's own path
        (([5], 0), ([600, 3], 2)),  # two newcomers, far longer, larger buffer
    ],
)
def test_extend_matches_mlx_lm(
    running: tuple[list[int], int], joining: tuple[list[int], int]
) -> None:
    expected, got = _batch(*running, seed=1), _batch(*running, seed=1)
    other_a, other_b = _batch(*joining, seed=2), _batch(*joining, seed=2)
    mlx_lm_compat._ORIGINAL_EXTEND(expected, other_a)
    mlx_lm_compat._extend(got, other_b)
    assert got._idx == expected._idx
    assert got.left_padding.tolist() == expected.left_padding.tolist()
    assert got.offset.tolist() == expected.offset.tolist()
    assert got.keys.shape[2] >= got._idx
    assert _valid(got) == _valid(expected)
    # And the next decoded token lands in the same place for every row.
    b = got.keys.shape[0]
    k, v = mx.ones((b, H, 1, D)), mx.ones((b, H, 1, D))
    expected.update_and_fetch(k, v)
    got.update_and_fetch(k, v)
    assert _valid(got) == _valid(expected)

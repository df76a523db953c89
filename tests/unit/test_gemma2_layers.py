"""Gemma 2's sliding window: on the even layers only, exact at its edge, and the same in a
left-padded batch as alone.

``test_gguf_oracle.py`` checks ``gemma2-window`` (a window of 8 tokens, a 22-token prompt)
against llama-server: without the window it is off by 23 in log-probability, with the window
one token off by 2. These pin the mechanism on the same tiny file.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxcel.models.gemma2_layers import sliding_layers
from mlxcel.models.mlx_setup import mx

WINDOW = 8  # tests/support/tiny_gguf.py's gemma2-window


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model
    from tests.support.tiny_gguf import write_tiny_gguf

    work = tmp_path_factory.mktemp("gemma2-window")
    gguf = write_tiny_gguf("gemma2-window", work / "gemma2-window.gguf")
    return load_model(resolve_model(str(gguf), work / "cache")).model


def test_even_layers_slide() -> None:
    assert sliding_layers(5) == [0, 2, 4]  # llama.cpp's set_swa_pattern(2), HF's layer_idx % 2


def test_a_sliding_layer_sees_exactly_the_last_window_tokens(gemma2: Any) -> None:
    """Changing the hidden state WINDOW positions back leaves a sliding layer's last output
    alone and moves it one position nearer; the global layer sees every position."""
    from mlx_lm.models.cache import KVCache

    n = 3 * WINDOW
    h = mx.random.normal((1, n, 64), key=mx.random.key(0))

    def last(layer: Any, changed_at: int | None) -> mx.array:
        x = h
        if changed_at is not None:
            x = h.at[:, changed_at].add(5.0)
        mask = mx.tril(mx.ones((n, n), dtype=mx.bool_))  # what the model hands every layer
        return layer(x, mask, KVCache())[0, -1]

    sliding, full = gemma2.layers[0], gemma2.layers[1]
    assert sliding.sliding_window == WINDOW
    assert full.sliding_window is None
    base = last(sliding, None)
    assert mx.array_equal(last(sliding, n - 1 - WINDOW), base)
    assert not mx.allclose(last(sliding, n - WINDOW), base)
    assert not mx.allclose(last(full, 0), last(full, None))


def _alone(model: Any, tokens: list[int], then: int) -> tuple[mx.array, mx.array]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    first = model(mx.array([tokens]), cache=cache)[0, -1]
    return first, model(mx.array([[then]]), cache=cache)[0, -1]


def test_a_padded_batch_row_matches_the_row_alone(gemma2: Any) -> None:
    """Two prompts past the window, left-padded into one batch cache, then one decode step:
    each row's logits as when it runs alone (the window counts from the row's own tokens)."""
    from mlx_lm.models.cache import BatchKVCache

    rows = [list(range(300, 300 + 3 * WINDOW)), list(range(500, 500 + 2 * WINDOW + 3))]
    then = [42, 43]
    width = max(len(r) for r in rows)
    pads = [width - len(r) for r in rows]
    cache = [BatchKVCache(pads) for _ in gemma2.layers]
    batch = mx.array([[0] * p + r for p, r in zip(pads, rows, strict=True)])
    first = gemma2(batch, cache=cache)[:, -1]
    second = gemma2(mx.array([[t] for t in then]), cache=cache)[:, -1]
    for i, row in enumerate(rows):
        want_first, want_second = _alone(gemma2, row, then[i])
        assert mx.allclose(first[i], want_first, atol=1e-4), f"row {i}, prefill"
        assert mx.allclose(second[i], want_second, atol=1e-4), f"row {i}, decode"

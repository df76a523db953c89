"""The encoder's GELU, exp and softmax against float64 references, and the trace bound."""

from __future__ import annotations

import math
from pathlib import Path

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
    assert len(fast_math._gelu._local.shapes) <= 3


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


def test_silu_mul_matches_mlx() -> None:
    rng = np.random.default_rng(2)
    gate = np.concatenate([rng.normal(scale=6.0, size=4000), [0.0, 90.0, -90.0, 1e4, -1e4]])
    x = rng.normal(size=gate.size)
    got = np.array(fast_math.silu_mul(mx.array(gate, mx.float32), mx.array(x, mx.float32)))
    with np.errstate(over="ignore"):  # exp(1e4) is inf: silu(-1e4) is -0, as wanted
        want = gate / (1.0 + np.exp(-gate)) * x
    assert np.all(np.abs(got - want) <= 5e-7 * np.maximum(1.0, np.abs(want)))


@pytest.mark.parametrize(
    ("b", "heads", "kv_heads", "q_len", "kv_len"),
    [
        (2, 9, 3, 1, 20),
        (2, 9, 3, 7, 20),
        (1, 4, 4, 5, 5),
        (3, 6, 2, 4, 11),
        (3, 6, 2, 2, 130),
        (2, 9, 3, 1, 200),
    ],
)
def test_lm_attention_matches_mlx_sdpa(
    b: int, heads: int, kv_heads: int, q_len: int, kv_len: int
) -> None:
    # Grouped-query heads, decode (q_len 1) and prefill, and every mask form mlx-lm passes;
    # few query rows per KV head on 128 keys or more take the transposed products.
    rng = np.random.default_rng(3)
    d = 8

    def arr(*shape: int) -> mx.array:
        return mx.array(rng.normal(size=shape).astype(np.float32))

    q, k, v = arr(b, heads, q_len, d), arr(b, kv_heads, kv_len, d), arr(b, kv_heads, kv_len, d)
    pos = mx.arange(kv_len)
    causal = mx.arange(kv_len - q_len, kv_len)[:, None] >= pos[None]
    left_pad = mx.array([0, 3, kv_len // 2][:b])[:, None, None, None]
    masks: dict[str, object] = {
        "none": None,
        "causal": "causal",
        "left padding": (pos[None, None, None, :] >= left_pad) & causal,
        "additive": arr(q_len, kv_len),
        "per head": mx.array(rng.random(size=(b, heads, q_len, kv_len)) > 0.3)
        | (pos[None, None, None, :] == 0),
    }
    for name, mask in masks.items():
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask)
        got = fast_math.attention(q, k, v, scale=d**-0.5, mask=mask)  # type: ignore[arg-type]
        assert got.shape == want.shape, name
        assert np.abs(np.array(got) - np.array(want)).max() < 2e-6, name


def test_the_loaded_chat_model_uses_them_and_gives_the_same_logits(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    # The real default model (SmolLM2, llama): a prefill of three prompts then decode steps
    # on a KV cache (three rows), once through fast_lm and once through mlx-lm's own functions.
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel import native
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    # Float32 matmuls: int8 activations would round each layer's input, turning the two
    # functions' last-bit differences into differences of the rounding's size.
    native.set_int8_activations("off")
    request.addfinalizer(native.set_int8_activations)  # back to the default
    model = load_model(resolve_model(str(default_model_dir))).model
    assert hasattr(llama.scaled_dot_product_attention, "__wrapped__")
    assert hasattr(llama.swiglu, "__wrapped__")

    def run() -> np.ndarray:
        cache = make_prompt_cache(model)
        words = [1, 504, 3458, 282, 4162, 314, 253, 1928, 30, 2, 198]
        prompt = mx.array([words * 3, words[::-1] * 3, words[3:] + words * 2 + words[:3]])
        logits = [model(prompt, cache=cache)[:, -1]]
        for _ in range(4):
            token = mx.argmax(logits[-1], axis=-1)[:, None]
            logits.append(model(token, cache=cache)[:, -1])
        return np.array(mx.stack(logits))

    ours = run()
    monkeypatch.setattr(
        llama, "scaled_dot_product_attention", llama.scaled_dot_product_attention.__wrapped__
    )
    monkeypatch.setattr(llama, "swiglu", llama.swiglu.__wrapped__)
    theirs = run()
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))
    assert np.abs(ours - theirs).max() < 1e-5 * np.abs(theirs).max()


def test_layer_norm_matches_mlx() -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 7, 384)).astype(np.float32)
    x[1] += 1000.0  # a large mean: float32 inputs there are only good to ~6e-5 themselves
    w = rng.normal(size=384).astype(np.float32)
    b = rng.normal(size=384).astype(np.float32)
    got = fast_math.layer_norm(mx.array(x), mx.array(w), mx.array(b), 1e-12)
    x64 = x.astype(np.float64)
    centred = x64 - x64.mean(-1, keepdims=True)
    want = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-12) * w + b
    err = np.abs(np.array(got) - want).max(axis=(1, 2))
    theirs = np.array(mx.fast.layer_norm(mx.array(x), mx.array(w), mx.array(b), 1e-12))
    their_err = np.abs(theirs - want).max(axis=(1, 2))
    assert err[0] < 2e-6 and err[2] < 2e-6
    assert np.all(err <= their_err)  # measured: 9e-7 / 3.7e-4 / 9e-7 vs mlx 2e-6 / 1.5e-3 / 2e-6

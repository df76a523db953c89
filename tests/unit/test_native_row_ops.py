"""The native RMSNorm, RoPE and decode-attention nodes (mlxcel/native/src/row_ops.h) against
mlx's own ``mx.fast`` ops, and where the loader puts them.

Tolerances: both sides compute the same float32 formulas; sums are grouped differently
(RMSNorm's mean, attention's dot products and softmax sum) and cos/sin/exp come from different
implementations, so results agree to a few float32 ulps of the values' magnitude, never more:
a wrong position, frequency, head or mask entry moves them by O(1).
"""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.models.mlx_setup import mx
from mlxcel.native import attention, available, reason, rms_norm, rope, silu_mul

needs_ext = pytest.mark.skipif(not available(), reason=f"native kernels unavailable: {reason()}")


def _close(a: mx.array, b: mx.array, tol: float) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    scale = max(1.0, float(mx.abs(b).max()))
    diff = float(mx.abs(a - b).max())
    assert diff <= tol * scale, f"max |diff| {diff} > {tol} x {scale}"


@needs_ext
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 7, 576), (2, 5, 4096), (4, 33)])
def test_rms_norm(shape: tuple[int, ...]) -> None:
    mx.random.seed(0)
    x = mx.random.normal(shape) * 3
    w = mx.random.normal((shape[-1],))
    _close(rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5), 2e-6)


@needs_ext
def test_rms_norm_strided_and_rows_alike() -> None:
    mx.random.seed(1)
    x = mx.random.normal((6, 4, 64)).transpose(1, 0, 2)  # rows not adjacent in memory
    w = mx.random.normal((64,))
    out = rms_norm(x, w, 1e-6)
    _close(out, mx.fast.rms_norm(x, w, 1e-6), 2e-6)
    # A row's result is the same bits alone as among others.
    assert mx.array_equal(rms_norm(x[2:3, 1:2], w, 1e-6), out[2:3, 1:2]).item()


@needs_ext
@pytest.mark.parametrize(
    ("shape", "dims", "traditional"),
    [
        ((1, 9, 1, 64), 64, False),
        ((2, 4, 7, 128), 128, False),
        ((1, 4, 5, 64), 32, True),
        ((2, 3, 6, 96), 64, False),
        ((3, 2, 4), 4, False),
    ],
)
@pytest.mark.parametrize("offset", [0, 37, 2000, "per-row"])
@pytest.mark.parametrize("with_freqs", [False, True])
def test_rope(
    shape: tuple[int, ...], dims: int, traditional: bool, offset: object, with_freqs: bool
) -> None:
    mx.random.seed(2)
    x = mx.random.normal(shape)
    off = mx.array([3 + 11 * i for i in range(shape[0])]) if offset == "per-row" else offset
    freqs = mx.random.uniform(1.0, 1e4, (dims // 2,)) if with_freqs else None
    base = None if with_freqs else 10000.0
    kw = {"traditional": traditional, "base": base, "scale": 0.5, "offset": off, "freqs": freqs}
    # An angle is position x inverse frequency in float32: one ulp of an inverse frequency
    # (mlx's exp and libm's differ by that) moves an angle by ~position x 6e-8 radians.
    last = (int(off.max().item()) if isinstance(off, mx.array) else int(off)) + shape[-2]  # type: ignore[call-overload]
    tol = max(4e-6, last * 0.5 * 2.4e-7)
    _close(rope(x, dims, **kw), mx.fast.rope(x, dims, **kw), tol)  # type: ignore[arg-type]


@needs_ext
def test_rope_reads_a_transposed_view() -> None:
    # Attention hands RoPE [B, L, H, D] transposed to [B, H, L, D]: read in place.
    mx.random.seed(3)
    x = mx.random.normal((2, 5, 8, 64)).transpose(0, 2, 1, 3)
    kw = {"traditional": False, "base": 1e6, "scale": 1.0, "offset": mx.array([4, 9])}
    _close(rope(x, 64, **kw), mx.fast.rope(x, 64, **kw), 4e-6)  # type: ignore[arg-type]


@needs_ext
@pytest.mark.parametrize("shape", [(1, 1, 1536), (1, 300, 8192), (3, 7, 33)])
def test_silu_mul(shape: tuple[int, ...], native_isa: str) -> None:
    import mlx.nn as nn

    mx.random.seed(7)
    gate = mx.random.normal(shape) * 6
    x = mx.random.normal(shape)
    out = silu_mul(gate, x)
    assert out is not None
    _close(out, nn.silu(gate) * x, 4e-7)
    # Far tails: no overflow, no NaN.
    tails = mx.array([[-200.0, -90.0, -1e-8, 0.0, 1e-8, 30.0, 100.0, 1e30]])
    out = silu_mul(tails, mx.ones_like(tails))
    assert out is not None
    _close(out, nn.silu(tails), 1e-6)
    assert silu_mul(gate, x[..., :1]) is None  # shapes differ: the caller's own path


def _sdpa(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
    scale = q.shape[-1] ** -0.5
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@needs_ext
@pytest.mark.parametrize(
    ("b", "h", "kv", "s", "d"),
    [
        (1, 9, 3, 40, 64),
        (3, 32, 8, 300, 64),
        (2, 16, 2, 17, 128),
        (1, 4, 4, 1, 80),
        (2, 8, 8, 700, 64),
        (1, 4, 2, 50, 192),  # wider than the 8 registers the value sum is held in
    ],
)
def test_attention(b: int, h: int, kv: int, s: int, d: int, native_isa: str) -> None:
    mx.random.seed(4)
    q = mx.random.normal((b, h, 1, d))
    # Keys and values as a KV cache holds them: a slice of a longer buffer.
    k = mx.random.normal((b, kv, s + 16, d))[:, :, :s]
    v = mx.random.normal((b, kv, s + 16, d))[:, :, :s]
    scale = d**-0.5
    out = attention(q, k, v, scale=scale, mask=None)
    assert out is not None
    _close(out, _sdpa(q, k, v, None), 2e-6)
    # Left padding, as a batch of rows of different lengths has it: bool and additive masks.
    pads = mx.array([(5 * i) % s for i in range(b)])
    keep = (mx.arange(s)[None, :] >= pads[:, None])[:, None, None, :]
    padded = attention(q, k, v, scale=scale, mask=keep)
    assert padded is not None
    _close(padded, _sdpa(q, k, v, keep), 2e-6)
    additive = mx.where(keep, 0.0, -float("inf")).astype(mx.float32)
    same = attention(q, k, v, scale=scale, mask=additive)
    assert same is not None and mx.array_equal(same, padded).item()
    # Each row gets exactly the bits it gets alone over its own keys (no padding).
    for i in range(b):
        p = int(pads[i].item())
        alone = attention(
            q[i : i + 1], k[i : i + 1, :, p:], v[i : i + 1, :, p:], scale=scale, mask=None
        )
        assert alone is not None and mx.array_equal(alone, padded[i : i + 1]).item()


@needs_ext
def test_decode_attention_additive_values_count(native_isa: str) -> None:
    mx.random.seed(5)
    q, k, v = (mx.random.normal(s) for s in ((2, 4, 1, 64), (2, 2, 30, 64), (2, 2, 30, 64)))
    bias = mx.random.normal((2, 1, 1, 30))
    out = attention(q, k, v, scale=0.125, mask=bias)
    assert out is not None
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=bias)
    _close(out, ref, 2e-6)


@needs_ext
@pytest.mark.parametrize(("lq", "s"), [(7, 7), (5, 40), (64, 64), (3, 300), (37, 700)])
def test_prompt_attention(lq: int, s: int, native_isa: str) -> None:
    """Several queries (a prompt chunk, a speculative check) with the causal mask, bottom-right
    aligned as mlx's, and with a left-padding mask beside it."""
    mx.random.seed(6)
    q = mx.random.normal((2, 8, lq, 64))
    k = mx.random.normal((2, 4, s, 64))
    v = mx.random.normal((2, 4, s, 64))
    out = attention(q, k, v, scale=0.125, mask="causal")
    assert out is not None
    _close(out, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"), 2e-6)
    # Causal and padding at once, as a batch's prompt mask is: an explicit bool array.
    pads = mx.array([0, 2])
    causal = mx.arange(s)[None, :] <= mx.arange(s - lq, s)[:, None]
    # The causal bound as a bool array (rows that keep every key it leaves) and as a flag
    # take different paths through the mask; the bits are the same.
    spelled = attention(q, k, v, scale=0.125, mask=mx.broadcast_to(causal, (2, 1, lq, s)))
    assert spelled is not None and mx.array_equal(spelled, out).item()
    keep = causal[None, None] & (mx.arange(s) >= pads[:, None])[:, None, None, :]
    out = attention(q, k, v, scale=0.125, mask=keep)
    assert out is not None
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=keep)
    # Queries that see no key at all (padding attending to padding: never read) are zeros
    # here and an average of every value in mlx's; the rest must agree.
    _close(out[:, :, 2:], ref[:, :, 2:], 2e-6)


@needs_ext
@pytest.mark.parametrize(("d", "s"), [(64, 40), (80, 40), (128, 40), (192, 40), (64, 300)])
def test_a_query_gets_the_same_bits_in_a_prompt_and_alone(d: int, s: int, native_isa: str) -> None:
    """Many query rows per KV head take the blocked path (keys transposed, 16 scored at once,
    rows sharing each block of keys and of values), a decode step's one row the one-key path:
    both group every sum alike, so a query's result is the same bits either way (a prompt's
    last row = the next decode step's), over one block of values or several."""
    mx.random.seed(8)
    lq = 12
    q = mx.random.normal((1, 4, lq, d))
    k = mx.random.normal((1, 2, s, d))
    v = mx.random.normal((1, 2, s, d))
    prompt = attention(q, k, v, scale=0.1, mask="causal")
    assert prompt is not None
    for i in range(lq):
        end = s - lq + i + 1
        one = attention(q[:, :, i : i + 1], k[:, :, :end], v[:, :, :end], scale=0.1, mask=None)
        assert one is not None
        assert mx.array_equal(one, prompt[:, :, i : i + 1]).item(), i


@needs_ext
@pytest.mark.parametrize(("h", "kv"), [(9, 3), (4, 2), (10, 2), (14, 2), (12, 4), (6, 1)])
@pytest.mark.parametrize("d", [64, 80, 128, 192])
def test_query_heads_sharing_a_kv_head_get_the_bits_they_get_one_at_a_time(
    h: int, kv: int, d: int, native_isa: str
) -> None:
    """Decode with grouped query heads reads each key and value once for all the heads that
    share them; a mask that differs between heads (here all keeps, so the same result) sends
    the kernel down the one-head-at-a-time path. Both must give the same bits."""
    mx.random.seed(9)
    b, s = 2, 300
    for lq in (1, 2):
        if (h // kv) * lq >= 8:
            continue  # the blocked path: covered above
        q = mx.random.normal((b, h, lq, d))
        k = mx.random.normal((b, kv, s + 8, d))[:, :, :s]
        v = mx.random.normal((b, kv, s + 8, d))[:, :, :s]
        pads = mx.array([0, 7])
        keep = (mx.arange(s)[None, :] >= pads[:, None])[:, None, None, :]
        per_head = mx.broadcast_to(keep, (b, h, 1, s))
        for mask, apart in (
            (None, mx.ones((b, h, 1, s), dtype=mx.bool_)),
            (keep, per_head),
            (mx.where(keep, 0.0, -float("inf")), mx.where(per_head, 0.0, -float("inf"))),
        ):
            together = attention(q, k, v, scale=d**-0.5, mask=mask)
            # A copy in memory: a mask that varies over heads, as far as the kernel can tell.
            one_by_one = attention(q, k, v, scale=d**-0.5, mask=mx.array(np.array(apart)))
            assert together is not None and one_by_one is not None
            assert mx.array_equal(together, one_by_one).item(), (lq, mask is None)
            _close(together, _sdpa(q, k, v, mask), 2e-6)


def test_attention_declines_what_it_does_not_do() -> None:
    q, k, v = (mx.zeros((1, 4, 2, 64)), mx.zeros((1, 4, 8, 64)), mx.zeros((1, 4, 8, 64)))
    assert attention(q, k, v, scale=1.0, mask="sliding") is None  # not a mask it knows
    half = [a.astype(mx.float16) for a in (q, k, v)]
    assert attention(*half, scale=1.0, mask=None) is None
    assert attention(k, q, q, scale=1.0, mask="causal") is None  # more queries than keys


@needs_ext
def test_loader_puts_the_row_ops_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model's 61 norms and 30 RoPEs become native nodes, its decode attention
    goes through the native node, and the logits stay float32's (see the greedy check in
    test_native_kernels); MLXCEL_NATIVE=0 leaves mlx's own ops."""
    import io
    import re

    from mlx_lm.models.cache import KVCache

    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model
    from mlxcel.native.layers import NativeRMSNorm, NativeRoPE

    loaded = load_model(resolve_model(None))
    kinds = [type(m) for _, m in loaded.model.named_modules()]
    assert kinds.count(NativeRMSNorm) == 61 and kinds.count(NativeRoPE) == 30
    cache = [KVCache() for _ in loaded.model.layers]
    mx.eval(loaded.model(mx.array([[5] * 12]), cache=cache))
    step = loaded.model(mx.array([[7]]), cache=cache)
    dot = io.StringIO()
    mx.export_to_dot(dot, step)
    nodes = re.findall(r'label ="?([A-Za-z_0-9]+)', dot.getvalue())
    assert nodes.count("MlxcelAttention") == 30
    assert nodes.count("MlxcelRope") == 60 and "Cos" not in nodes
    monkeypatch.setenv("MLXCEL_NATIVE", "0")
    plain = load_model(resolve_model(None))
    assert NativeRMSNorm not in {type(m) for _, m in plain.model.named_modules()}

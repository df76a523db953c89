"""Float32 GELU, exp / softmax, SiLU and LayerNorm for mlx's CPU backend, from ops it runs fast.

mlx's CPU ``exp`` / ``erf`` / ``tanh`` / ``sigmoid`` are scalar loops (~18 ns per element on
this machine) and its ``maximum`` / ``minimum`` / ``floor`` kernels do not vectorise, while a
chain of multiply-adds in one ``mx.compile`` kernel does (~0.1 ns per op). Whether a chain
stays one kernel depends on two things, both read from mlx 0.32's ``compile.cpp``:

- it is compiled *with shapes*. A shapeless compile passes every constant as an array and
  takes the strided, scalar path: 9-13 ns per element here instead of 2;
- it is at most 11 ops deep (``max_compile_depth``). A deeper chain is cut into several
  kernels, each one more pass over memory. Hence Estrin's scheme for the polynomials.

Measured on 442k float32 elements (one core): GELU 5.2 -> 2.1 ns per element, exp 17.8 ->
2.1, attention softmax of a [32, 12, 16, 16] batch 1.84 -> ~0.6 ms. LayerNorm takes its row
means in BLAS instead (mlx reduces rows on one thread). Each is checked against float64 or
mlx's own op in ``tests/unit/test_fast_math.py``, to float32 rounding level.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from mlxcel.models.mlx_setup import mx

__all__ = ["attention", "exp_nonpositive", "gelu", "layer_norm", "silu_mul", "softmax"]

# A shaped compile keeps one trace per input shape (and stream) until the compiled function is
# dropped; embedding batches come in many shapes, so after this many a fresh one starts.
TRACE_LIMIT = 256
_MAP_LOCK = threading.Lock()

# erf(z) = z * P(z^2) / Q(z^2) on |z| <= 4 (Eigen's float32 erf; erf is +-1 in float32
# beyond). P is pre-halved so GELU's 0.5 * (1 + erf) folds into one multiply-add.
_P = tuple(
    0.5 * c
    for c in (
        -2.72614225801306e-10,
        2.77068142495902e-08,
        -2.10102402082508e-06,
        -5.69250639462346e-05,
        -7.34990630326855e-04,
        -2.95459980854025e-03,
        -1.60960333262415e-02,
    )
)
_Q = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)
_SQRT_HALF = 0.7071067811865476

# exp(x) = 2^n * e^r with r = x - n ln2 in [-ln2/2, ln2/2] (Cody-Waite, ln2 split in two so
# n * LN2_HI is exact), e^r by Cephes' expf polynomial; 2^n is written into the exponent bits.
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_EXP_C = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)
# Below this e^x < 2e-35: far under float32's resolution next to a softmax row's maximum (1).
_EXP_FLOOR = -80.0
# A masked attention score: e^(-1e9 - max) is e^-80 after the floor, ~2e-35 of the row's top.
_MASKED = -1e9
# Query rows per KV head (grouped heads x query tokens) up to which attention multiplies with
# the KV cache as the left operand; see ``attention``.
FEW_QUERY_ROWS = 8
FEW_QUERY_MIN_KEYS = 128


def _gelu_graph(x: mx.array) -> mx.array:
    v = x * _SQRT_HALF
    z = mx.where(mx.abs(v) > 4.0, mx.sign(v) * 4.0, v)  # where vectorises; clip does not
    y = mx.square(z)
    y2 = y * y
    y4 = y2 * y2
    a0, a1, a2, a3, a4, a5, a6 = _P
    b0, b1, b2, b3, b4 = _Q
    p = ((a6 + a5 * y) + y2 * (a4 + a3 * y)) + y4 * ((a2 + a1 * y) + y2 * a0)
    q = ((b4 + b3 * y) + y2 * (b2 + b1 * y)) + y4 * b0
    return x * (0.5 + z * p / q)


def _exp_graph(x: mx.array) -> mx.array:
    x = mx.where(x < _EXP_FLOOR, _EXP_FLOOR, x)
    # x <= 0, so truncation toward zero is floor here (floor itself does not vectorise).
    neg_n = (0.5 - x * _LOG2E).astype(mx.int32)
    n = neg_n.astype(mx.float32)
    r = (x + n * _LN2_HI) + n * _LN2_LO
    r2 = r * r
    c0, c1, c2, c3, c4, c5 = _EXP_C
    # Estrin, not Horner: shallow enough to stay one kernel (3 vs 9 ns per element on a
    # 9 MB prefill score matrix, where every extra kernel is a pass through memory).
    p = ((c5 + c4 * r) + r2 * (c3 + c2 * r)) + (r2 * r2) * (c1 + c0 * r)
    return (p * r2 + (r + 1.0)) * mx.view(mx.left_shift(127 - neg_n, 23), mx.float32)


class _PerShape:
    """``mx.compile`` with shapes, one compiled function per thread, traces bounded.

    mlx keeps every compiled function's traces (one per input shape and stream) in one
    process-wide map that it does not lock. So each thread (the model runner, the embedder)
    gets its own compiled function, calls into them hold ``_MAP_LOCK`` (a call only traces or
    looks up, so the lock is held for microseconds; the kernels run later, in ``mx.eval``),
    and after ``TRACE_LIMIT`` shapes a fresh function replaces a thread's old one (dropping
    it frees its traces). Falls back to the plain graph (same values, slower) where mlx cannot
    build compiled CPU kernels (no C++ compiler on the machine); the first call probes.
    """

    def __init__(self, fn: Callable[..., mx.array]) -> None:
        self._fn = fn
        self._local = threading.local()
        self._usable: bool | None = None

    def __call__(self, *args: mx.array) -> mx.array:
        if self._usable is None:
            self._usable = self._probe(len(args))
        if not self._usable:
            return self._fn(*args)
        local = self._local
        shapes = tuple(tuple(a.shape) for a in args)
        seen: set[Any] | None = getattr(local, "shapes", None)
        with _MAP_LOCK:
            if seen is None or (shapes not in seen and len(seen) >= TRACE_LIMIT):
                local.compiled = None  # drop (and erase) the old traces under the lock
                local.compiled = mx.compile(self._fn)
                local.shapes = seen = set()
            seen.add(shapes)
            return local.compiled(*args)  # type: ignore[no-any-return]  # a threading.local slot

    def _probe(self, arity: int) -> bool:
        try:
            with _MAP_LOCK:
                probe = mx.compile(self._fn)(*[mx.zeros((2, 2)) for _ in range(arity)])
            mx.eval(probe)
        except Exception:  # noqa: BLE001 - no toolchain for compiled kernels: stay correct
            return False
        return True


def _neg_abs_exp_graph(gate: mx.array) -> mx.array:
    return _exp_graph(-mx.abs(gate))  # e^-|g|: sigmoid without overflow on either side


def _silu_mul_tail_graph(gate: mx.array, x: mx.array, e: mx.array) -> mx.array:
    # sigmoid(g) = (1 or e) / (1 + e) for g >= 0 or < 0; the numerator as e + (1 - e) * [g >=
    # 0] (exact both ways) because a ``where`` with a constant branch runs ~8 ns per element.
    return gate * x * ((e + (1.0 - e) * (gate >= 0)) / (1.0 + e))


_gelu = _PerShape(_gelu_graph)
_exp = _PerShape(_exp_graph)
# Two kernels: as one chain, mlx cuts it at its depth limit into slower pieces (a [512, 1536]
# SwiGLU: 8.8 ms as one, 3.2 ms as these two).
_neg_abs_exp = _PerShape(_neg_abs_exp_graph)
_silu_mul_tail = _PerShape(_silu_mul_tail_graph)


def gelu(x: mx.array) -> mx.array:
    """Exact (erf) GELU in float32, to within 1.1e-6 absolute."""
    return _gelu(x)


def exp_nonpositive(x: mx.array) -> mx.array:
    """``e^x`` for ``x <= 0`` (a softmax after its maximum is subtracted), to ~1e-7 relative.

    Values below -80 give ~2e-35 rather than their exact (smaller) exponential.
    """
    return _exp(x)


def silu_mul(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x`` (SwiGLU), to ~2e-7 relative."""
    return _silu_mul_tail(gate, x, _neg_abs_exp(gate))


def layer_norm(x: mx.array, weight: mx.array, bias: mx.array, eps: float) -> mx.array:
    """LayerNorm over the last axis, its two row means taken by matrix products.

    mlx's CPU ``fast.layer_norm`` reduces each row on one thread (~3.2 ns per element here);
    a product with a column of 1/n runs in BLAS, and the rest are vectorised binary ops: 0.71
    -> 0.50 ms for a [32, 16, 384] residual add + LayerNorm. Two passes (mean, then the mean
    of squared deviations), so rows with a large mean lose nothing.
    """
    n = x.shape[-1]
    column = mx.full((n, 1), 1.0 / n, dtype=x.dtype)
    centred = x - x @ column
    variance = mx.square(centred) @ column
    return centred * mx.rsqrt(variance + eps) * weight + bias


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    e = exp_nonpositive(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None,
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` (same arguments, same result) on the CPU.

    ``queries`` is ``[batch, heads, q_len, dim]``, ``keys`` / ``values`` are ``[batch,
    kv_heads, kv_len, dim]``; ``mask`` is ``"causal"`` (aligned bottom-right, as mlx's),
    a boolean array (True keeps) or an additive one, broadcastable to ``[batch, heads, q_len,
    kv_len]``. mlx has no fused CPU attention kernel: its own runs these same steps, with the
    scalar-exp softmax taking ~70 % of the time. Query heads that share a KV head (grouped-
    query attention) are folded into the rows of one matmul, so the KV cache is never copied
    per head.
    """
    b, h, n, d = queries.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    rep = h // kv_heads
    q = (queries * scale).reshape(b, kv_heads, rep * n, d)
    # With a few query rows (decode), BLAS streams the KV cache ~20 % faster as the big left
    # operand: scores^T = K q^T and out^T = V^T w^T (measured 8 rows x 930 keys, 30 layers:
    # 106 -> 91 ms; a whole decode step 268 -> 253 ms). The softmax still runs on contiguous
    # rows. Short key lists (BERT's sentences) gain nothing and keep the plain form.
    few = rep * n <= FEW_QUERY_ROWS and kv_len >= FEW_QUERY_MIN_KEYS
    if few:
        scores = mx.contiguous((keys @ q.swapaxes(-1, -2)).swapaxes(-1, -2))
    else:
        scores = q @ keys.swapaxes(-1, -2)
    scores = scores.reshape(b, kv_heads, rep, n, kv_len)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        mask = mx.arange(kv_len - n, kv_len)[:, None] >= mx.arange(kv_len)[None]
    if mask is not None:
        m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        if m.shape[1] == 1:
            m = mx.expand_dims(m, 2)
        else:  # one mask per query head: split heads as the scores are
            m = m.reshape(m.shape[0], kv_heads, rep, m.shape[2], m.shape[3])
        if m.dtype == mx.bool_:
            # An additive mask built at the mask's shape (one [q, k] plane, or one row per
            # sequence), not a ``where`` with a constant branch over all the scores (slow in
            # mlx). What masking costs a layer: 22 new tokens on 922 keys 0.33 -> 0.19 ms; a
            # 512-token prefill 3.3 -> 2.9 ms.
            m = mx.where(m, 0.0, _MASKED)
        scores = scores + m.astype(scores.dtype)
    weights = softmax(scores, axis=-1).reshape(b, kv_heads, rep * n, kv_len)
    if few:
        out = (values.swapaxes(-1, -2) @ weights.swapaxes(-1, -2)).swapaxes(-1, -2)
    else:
        out = weights @ values
    return out.reshape(b, h, n, values.shape[-1])

"""mlx-lm's attention and SwiGLU, run through ``fast_math`` when the model runs on the CPU.

On the CPU, ``mx.fast.scaled_dot_product_attention`` is not a fused kernel: it multiplies,
takes a softmax with mlx's scalar ``exp`` (~18 ns per element here) and multiplies again, and
the softmax dominates once the context grows (a 1,000-token prompt: ~70 % of the attention
time). mlx-lm's ``swiglu`` uses the scalar ``sigmoid``. ``install`` swaps both names in the
modules the loaded model uses for versions built on ``fast_math``; they fall back to mlx-lm's
own functions for what they do not cover (a quantised KV cache, attention sinks, a GPU).

Grouped-query attention folds the query heads that share a KV head into the rows of one
matmul, so the KV cache is never copied per head. ``MLXCEL_FAST_MATH=0`` turns it all off
(for comparisons).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from mlxcel.models import fast_math
from mlxcel.models.mlx_setup import mx

__all__ = ["attention", "enabled", "install"]

# A masked score: e^(-1e9 - max) is e^-80 after fast_math's floor, ~2e-35 of the row's top.
_MASKED = -1e9
# Below this many scores mlx's one SDPA op beats our seven (op overhead over scalar exp):
# measured one decode row, 9 heads, 60 keys: 107 vs 174 us; at 300 keys: 251 vs 207 us.
SMALL_SCORES = 2048


def enabled() -> bool:
    return os.environ.get("MLXCEL_FAST_MATH", "1") != "0" and mx.default_device() == mx.cpu


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
    kv_len]``.
    """
    b, h, n, d = queries.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    rep = h // kv_heads
    q = (queries * scale).reshape(b, kv_heads, rep * n, d)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(b, kv_heads, rep, n, kv_len)
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
            scores = mx.where(m, scores, _MASKED)
        else:
            scores = scores + m.astype(scores.dtype)
    weights = fast_math.softmax(scores, axis=-1).reshape(b, kv_heads, rep * n, kv_len)
    return (weights @ values).reshape(b, h, n, values.shape[-1])


def _lm_attention(original: Any) -> Any:
    def scaled_dot_product_attention(
        queries: mx.array,
        keys: Any,
        values: Any,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> mx.array:
        b, h, n, _ = queries.shape
        if (
            sinks is not None
            or hasattr(cache, "bits")
            or queries.dtype != mx.float32
            or b * h * n * keys.shape[-2] < SMALL_SCORES
        ):
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return attention(queries, keys, values, scale=scale, mask=mask)

    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def _lm_swiglu(original: Any) -> Any:
    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if gate.dtype != mx.float32 or x.dtype != mx.float32:
            return original(gate, x)
        return fast_math.silu_mul(gate, x)

    swiglu.__wrapped__ = original  # type: ignore[attr-defined]
    return swiglu


def install(model: Any) -> list[str]:
    """Swap the attention and SwiGLU of ``model``'s mlx-lm modules; returns what was swapped.

    Touches only modules under ``mlx_lm.models`` that the model's classes come from, and only
    names that still hold mlx-lm's own functions, so installing twice is harmless.
    """
    if not enabled():
        return []
    from mlx_lm.models import activations, base

    wraps = {
        "scaled_dot_product_attention": (base.scaled_dot_product_attention, _lm_attention),
        "swiglu": (activations.swiglu, _lm_swiglu),
    }
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    swapped = []
    for name in sorted(names):
        module = sys.modules.get(name)
        if module is None or not name.startswith("mlx_lm.models."):
            continue
        for attr, (original, wrap) in wraps.items():
            if getattr(module, attr, None) is original:
                setattr(module, attr, wrap(original))
                swapped.append(f"{name}.{attr}")
    return swapped

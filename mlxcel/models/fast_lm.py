"""mlx-lm's attention and SwiGLU, run through ``fast_math`` when the model runs on the CPU.

On the CPU, ``mx.fast.scaled_dot_product_attention`` is not a fused kernel: it multiplies,
takes a softmax with mlx's scalar ``exp`` (~18 ns per element here) and multiplies again, and
the softmax dominates once the context grows (a 1,000-token prompt: ~70 % of the attention
time). mlx-lm's ``swiglu`` uses the scalar ``sigmoid``. ``install`` swaps both names in the
modules the loaded model uses for versions built on ``fast_math`` (through
``mlx_lm_compat.swap_model_functions``, with every other reach into mlx-lm); they fall back to
mlx-lm's own functions for what they do not cover (a quantised KV cache, attention sinks, a GPU).

``MLXCEL_FAST_MATH=0`` turns it all off (for comparisons).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from mlxcel.models import fast_math
from mlxcel.models.mlx_setup import mx

__all__ = ["enabled", "install"]

# Below this many scores mlx's one SDPA op beats our seven (op overhead over scalar exp):
# measured one decode row, 9 heads, 60 keys: 107 vs 174 us; at 300 keys: 251 vs 207 us.
SMALL_SCORES = 2048


def enabled() -> bool:
    return os.environ.get("MLXCEL_FAST_MATH", "1") != "0" and mx.default_device() == mx.cpu


def _lm_attention(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
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
        return fast_math.attention(queries, keys, values, scale=scale, mask=mask)

    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps
    return scaled_dot_product_attention


def _lm_swiglu(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if gate.dtype != mx.float32 or x.dtype != mx.float32:
            return original(gate, x)
        return fast_math.silu_mul(gate, x)

    swiglu.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps
    return swiglu


def install(model: Any) -> list[str]:
    """Swap the attention and SwiGLU of ``model``'s mlx-lm modules; returns what was swapped.

    Touches only modules under ``mlx_lm.models`` that the model's classes come from, and only
    names that still hold mlx-lm's own functions, so installing twice is harmless.
    """
    if not enabled():
        return []
    from mlxcel.models import mlx_lm_compat

    return mlx_lm_compat.swap_model_functions(
        model, {"scaled_dot_product_attention": _lm_attention, "swiglu": _lm_swiglu}
    )

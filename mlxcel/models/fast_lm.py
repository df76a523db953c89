"""mlx-lm's attention and SwiGLU, run through ``fast_math`` (or, for attention, one native node)
when the model runs on the CPU.

On the CPU, ``mx.fast.scaled_dot_product_attention`` is not a fused kernel: it multiplies,
takes a softmax with mlx's scalar ``exp`` (~18 ns per element here) and multiplies again, and
the softmax dominates once the context grows (a 1,000-token prompt: ~70 % of the attention
time). mlx-lm's ``swiglu`` uses the scalar ``sigmoid``. ``install`` swaps both names in the
modules the loaded model uses for versions built on ``fast_math`` (through
``mlx_lm_compat.swap_model_functions``, with every other reach into mlx-lm); they fall back to
mlx-lm's own functions for what they do not cover (a quantised KV cache, attention sinks, a GPU).

Where the native kernels run (``mlxcel.native``), attention is one native node instead
(``native.attention``: one query row at a time, the keys a mask drops skipped), whatever the
query count; ``fast_math`` and mlx-lm's function remain for what it declines.

``MLXCEL_FAST_MATH=0`` turns the ``fast_math`` paths off (for comparisons), ``MLXCEL_NATIVE=0``
the native one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from mlxcel import native
from mlxcel.models import fast_math, mlx_lm_compat, ragged
from mlxcel.models.mlx_setup import mx

__all__ = ["enabled", "install"]

# Below this many scores mlx's one SDPA op beats our seven (op overhead over scalar exp):
# measured one decode row, 9 heads, 60 keys: 107 vs 174 us; at 300 keys: 251 vs 207 us.
SMALL_SCORES = 2048


# --batch-invariant (``set_batch_invariant``): see ``_per_row``.
_batch_invariant = False


def enabled() -> bool:
    return os.environ.get("MLXCEL_FAST_MATH", "1") != "0" and mx.default_device() == mx.cpu


def set_batch_invariant(on: bool) -> None:
    """Decode attention one row at a time over that row's own keys (``--batch-invariant``);
    call before ``install``."""
    global _batch_invariant
    _batch_invariant = on


def _per_row(
    pads: list[int],
    attend: Callable[..., mx.array],
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    sinks: Any,
) -> mx.array:
    """Each decode row attends to its own keys, without the batch's left padding.

    With padding, a row's scores are columns of a wider product and its softmax sum and
    weighted sum run over a longer, zero-led vector: the BLAS and mlx's reductions group
    those sums by position, so the row's result moves in its last bits with the padding that
    other rows' lengths give it. Sliced to its own keys, a row is computed exactly as it would
    be alone (the same shapes, the same kernels), whatever runs beside it. One attention per
    row costs ~8 more small ops per row and layer.
    """
    rows = [
        attend(
            queries[i : i + 1],
            keys[i : i + 1, :, p:],
            values[i : i + 1, :, p:],
            cache,
            scale=scale,
            mask=None,  # one query after every key it has: nothing to hide
            sinks=sinks,
        )
        for i, p in enumerate(pads)
    ]
    return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)


def _native_wanted() -> bool:
    """``MLXCEL_NATIVE=0`` turns the native nodes off; read per call (see _native_attention)."""
    return os.environ.get("MLXCEL_NATIVE", "1") != "0"


def _native_attention(
    queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any
) -> mx.array | None:
    """Attention as one native node (``native.attention``: 2.5-6x mlx's fallback and
    ``fast_math.attention`` on prompts, one node instead of ~10 at a decode step), or None where
    it does not apply. Keys a row's mask drops (a padded batch's left padding) are skipped, so
    each row computes exactly what it would alone: batch-invariant by construction, with no
    per-row split.

    Decided per call, as the native matmuls are at load (``MLXCEL_NATIVE=0`` turns it off):
    the swapped function is shared by every model of an mlx-lm module in the process."""
    if sinks is not None or hasattr(cache, "bits"):
        return None
    if not _native_wanted():
        return None
    return native.attention(queries, keys, values, scale=scale, mask=mask)


def _lm_attention(original: Callable[..., mx.array], fast: bool = True) -> Callable[..., mx.array]:
    # Rows of very different lengths attend in groups (``ragged``); not under
    # --batch-invariant, whose rows each attend alone.
    grouped = fast
    on_native = native.available()

    def attend(
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
            not fast
            or sinks is not None
            or hasattr(cache, "bits")
            or queries.dtype != mx.float32
            or b * h * n * keys.shape[-2] < SMALL_SCORES
        ):
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return fast_math.attention(queries, keys, values, scale=scale, mask=mask)

    def scaled_dot_product_attention(
        queries: mx.array,
        keys: Any,
        values: Any,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> mx.array:
        if on_native:
            out = _native_attention(queries, keys, values, cache, scale, mask, sinks)
            if out is not None:
                return out
        # Decode steps of a padded batch cache.
        if _batch_invariant and queries.shape[2] == 1:
            pads = mlx_lm_compat.batch_left_padding(cache)
            if pads is not None:
                return _per_row(pads, attend, queries, keys, values, cache, scale, sinks)
        if (
            grouped
            and ragged.enabled
            and 1 < queries.shape[0]
            and queries.shape[2] <= ragged.MAX_QUERIES
        ):
            pads = mlx_lm_compat.batch_left_padding(cache)
            groups = None if pads is None else ragged.plan(pads, keys.shape[-2])
            if groups is not None:

                def one(q: mx.array, k: mx.array, v: mx.array, **kw: Any) -> mx.array:
                    return attend(q, k, v, cache, scale=scale, sinks=sinks, **kw)

                return ragged.attend_grouped(groups, one, queries, keys, values, mask)
        return attend(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps
    return scaled_dot_product_attention


def _lm_swiglu(original: Callable[..., mx.array], fast: bool = True) -> Callable[..., mx.array]:
    on_native = native.available()

    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if gate.dtype != mx.float32 or x.dtype != mx.float32:
            return original(gate, x)
        if on_native and _native_wanted():
            out = native.silu_mul(gate, x)  # one node, ~8x fast_math's on prompts
            if out is not None:
                return out
        return fast_math.silu_mul(gate, x) if fast else original(gate, x)

    swiglu.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps
    return swiglu


def install(model: Any) -> list[str]:
    """Swap the attention and SwiGLU of ``model``'s mlx-lm modules; returns what was swapped.

    Attention goes to the native node where the kernels run (``_native_attention``).
    Touches only modules under ``mlx_lm.models`` that the model's classes come from, and only
    names that still hold mlx-lm's own functions, so installing twice is harmless.
    """
    fast = enabled()
    if not fast and not _batch_invariant and not native.available():
        return []
    wraps: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
        "scaled_dot_product_attention": lambda original: _lm_attention(original, fast)
    }
    if fast or native.available():
        wraps["swiglu"] = lambda original: _lm_swiglu(original, fast)
    return mlx_lm_compat.swap_model_functions(model, wraps)

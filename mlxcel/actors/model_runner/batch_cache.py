"""mlx-lm's ``BatchKVCache.extend`` (a row joining the running batch), copying the batch once.

The batch's rows are right-aligned at the write position. When the joining row holds more
tokens than the batch (a long conversation joining shorter ones, a common case for
realtime turns), mlx-lm pads the whole batch on the left with ``mx.pad`` and then
concatenates it with the newcomer: every running row's cache is copied twice. Measured here,
8 rows x ~920 tokens on SmolLM2-135M: 0.32-0.45 s for such a join against 0.11 s when the
batch needs no padding. This version writes both parts once into one new buffer, and only
the positions that hold tokens. When the batch needs no padding, mlx-lm's concatenate (one
copy) is kept: it is faster than filling a fresh buffer.

``install`` swaps the method on the class, process-wide (every ``BatchKVCache`` is made by
mlx-lm's own ``merge``, so a subclass would never be used); it is idempotent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

_ORIGINAL_EXTEND: Callable[[Any, Any], None] = BatchKVCache.extend


def _extend(self: Any, other: Any) -> None:
    if self.keys is None or other.keys is None:
        _ORIGINAL_EXTEND(self, other)
        return
    end = max(self._idx, other._idx)
    size = max(self.keys.shape[2], other.keys.shape[2])
    if self._idx == end and self.keys.shape[2] == size:
        _ORIGINAL_EXTEND(self, other)
        return
    b1, heads, _, dk = self.keys.shape
    b2, dv = other.keys.shape[0], self.values.shape[3]
    keys = mx.zeros((b1 + b2, heads, size, dk), dtype=self.keys.dtype)
    values = mx.zeros((b1 + b2, heads, size, dv), dtype=self.values.dtype)
    left_padding, offsets = [], []
    for first, cache in ((0, self), (b1, other)):
        rows = slice(first, first + cache.keys.shape[0])
        # Right-aligned at `end`: tokens [0, _idx) of this cache go to [end - _idx, end).
        keys[rows, :, end - cache._idx : end] = cache.keys[..., : cache._idx, :]
        values[rows, :, end - cache._idx : end] = cache.values[..., : cache._idx, :]
        left_padding.append(cache.left_padding + (end - cache._idx))
        offsets.append(cache.offset)
    self.keys, self.values = keys, values
    self.left_padding = mx.concatenate(left_padding)
    self.offset = mx.concatenate(offsets)
    self._idx = end


def install() -> None:
    BatchKVCache.extend = _extend  # type: ignore[method-assign]  # the patch, on purpose

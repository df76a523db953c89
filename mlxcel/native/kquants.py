"""GGUF's K-quant blocks (Q4_K, Q6_K) dequantised with mlx ops: the embedding lookup of a few
rows, and the fallback where the native kernels do not run (``kquant_matmul``).

Each format decodes a block of 256 weights exactly as llama.cpp and gguf-py do, products of
float16 and integer scales formed in float32, so the weights are the file's exactly. (The
kernels' copy of the layouts: src/kquant_block.h.) A format is named as the loader's tensor
suffix and the native op name it: ``"q4_k"``, ``"q6_k"``.

- Q4_K (``block_q4_K``, 144 bytes): float16 ``d`` and ``dmin``, 12 bytes of packed 6-bit
  scales and mins (one pair per 32 weights), 128 bytes of nibbles; weight =
  ``d * sc * q - dmin * m``.
- Q6_K (``block_q6_K``, 210 bytes): ``ql[128]`` the low 4 bits, ``qh[64]`` the high 2,
  ``int8 scales[16]`` one per 16 weights, float16 ``d``; weight = ``d * scale * (code - 32)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

__all__ = ["BLOCK_WEIGHTS", "FORMATS", "Format", "dequantize", "inputs"]

BLOCK_WEIGHTS = 256


@dataclass(frozen=True)
class Format:
    """One K-quant block format: its name (``"q4_k"``), bytes per block of 256 weights, and
    its decoder (uint8 [n, block_bytes] -> float32 [n, 256])."""

    name: str
    block_bytes: int
    decode: Callable[[mx.array], mx.array]


def _q4_k(b: mx.array) -> mx.array:
    d = b[:, 0:2].view(mx.float16).astype(mx.float32)
    dmin = b[:, 2:4].view(mx.float16).astype(mx.float32)
    # The 12 scale bytes as gguf-py's Q4_K.get_scale_min unpacks them: bytes 0-3 the low 6 bits
    # of scales 0-3 (top 2 bits: scales 4-7's high bits), 4-7 the same for the mins, 8-11 the
    # low nibbles of scales 4-7 and high nibbles of mins 4-7.
    s = b[:, 4:16].reshape(-1, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = mx.concatenate([lo & 63, (hi & 15) | ((lo >> 2) & 48)], axis=-1)
    mn = mx.concatenate([mid & 63, (hi >> 4) | ((mid >> 2) & 48)], axis=-1)
    scale = (d * sc.astype(mx.float32))[:, :, None]
    offset = (dmin * mn.astype(mx.float32))[:, :, None]
    # Per 64 weights, its 32 bytes' low nibbles then their high nibbles.
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)
    q = mx.right_shift(qs, mx.array([0, 4], dtype=mx.uint8).reshape(2, 1)) & 15
    return (scale * q.reshape(-1, 8, 32).astype(mx.float32) - offset).reshape(-1, 256)


def _q6_k(b: mx.array) -> mx.array:
    # Per half of 128 weights: the low nibbles of its 64 ql bytes, then their high nibbles;
    # and the 2-bit fields of its 32 qh bytes, bits 0-1 of all 32 first, then 2-3, 4-5, 6-7.
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    low = mx.right_shift(ql, mx.array([0, 4], dtype=mx.uint8).reshape(2, 1)) & 15
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    high = mx.right_shift(qh, mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(4, 1)) & 3
    codes = (low.reshape(-1, 256) | (high.reshape(-1, 256) << 4)).astype(mx.int32) - 32
    scales = b[:, 192:208].view(mx.int8).astype(mx.float32)
    d = b[:, 208:210].view(mx.float16).astype(mx.float32)
    weights = (d * scales)[:, :, None] * codes.reshape(-1, 16, 16).astype(mx.float32)
    return weights.reshape(-1, 256)


FORMATS = {f.name: f for f in (Format("q4_k", 144, _q4_k), Format("q6_k", 210, _q6_k))}


def inputs(blocks: mx.array, fmt: str) -> int:
    """The number of weights a row of ``blocks`` (uint8 [..., n * block bytes]) holds."""
    return blocks.shape[-1] // FORMATS[fmt].block_bytes * BLOCK_WEIGHTS


def dequantize(blocks: mx.array, fmt: str) -> mx.array:
    """uint8 [..., n * block bytes] of format ``fmt`` -> float32 [..., n * 256]."""
    f = FORMATS[fmt]
    weights = f.decode(blocks.reshape(-1, f.block_bytes))
    return weights.reshape(*blocks.shape[:-1], inputs(blocks, fmt))

"""GGUF's Q6_K blocks dequantised with mlx ops: the embedding lookup of a few rows, the
many-rows matmul (dequantise once, then OpenBLAS) and the fallback where the native kernels do
not run.

The block (llama.cpp's ``block_q6_K``, 256 weights in ``BLOCK_BYTES``): ``ql[128]`` the low 4
bits, ``qh[64]`` the high 2, ``int8 scales[16]`` one per 16 weights, float16 ``d``; weight =
``d * scale * (code - 32)``, ``d * scale`` formed first in float32 as llama.cpp and gguf-py do,
so the weights are the file's exactly. (The kernels' copy of the layout: src/q6k_block.h.)
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["BLOCK_BYTES", "BLOCK_WEIGHTS", "dequantize", "inputs"]

BLOCK_WEIGHTS = 256
BLOCK_BYTES = 210


def inputs(blocks: mx.array) -> int:
    """The number of weights a row of ``blocks`` (uint8 [..., n * BLOCK_BYTES]) holds."""
    return blocks.shape[-1] // BLOCK_BYTES * BLOCK_WEIGHTS


def dequantize(blocks: mx.array) -> mx.array:
    """uint8 [..., n * BLOCK_BYTES] -> float32 [..., n * BLOCK_WEIGHTS]."""
    lead = blocks.shape[:-1]
    b = blocks.reshape(-1, BLOCK_BYTES)
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
    return weights.reshape(*lead, inputs(blocks))

"""Deterministic numpy quantisers for every GGUF block format mlxcel reads, for the tiny
quantised GGUFs of ``tiny_gguf.py``.

gguf-py quantises Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 (llama.cpp's reference code, ported); for the
K-quants and IQ4 it only dequantises. Here each of those gets a plain quantiser: per
sub-block an affine or symmetric scale from the block's range, the scales rounded to the
format's integer codes against a float16 super-block scale, then each weight's code picked
against the scale as the file will store it. Not llama.cpp's search for the best scales
(nor its importance weighting), but valid blocks in the exact byte layout, which is what the
oracle checks: llama.cpp and mlxcel decode the same bytes. ``quantise`` output decodes,
through ``gguf.quants.dequantize``, to what each quantiser meant (``tests/unit`` checks it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["quantise"]

QK_K = 256
# llama.cpp's IQ4_NL / IQ4_XS code book (ggml-common.h kvalues_iq4nl).
IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0 (an all-zero sub-block)."""
    out = np.zeros(np.broadcast(a, b).shape, np.float32)
    np.divide(a, b, out=out, where=b != 0)
    return out


def _half(x: np.ndarray) -> np.ndarray:
    """[n, 1] float32 -> the float16 field's bytes [n, 2]."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8)


def _affine(
    x: np.ndarray, levels: int, scale_max: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x [n, subs, size] ~ d * sc * q - dmin * m, codes q in 0..levels, sc and m in
    0..scale_max: (d, dmin as float16 [n, 1], sc, m [n, subs], q [n, subs, size])."""
    lo = np.minimum(x.min(-1), 0.0)
    s, m = (x.max(-1) - lo) / levels, -lo
    d = (s.max(-1, keepdims=True) / scale_max).astype(np.float16)
    dmin = (m.max(-1, keepdims=True) / scale_max).astype(np.float16)
    sc = np.clip(np.rint(_div(s, d.astype(np.float32))), 0, scale_max)
    mc = np.clip(np.rint(_div(m, dmin.astype(np.float32))), 0, scale_max)
    dl = (d.astype(np.float32) * sc)[..., None]
    ml = (dmin.astype(np.float32) * mc)[..., None]
    q = np.clip(np.rint(_div(x + ml, dl)), 0, levels)
    return d, dmin, sc.astype(np.uint8), mc.astype(np.uint8), q.astype(np.uint8)


def _symmetric(x: np.ndarray, low: int, scale_max: int) -> tuple[np.ndarray, np.ndarray]:
    """x [n, subs, size] ~ d * sc * q, the sub-block's largest |x| at code ``low`` (< 0, the
    wider side), sc in -scale_max-1..scale_max: (d float16 [n, 1], sc int [n, subs])."""
    at = np.abs(x).argmax(-1)[..., None]
    s = np.take_along_axis(x, at, -1)[..., 0] / low
    d = (np.abs(s).max(-1, keepdims=True) / scale_max).astype(np.float16)
    sc = np.clip(np.rint(_div(s, d.astype(np.float32))), -scale_max - 1, scale_max)
    return d, sc.astype(np.int16)


def _codes(x: np.ndarray, dl: np.ndarray, low: int, high: int) -> np.ndarray:
    codes: np.ndarray = np.clip(np.rint(_div(x, dl[..., None])), low, high)
    return codes.astype(np.int16)


def _iq4_codes(x: np.ndarray, dl: np.ndarray) -> np.ndarray:
    """The nearest code book entry's index for each weight of x [..., size] / dl [...]."""
    scaled = _div(x, dl[..., None])
    nearest: np.ndarray = np.abs(scaled[..., None] - IQ4_VALUES).argmin(-1)
    return nearest.astype(np.uint8)


def _shift_or(parts: list[np.ndarray], width: int) -> np.ndarray:
    """parts[j] << (width * j), or-ed together (fields packed low to high)."""
    out = np.zeros_like(parts[0])
    for j, part in enumerate(parts):
        out |= part << (width * j)
    return out


def _crumbs(q: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K low bits: q [n, 256] 2-bit -> [n, 64], byte 32h+l holding element
    128h+32j+l at bits 2j."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return _shift_or([q[:, :, j] for j in range(4)], 2).reshape(-1, 64)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """Q3_K/Q5_K high bits: bits [n, 256] -> [n, 32], byte l holding element 32j+l at bit j."""
    b = bits.reshape(-1, 8, 32).astype(np.uint8)
    return _shift_or([b[:, j] for j in range(8)], 1)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 8 scales and 8 mins (6 bits) -> their 12 packed bytes."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(x.reshape(-1, 16, 16), 3, 15)
    return np.hstack([sc | (mn << 4), _crumbs(q), _half(d), _half(dmin)])


def _q3_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    d, sc = _symmetric(sub, -4, 31)
    u = (_codes(sub, d.astype(np.float32) * sc, -4, 3) + 4).reshape(-1, QK_K)
    v = (sc + 32).astype(np.uint8)
    scales = np.empty((v.shape[0], 12), dtype=np.uint8)
    scales[:, :8] = (v[:, :8] & 15) | ((v[:, 8:] & 15) << 4)
    scales[:, 8:] = _shift_or([(v[:, 4 * g : 4 * g + 4] >> 4) & 3 for g in range(4)], 2)
    return np.hstack([_bit_planes(u >> 2), _crumbs(u & 3), scales, _half(d)])


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(x.reshape(-1, 8, 32), 15, 63)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.hstack([_half(d), _half(dmin), _k_scales(sc, mn), qs])


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(x.reshape(-1, 8, 32), 31, 63)
    low = (q & 15).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = _bit_planes(q.reshape(-1, QK_K) >> 4)
    return np.hstack([_half(d), _half(dmin), _k_scales(sc, mn), qh, qs])


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    d, sc = _symmetric(sub, -32, 127)
    u = (_codes(sub, d.astype(np.float32) * sc, -32, 31) + 32).astype(np.uint8)
    u = u.reshape(-1, 2, 128)  # halves of 128: ql byte 64h+l holds elements l and 64+l
    ql = ((u[:, :, :64] & 15) | ((u[:, :, 64:] & 15) << 4)).reshape(-1, 128)
    high = (u >> 4).reshape(-1, 2, 4, 32)
    qh = _shift_or([high[:, :, j] for j in range(4)], 2).reshape(-1, 64)
    return np.hstack([ql, qh, sc.astype(np.int8).view(np.uint8), _half(d)])


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 1, 32)
    d, sc = _symmetric(sub, -127, 1)  # one scale a block: sc is 1 or -1, folded into d
    d = (d.astype(np.float32) * sc).astype(np.float16)
    idx = _iq4_codes(sub, d.astype(np.float32))[:, 0]
    return np.hstack([_half(d), idx[:, :16] | (idx[:, 16:] << 4)])


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 8, 32)
    d, sc = _symmetric(sub, -127, 31)
    idx = _iq4_codes(sub, d.astype(np.float32) * sc)
    qs = (idx[..., :16] | (idx[..., 16:] << 4)).reshape(-1, 128)
    v = (sc + 32).astype(np.uint16)
    high = _shift_or([(v[:, i] >> 4) & 3 for i in range(8)], 2).astype("<u2")
    low = ((v[:, 0::2] & 15) | ((v[:, 1::2] & 15) << 4)).astype(np.uint8)
    return np.hstack([_half(d), high[:, None].view(np.uint8), low, qs])


_OURS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.Q2_K: _q2_k,
    GGMLQuantizationType.Q3_K: _q3_k,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
    GGMLQuantizationType.IQ4_NL: _iq4_nl,
    GGMLQuantizationType.IQ4_XS: _iq4_xs,
}


def quantise(data: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """Float weights [..., K] -> the blocks of ``kind`` as uint8 [..., bytes per row], the
    shape ``GGUFWriter.add_tensor(..., raw_dtype=kind)`` takes."""
    data = np.asarray(data, dtype=np.float32)
    if kind not in _OURS:
        from gguf.quants import quantize

        return quantize(data, kind)
    per_block, block_bytes = GGML_QUANT_SIZES[kind]
    k = data.shape[-1]
    if k % per_block:
        raise ValueError(f"{kind.name} needs rows of a multiple of {per_block}, not {k}")
    blocks = _OURS[kind](data.reshape(-1, per_block))
    assert blocks.shape[1] == block_bytes, (kind.name, blocks.shape)
    return blocks.astype(np.uint8).reshape(*data.shape[:-1], k // per_block * block_bytes)

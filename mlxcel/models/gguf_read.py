"""Read a GGUF file: its metadata as plain Python values, its tensors as MLX arrays, every
quantised block format kept quantised in MLX's affine layout.

``mx.load`` decodes only Q4_0/Q4_1/Q8_0 and turns every K-quant into float16 (an 8B Q4_K_M
file would need 16 GB before our loader starts). Here gguf-py's ``GGUFReader`` maps the file
and each block format is repacked, in numpy, into what ``mx.quantize`` makes (``weight``
uint32, ``scales``, ``biases``, one pair per 32 inputs) so that the native kernels and
``mx.quantized_matmul`` take it as it is:

- exact repacks (every weight the value llama.cpp computes, up to the float16 rounding of a
  group's scale and bias where the format forms them as products, <= 2^-11 relative):
  Q4_0, Q4_1, Q4_K -> 4 bits; Q8_0, Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS -> 8 bits (5-bit codes
  and IQ4's int8 code book fit 8 bits with the block's own scale);
- requantised to 8 bits (their sub-blocks of 16 carry separate scales, and MLX's smallest
  group is 32): Q6_K, Q3_K, Q2_K, dequantised by gguf-py first. The 8-bit step is a 255th
  of a 32-group's range, a quarter or less of the format's own step.
- Q4_K and Q6_K matrices (2-D: all of a Q4_K_M / Q5_K_M file's but its 3-D expert stacks)
  also as stored, ``x.q4_k`` / ``x.q6_k`` (``BLOCK_SUFFIXES``): uint8 [rows, K / 256 * 144 or
  210], the blocks themselves. The converted folder keeps both (``gguf_blocks``); on the CPU
  the native kernels multiply by the blocks (``mlxcel.native.kquant_matmul``), 4.5 and 6.56
  bits a weight where the affine copies take 5 and 9, and the weights are the file's exactly
  (llama.cpp's float32 products d * sc, dmin * m: the Q4_K repack rounds them to float16).
  Other devices, ``MLXCEL_NATIVE=0`` and expert stacks load the affine copy.
- F32, F16 and BF16 tensors as stored.

Anything else (IQ1-IQ3, TQ, MXFP4, ...) is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from mlxcel.models import gguf_split
from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.mlx_setup import mx

__all__ = ["BLOCK_SUFFIXES", "GROUP_SIZE", "GgufFile", "SUPPORTED_TYPES", "read_gguf"]

# Every repacked tensor has one scale and bias per 32 inputs, as GGUF's blocks do.
GROUP_SIZE = 32
# The name suffix of a matrix's blocks as stored (``x.q4_k`` beside ``x.weight``), per GGUF
# type kept so; the suffix without its dot names the format in ``mlxcel.native.kquants``.
BLOCK_SUFFIXES = {"Q4_K": ".q4_k", "Q6_K": ".q6_k"}

# llama.cpp's IQ4_NL / IQ4_XS code book (ggml-common.h kvalues_iq4nl).
_IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16
)


@attrs.frozen
class GgufFile:
    """``metadata``: key -> int/float/str/bool or a list of them. ``tensors``: GGUF tensor
    name -> array; a quantised tensor ``x.weight`` also has ``x.scales`` and ``x.biases``, a
    Q4_K / Q6_K matrix ``x.q4_k`` / ``x.q6_k`` (its blocks as stored).
    ``types``: GGUF tensor name -> its stored type's name (Q4_K, F32, ...)."""

    metadata: dict[str, Any]
    tensors: dict[str, mx.array]
    types: dict[str, str]


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """A float16 field of every block as float32 [n_blocks, 1]."""
    raw = np.ascontiguousarray(blocks[:, offset : offset + 2])
    return raw.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 codes: the low nibbles, then the high ones (GGUF's order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 12 bytes of 6-bit scales and mins -> two [n, 8] arrays."""
    s = packed.astype(np.uint16)
    sc = np.empty((s.shape[0], 8), dtype=np.float32)
    mn = np.empty((s.shape[0], 8), dtype=np.float32)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


# Each decoder: blocks [n, block_bytes] uint8 -> (codes [n * groups, 32] uint8, scale and
# bias [n * groups] float32, bits), weight = scale * code + bias.
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray, int]


def _q4_0(b: np.ndarray) -> Decoded:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8.0 * d, 4


def _q4_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2), 4


def _q8_0(b: np.ndarray) -> Decoded:
    d = _f16(b, 0)
    codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128.0 * d, 8


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: the 32-bit word of fifth bits -> [n, 32] bit j at element j."""
    word = np.ascontiguousarray(qh).view("<u4")
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_0(b: np.ndarray) -> Decoded:
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4), d, -16.0 * d, 8


def _q5_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4), _f16(b, 0), _f16(b, 2), 8


def _k_groups(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K scale and bias per 32-group ([n * 8]) from d, dmin and the packed scales."""
    sc, mn = _k_scales(b[:, 4:16])
    return (_f16(b, 0) * sc).reshape(-1), (-_f16(b, 2) * mn).reshape(-1)


def _q4_k(b: np.ndarray) -> Decoded:
    qs = b[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c and 2c+1
    codes = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 32)
    scale, bias = _k_groups(b)
    return codes, scale, bias, 4


def _q5_k(b: np.ndarray) -> Decoded:
    qh = b[:, 16:48][:, None, :]  # bit 2c of byte l: sub-block 2c, element l; 2c+1 likewise
    qs = b[:, 48:176].reshape(-1, 4, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, :, None]
    low = (qs & 15) | (((qh >> shifts) & 1) << 4)
    high = (qs >> 4) | (((qh >> (shifts + 1)) & 1) << 4)
    codes = np.stack([low, high], axis=2).reshape(-1, 32)
    scale, bias = _k_groups(b)
    return codes, scale, bias, 8


def _iq4_nl(b: np.ndarray) -> Decoded:
    d = _f16(b, 0)
    codes = (_IQ4_VALUES[_nibbles(b[:, 2:18])] + 128).astype(np.uint8)
    return codes, d, -128.0 * d, 8


def _iq4_xs(b: np.ndarray) -> Decoded:
    d = _f16(b, 0)
    high = np.ascontiguousarray(b[:, 2:4]).view("<u2").astype(np.int32)  # [n, 1]
    low = b[:, 4:8].astype(np.int32)
    ib = np.arange(8)
    ls = ((low[:, ib // 2] >> (4 * (ib % 2))) & 15) | (((high >> (2 * ib)) & 3) << 4)
    scale = (d * (ls - 32)).reshape(-1)
    qs = b[:, 8:136].reshape(-1, 16)
    codes = (_IQ4_VALUES[_nibbles(qs)] + 128).astype(np.uint8)
    return codes, scale, -128.0 * scale, 8


_EXACT: dict[str, tuple[Callable[[np.ndarray], Decoded], int]] = {
    # type -> (decoder, bytes per block)
    "Q4_0": (_q4_0, 18),
    "Q4_1": (_q4_1, 20),
    "Q8_0": (_q8_0, 34),
    "Q5_0": (_q5_0, 22),
    "Q5_1": (_q5_1, 24),
    "Q4_K": (_q4_k, 144),
    "Q5_K": (_q5_k, 176),
    "IQ4_NL": (_iq4_nl, 18),
    "IQ4_XS": (_iq4_xs, 136),
}
_REQUANTISED = {"Q6_K", "Q3_K", "Q2_K"}
_REQUANT_CHUNK = 1 << 22  # weights dequantised at once
_FLOAT = {"F32", "F16", "BF16"}
SUPPORTED_TYPES = tuple(sorted(_FLOAT | set(_EXACT) | _REQUANTISED))


def _pack(codes: np.ndarray, bits: int, shape: tuple[int, ...]) -> np.ndarray:
    """Codes [..., K] (uint8, < 2**bits) -> MLX's packed uint32 [..., K * bits / 32]."""
    flat = codes.reshape(*shape)
    if bits == 4:
        flat = flat[..., 0::2] | (flat[..., 1::2] << 4)
    return np.ascontiguousarray(flat).view("<u4")


def _quantised(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> dict[str, mx.array]:
    """One tensor's weight/scales/biases; ``shape`` is the logical [..., rows, K]."""
    groups = (*shape[:-1], shape[-1] // GROUP_SIZE)
    if kind in _EXACT:
        decode, block_bytes = _EXACT[kind]
        codes, scale, bias, bits = decode(data.reshape(-1, block_bytes))
        weight = _pack(codes, bits, shape)
        scales, biases = scale.reshape(groups), bias.reshape(groups)
        return {
            "weight": mx.array(weight),
            "scales": mx.array(scales.astype(np.float16)),
            "biases": mx.array(biases.astype(np.float16)),
        }
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    # A slice of rows at a time: a large embedding dequantised whole would be 4 bytes a
    # weight (1 GB for a 1B model's Q6_K vocabulary) on top of the file.
    rows = data.reshape(-1, data.shape[-1])
    step = max(1, _REQUANT_CHUNK // shape[-1])
    parts: dict[str, list[mx.array]] = {"weight": [], "scales": [], "biases": []}
    for r0 in range(0, rows.shape[0], step):
        floats = dequantize(rows[r0 : r0 + step], GGMLQuantizationType[kind])
        w, s, b = mx.quantize(mx.array(floats.astype(np.float32)), group_size=GROUP_SIZE, bits=8)
        for name, part in (
            ("weight", w),
            ("scales", s.astype(mx.float16)),
            ("biases", b.astype(mx.float16)),
        ):
            mx.eval(part)
            parts[name].append(part)
    return {name: mx.concatenate(chunks).reshape(*shape[:-1], -1) for name, chunks in parts.items()}


def _float(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> mx.array:
    if kind == "BF16":
        return mx.array(np.ascontiguousarray(data).view(np.uint16).reshape(shape)).view(mx.bfloat16)
    return mx.array(np.ascontiguousarray(data).reshape(shape))


def _metadata(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # the header's own counts, not metadata
        out[name] = field.contents()
    return out


def _reader(path: Path) -> Any:
    """gguf-py's ``GGUFReader`` over a plain ndarray view of its memory map.

    The reader slices its ``np.memmap`` once per value it parses, and a memmap's slice costs
    ~3x a plain array's (its ``__array_finalize__`` and ``__getitem__`` run in Python): with a
    128k-token vocabulary and its merges (~400k strings, two slices each) the reader took
    8.2 s, and 2.8 s on the same mapping viewed as an ndarray. Same fields, same tensor bytes
    (the view keeps the map alive through its base)."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        @property  # type: ignore[override]  # a plain view where gguf-py declares its memmap
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)

    return Reader(str(path))


def read_gguf(path: Path) -> GgufFile:
    """The metadata and every tensor of the GGUF file at ``path`` (see the module doc); of
    every part, when ``path`` is one part of a split GGUF (``gguf_split``): the metadata is
    the first part's, the tensors all of theirs."""
    readers = []
    for part in gguf_split.parts(path):
        try:
            readers.append(_reader(part))
        except (ValueError, OSError) as exc:
            raise UnsupportedModel(f"{part} is not a readable GGUF file: {exc}") from exc
    metadata = _metadata(readers[0])
    if len(readers) > 1:
        _check_split(path, readers)
        metadata = {k: v for k, v in metadata.items() if not k.startswith("split.")}
    tensors: dict[str, mx.array] = {}
    types: dict[str, str] = {}
    for reader in readers:
        _read_tensors(reader, tensors, types)
    return GgufFile(metadata=metadata, tensors=tensors, types=types)


def _check_split(path: Path, readers: list[Any]) -> None:
    """The parts' own ``split.*`` keys agree with their names and hold every tensor."""
    for no, reader in enumerate(readers):
        md = _metadata(reader)
        if md.get("split.no") == no and md.get("split.count") == len(readers):
            continue
        says = (
            f"says it is part {md['split.no'] + 1} of {md.get('split.count')}"
            if "split.no" in md
            else "is no part of a split GGUF"
        )
        raise UnsupportedModel(
            f"{path.name}: part {no + 1} of {len(readers)} {says} (split.no, split.count): "
            "the parts do not belong together"
        )
    expected = _metadata(readers[0]).get("split.tensors.count")
    held = sum(len(r.tensors) for r in readers)
    if expected is not None and held != expected:
        raise UnsupportedModel(
            f"{path.name}: the {len(readers)} parts hold {held} tensors, the first says "
            f"{expected} (split.tensors.count)"
        )


def _read_tensors(reader: Any, tensors: dict[str, mx.array], types: dict[str, str]) -> None:
    for t in reader.tensors:
        kind = t.tensor_type.name
        # GGUF lists dimensions innermost first; MLX wants [..., rows, K].
        shape = tuple(int(n) for n in reversed(t.shape))
        types[t.name] = kind
        if kind in _FLOAT:
            tensors[t.name] = _float(t.data, kind, shape)
        elif kind in _EXACT or kind in _REQUANTISED:
            if shape[-1] % GROUP_SIZE:
                raise UnsupportedModel(f"GGUF tensor {t.name!r} has {shape[-1]} inputs per row")
            base = t.name.removesuffix(".weight")
            for part, array in _quantised(t.data, kind, shape).items():
                tensors[f"{base}.{part}"] = array
            if kind in BLOCK_SUFFIXES and len(shape) == 2:  # expert stacks (3-D): affine only
                rows = np.ascontiguousarray(t.data).reshape(shape[0], -1)
                tensors[f"{base}{BLOCK_SUFFIXES[kind]}"] = mx.array(rows)
        else:
            served = ", ".join(SUPPORTED_TYPES)
            raise UnsupportedModel(
                f"GGUF tensor {t.name!r} is stored as {kind}, which is not served "
                f"(served: {served})"
            )

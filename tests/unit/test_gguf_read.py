"""GGUF block formats read into MLX's affine layout (models/gguf_read.py), checked against
gguf-py's own dequantisation (llama.cpp's reference code ported to numpy)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.gguf_read import _quantised, read_gguf
from mlxcel.models.mlx_setup import mx

# Offsets of each format's float16 fields (d, dmin) in its block: random bytes elsewhere are
# valid codes and scales, but a random float16 could be inf or NaN.
_HALVES = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q8_0": [0],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
    "Q6_K": [-2],
    "Q3_K": [-2],
    "Q2_K": [-4, -2],
}
EXACT = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL"]
# The group's scale or bias is a product of two stored numbers, rounded to float16.
PRODUCTS = ["Q4_K", "Q5_K", "IQ4_XS"]
REQUANTISED = ["Q6_K", "Q3_K", "Q2_K"]


def _blocks(kind: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes per row] of random but valid blocks of ``kind``."""
    per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * k // per_block, block_bytes), dtype=np.uint8)
    for offset in _HALVES[kind]:
        at = offset % block_bytes
        halves = (rng.standard_normal((raw.shape[0], 1)) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = halves.view(np.uint8)
    return raw.reshape(rows, -1)


def _ours(data: np.ndarray, kind: str, rows: int, k: int) -> tuple[np.ndarray, int]:
    parts = _quantised(data, kind, (rows, k))
    bits = parts["weight"].shape[-1] * 32 // k
    got = mx.dequantize(
        parts["weight"],
        parts["scales"].astype(mx.float32),
        parts["biases"].astype(mx.float32),
        group_size=32,
        bits=bits,
    )
    return np.array(got), bits


@pytest.mark.parametrize("kind", EXACT + PRODUCTS + REQUANTISED)
def test_every_block_format_reads_as_llama_cpp_dequantises_it(kind: str) -> None:
    rows, k = 6, 512
    data = _blocks(kind, rows, k)
    reference = dequantize(data, GGMLQuantizationType[kind]).reshape(rows, k)
    got, bits = _ours(data, kind, rows, k)
    assert bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8)
    err = np.abs(got - reference).reshape(rows, k // 32, 32).max(axis=-1)
    magnitude = np.abs(reference).reshape(rows, k // 32, 32).max(axis=-1)
    if kind in EXACT:
        assert err.max() == 0.0
    elif kind in PRODUCTS:
        # float16 rounding of a scale and a bias: a few units of 2^-11 of the group's values
        assert (err <= magnitude * 2.0**-9).all()
    else:
        # 8 bits over a 32-group's range (<= 2 x magnitude): mx.quantize keeps zero exact,
        # so up to one step, range / 255, plus float16 rounding of the scale and bias
        assert (err <= 2 * magnitude / 255 + magnitude * 2.0**-9).all()


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_gives_plain_metadata_and_mlx_arrays(tmp_path: Path) -> None:
    q4k = _blocks("Q4_K", 8, 256)
    f16 = np.arange(12, dtype=np.float16).reshape(3, 4)
    bf16 = np.array([[1.0, -2.5]], dtype=np.float32).view(np.uint32) >> 16
    path = tmp_path / "m.gguf"
    _write(
        path,
        {
            "blk.0.ffn_up.weight": (q4k, GGMLQuantizationType.Q4_K),
            "blk.0.attn_norm.weight": (np.ones(4, dtype=np.float32), None),
            "token_embd.weight": (f16, None),
            "output.weight": (bf16.astype(np.uint16), GGMLQuantizationType.BF16),
        },
    )
    got = read_gguf(path)
    assert got.metadata["llama.block_count"] == 1
    assert got.metadata["tokenizer.ggml.tokens"] == ["a", "b"]
    assert got.types["blk.0.ffn_up.weight"] == "Q4_K"
    t = got.tensors
    assert t["blk.0.ffn_up.weight"].shape == (8, 256 * 4 // 32)
    assert t["blk.0.ffn_up.weight"].dtype == mx.uint32
    assert t["blk.0.ffn_up.scales"].shape == t["blk.0.ffn_up.biases"].shape == (8, 8)
    expected = dequantize(q4k, GGMLQuantizationType.Q4_K).reshape(8, 256)
    up = mx.dequantize(
        t["blk.0.ffn_up.weight"],
        t["blk.0.ffn_up.scales"],
        t["blk.0.ffn_up.biases"],
        group_size=32,
        bits=4,
    )
    assert np.allclose(np.array(up), expected, atol=np.abs(expected).max() * 2.0**-9)
    assert t["token_embd.weight"].dtype == mx.float16
    assert np.array_equal(np.array(t["token_embd.weight"]), f16)
    assert t["output.weight"].dtype == mx.bfloat16
    assert t["output.weight"].astype(mx.float32).tolist() == [[1.0, -2.5]]
    assert t["blk.0.attn_norm.weight"].dtype == mx.float32


@pytest.mark.parametrize(("kind", "bits"), [("Q4_K", 4), ("Q6_K", 8)])
def test_k_quant_matrices_also_keep_their_blocks_as_stored(
    tmp_path: Path, kind: str, bits: int
) -> None:
    # For the native kernels (gguf_blocks): the file's bytes, a row of blocks per matrix row;
    # 3-D expert stacks only as their affine copy.
    blocks = _blocks(kind, 4, 512)
    experts = _blocks(kind, 2 * 4, 256, seed=1).reshape(2, 4, -1)
    path = tmp_path / "m.gguf"
    _write(
        path,
        {
            "output.weight": (blocks, GGMLQuantizationType[kind]),
            "blk.0.ffn_down_exps.weight": (experts, GGMLQuantizationType[kind]),
        },
    )
    t = read_gguf(path).tensors
    suffix = kind.lower()
    assert t[f"output.{suffix}"].dtype == mx.uint8
    assert np.array_equal(np.array(t[f"output.{suffix}"]), blocks)
    assert t["output.weight"].shape == (4, 512 * bits // 32)  # and the affine copy
    assert f"blk.0.ffn_down_exps.{suffix}" not in t
    assert t["blk.0.ffn_down_exps.weight"].shape == (2, 4, 256 * bits // 32)


def test_an_unserved_type_is_refused_by_name(tmp_path: Path) -> None:
    per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.IQ2_XXS]
    raw = np.zeros((4, 256 // per_block * block_bytes), dtype=np.uint8)
    path = tmp_path / "iq2.gguf"
    _write(path, {"blk.0.ffn_up.weight": (raw, GGMLQuantizationType.IQ2_XXS)})
    with pytest.raises(UnsupportedModel, match=r"blk\.0\.ffn_up\.weight.*IQ2_XXS.*Q4_K"):
        read_gguf(path)


def test_not_a_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(UnsupportedModel, match="not a readable GGUF"):
        read_gguf(path)


def test_the_reader_parses_what_gguf_py_parses_without_memmap_slices() -> None:
    """The reader views gguf-py's memory map as a plain array (a memmap's slices cost ~3x,
    and parsing a 128k vocabulary took 8 s): the same fields and tensor bytes as gguf-py's
    own reader, on the packaged model's GGUF."""
    from gguf import GGUFReader

    from mlxcel.models.default import default_gguf_path
    from mlxcel.models.gguf_read import _reader

    path = default_gguf_path()
    ours, theirs = _reader(path), GGUFReader(str(path))
    assert not isinstance(ours.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].contents() == field.contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(a.data, b.data), a.name

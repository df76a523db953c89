"""The native matmul kernels (mlxcel/native) against mlx's float32 reference.

Tolerance: |ours - ref| <= 1e-5 * (|x| @ |W|.T) elementwise. Both sides are float32 sums of the
same products in different orders (ours: 16-lane partial sums per tile); such sums differ by
at most ~K * 2^-24 of the sum of the terms' magnitudes, typically ~sqrt(K) * 2^-24 (< 3e-6 at
K=1536), and |x| @ |W|.T is exactly that magnitude, so a wrong weight, scale or row fails by
orders of magnitude while a legitimate reordering never does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlxcel.models.mlx_setup import mx
from mlxcel.native import (
    BF16_ROWS_THRESHOLD,
    ROWS_THRESHOLD,
    available,
    bf16_matmul,
    quantized_matmul,
    reason,
)
from mlxcel.native.build import HERE

_STAMP = HERE / ".build-stamp"

needs_ext = pytest.mark.skipif(not available(), reason=f"native kernels unavailable: {reason()}")


def test_available_where_built() -> None:
    # A broken build must not pass as skipped: in CI, or once `python -m mlxcel.native` built
    # the module here (it leaves the stamp), the kernels must load and be used.
    if not os.environ.get("CI") and not _STAMP.is_file():
        pytest.skip("the native kernels were never built here and this is not CI")
    assert available(), reason()


def _ext() -> object:
    from mlxcel.native import _ext

    return _ext


def _quantized(
    n: int, k: int, bits: int, group: int, scale_dtype: mx.Dtype
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Packed weights, scales, biases, and the float32 matrix they stand for."""
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group, bits=bits)
    scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
    dense = mx.dequantize(
        w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group, bits=bits
    )
    return w, scales, biases, dense


def _check(got: mx.array, x: mx.array, dense: mx.array) -> None:
    want = x @ dense.T
    bound = 1e-5 * (mx.abs(x) @ mx.abs(dense).T) + 1e-30
    assert got.dtype == mx.float32
    assert got.shape == want.shape
    excess = (mx.abs(got - want) / bound).max().item()
    assert excess <= 1.0, f"error {excess:.3g}x the tolerance"


def _qmm(x: mx.array, w: mx.array, s: mx.array, b: mx.array, group: int, bits: int) -> mx.array:
    ext: Callable[..., mx.array] = _ext().quantized_matmul  # type: ignore[attr-defined]
    return ext(x, w, s, b, group_size=group, bits=bits)


@pytest.fixture(autouse=True)
def _seed() -> None:
    mx.random.seed(7)


@needs_ext
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 512])
@pytest.mark.parametrize("bits", [4, 8])
def test_rows(rows: int, bits: int) -> None:
    w, s, b, dense = _quantized(1536, 576, bits, 32, mx.float16)
    x = mx.random.normal((rows, 576))
    _check(_qmm(x, w, s, b, 32, bits), x, dense)  # the kernel itself, at any row count
    _check(quantized_matmul(x, w, s, b, group_size=32, bits=bits), x, dense)  # the wrapper


@needs_ext
@pytest.mark.parametrize(
    ("k", "group"),
    # Every group size that divides K (mlx quantises no other).
    [(k, g) for k in (64, 576, 1536) for g in (32, 64, 128) if k % g == 0],
)
@pytest.mark.parametrize("n", [1, 7, 64, 576, 1536])
@pytest.mark.parametrize("bits", [4, 8])
def test_shapes(k: int, group: int, n: int, bits: int) -> None:
    w, s, b, dense = _quantized(n, k, bits, group, mx.bfloat16)
    # 1-8 rows take the tiles, 16 and 40 the rows kernel (one and several 16-row vectors).
    for rows in (1, 3, 16, 40):
        x = mx.random.normal((rows, k))
        _check(_qmm(x, w, s, b, group, bits), x, dense)


@needs_ext
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_scale_dtypes(scale_dtype: mx.Dtype, bits: int, group: int) -> None:
    w, s, b, dense = _quantized(576, 1536, bits, group, scale_dtype)
    for rows in (1, 8, 16, 40):
        x = mx.random.normal((rows, 1536))
        _check(_qmm(x, w, s, b, group, bits), x, dense)


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
def test_vocabulary_sized_lm_head(bits: int) -> None:
    w, s, b, dense = _quantized(49152, 576, bits, 32 if bits == 4 else 64, mx.float16)
    group = 32 if bits == 4 else 64
    for rows in (1, 16):
        x = mx.random.normal((rows, 576))
        _check(_qmm(x, w, s, b, group, bits), x, dense)


@needs_ext
def test_leading_dims_and_strided_inputs() -> None:
    w, s, b, dense = _quantized(64, 576, 4, 32, mx.float16)
    x = mx.random.normal((2, 3, 576))
    got = quantized_matmul(x, w, s, b, group_size=32, bits=4)
    assert got.shape == (2, 3, 64)
    _check(got.reshape(6, 64), x.reshape(6, 576), dense)
    transposed = mx.random.normal((576, 5)).T  # column-major rows
    _check(_qmm(transposed, w, s, b, 32, 4), transposed, dense)
    sliced = mx.random.normal((9, 1200))[::2, 17:593]  # strided rows, offset start
    _check(_qmm(sliced, w, s, b, 32, 4), sliced, dense)


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
def test_portable_kernels(bits: int) -> None:
    ext = _ext()
    w, s, b, dense = _quantized(77, 576, bits, 64, mx.float16)
    x = mx.random.normal((5, 576))
    ext.force_generic(True)  # type: ignore[attr-defined]
    try:
        _check(_qmm(x, w, s, b, 64, bits), x, dense)
        wb = dense.astype(mx.bfloat16)
        _check(bf16_matmul(x, wb), x, wb.astype(mx.float32))
    finally:
        ext.force_generic(False)  # type: ignore[attr-defined]


@needs_ext
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 32])
@pytest.mark.parametrize(("n", "k"), [(1, 64), (7, 576), (1536, 576), (576, 1536), (5, 100)])
def test_bf16(rows: int, n: int, k: int) -> None:
    w = mx.random.normal((n, k)).astype(mx.bfloat16)
    x = mx.random.normal((rows, k))
    _check(bf16_matmul(x, w), x, w.astype(mx.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_wrappers_above_the_row_threshold(bits: int) -> None:
    # Prefill-sized inputs go to dequantise + float32 matmul, with or without the extension.
    w, s, b, dense = _quantized(64, 576, bits, 32, mx.bfloat16)
    x = mx.random.normal((ROWS_THRESHOLD[bits] + 1, 576))
    _check(quantized_matmul(x, w, s, b, group_size=32, bits=bits), x, dense)
    wb = dense.astype(mx.bfloat16)
    x = mx.random.normal((BF16_ROWS_THRESHOLD + 1, 576))
    _check(bf16_matmul(x, wb), x, wb.astype(mx.float32))


def test_rejects_mismatched_shapes() -> None:
    if not available():
        pytest.skip(reason())
    w, s, b, _ = _quantized(64, 576, 4, 32, mx.float16)
    with pytest.raises(ValueError, match="inputs per row"):
        _qmm(mx.zeros((1, 512)), w, s, b, 32, 4)


@pytest.mark.slow
@needs_ext
def test_default_model_on_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader puts the default model's Q4_1 layers on the kernels (weights as stored) and
    it says what float32 says."""
    from mlx.utils import tree_flatten

    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model
    from mlxcel.native.check import compare_greedy
    from mlxcel.native.layers import NativeQuantizedEmbedding, NativeQuantizedLinear

    resolved = resolve_model(None)
    reference = load_model(resolved, native=False)
    quantized = load_model(resolved)
    # 30 layers x 7 projections, plus the tied embedding (lookup and lm_head).
    assert (reference.native_layers, quantized.native_layers) == (0, 211)
    assert quantized.quantized and not reference.quantized
    kinds = {type(m) for _, m in quantized.model.named_modules()}
    assert {NativeQuantizedLinear, NativeQuantizedEmbedding} <= kinds

    def size(model: Any) -> int:
        return sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    # ~5x fewer bytes of weights than float32.
    assert size(quantized.model) * 4 < size(reference.model)
    prompt = reference.tokenizer.encode("The capital of France is")
    result = compare_greedy(reference.model, quantized.model, prompt, steps=8)
    assert result.candidate_tokens == result.reference_tokens
    # Measured 2.2e-6: float32 throughout, only summation order differs.
    assert result.max_rel_diff < 2e-5, result
    monkeypatch.setenv("MLXCEL_NATIVE", "0")
    assert load_model(resolved).native_layers == 0


@needs_ext
def test_bfloat16_checkpoint_on_native_kernels(tmp_path: Path) -> None:
    """A bfloat16 checkpoint keeps its projections in bfloat16 on the CPU (half float32's
    bytes) and says what the same weights widened to float32 say."""
    from mlx.utils import tree_flatten

    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model
    from mlxcel.native.check import compare_greedy
    from mlxcel.native.layers import NativeBf16Embedding, NativeBf16Linear
    from tests.support.tiny_model import build_tiny_model

    resolved = resolve_model(str(build_tiny_model(tmp_path / "tiny-bf16", dtype="bfloat16")))
    reference = load_model(resolved, native=False)
    kept = load_model(resolved)
    # 2 layers x 7 projections, the lm_head and the embedding table.
    assert (reference.native_layers, kept.native_layers) == (0, 16)
    kinds = {type(m) for _, m in kept.model.named_modules()}
    assert {NativeBf16Linear, NativeBf16Embedding} <= kinds
    dtypes = {path: v.dtype for path, v in tree_flatten(kept.model.parameters())}
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == mx.bfloat16
    assert dtypes["model.norm.weight"] == mx.float32
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(reference.model.parameters()))
    prompt = reference.tokenizer.encode("The capital of France is")
    result = compare_greedy(reference.model, kept.model, prompt, steps=8)
    assert result.candidate_tokens == result.reference_tokens
    assert result.max_rel_diff < 2e-5, result
    # Asking for a dtype gets it everywhere.
    assert load_model(resolved, dtype="float32").native_layers == 0

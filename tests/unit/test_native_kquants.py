"""GGUF's K-quant blocks (Q4_K, Q6_K) multiplied as stored (``mlxcel.native.kquant_matmul``)
and decoded with mlx ops (``mlxcel.native.kquants``), against gguf-py's reference
dequantisation.

The blocks are random bytes (every code, every sub-block scale and min, both signs) with
normal float16 ``d`` (and Q4_K's ``dmin``). The weights must come out exactly as gguf-py
decodes them; a product's error is float32 summation order only:
|ours - ref| <= 1e-5 * (|x| @ |W|.T), as in test_native_kernels.py (a misread code, scale or
block moves it by orders of magnitude).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mlxcel.models.mlx_setup import mx
from mlxcel.native import available, kquant_matmul, kquants, reason, set_int8_activations
from mlxcel.native.layers import NativeKQuantEmbedding, NativeKQuantLinear
from tests.unit.test_native_kernels import _check as check_float32
from tests.unit.test_native_kernels import _check_int8 as check_int8
from tests.unit.test_native_kernels import needs_vnni

needs_ext = pytest.mark.skipif(not available(), reason=f"native kernels unavailable: {reason()}")


@pytest.fixture(autouse=True)
def _float_kernels() -> Iterator[None]:
    set_int8_activations("off")  # float32 unless a test asks for int8
    yield
    set_int8_activations(None)  # the process default


FORMATS = ["q4_k", "q6_k"]
# Where each format keeps its float16 factors (d; Q4_K's dmin too), and their magnitude: Q4_K's
# scales go to 63 and its codes to 15, Q6_K's to 127 and +-32.
_FLOAT16_AT = {"q4_k": (0, 2), "q6_k": (208,)}
_MAGNITUDE = {"q4_k": 0.002, "q6_k": 0.01}


@pytest.fixture(params=FORMATS)
def fmt(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _blocks(n: int, k: int, fmt: str, seed: int = 0) -> tuple[mx.array, np.ndarray]:
    """Random rows of ``fmt`` blocks [n, k / 256 * block bytes] and the float32 matrix gguf-py
    decodes them to."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(seed)
    size = kquants.FORMATS[fmt].block_bytes
    raw = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    for at in _FLOAT16_AT[fmt]:
        d = (rng.standard_normal((n, k // 256)) * _MAGNITUDE[fmt]).astype(np.float16)
        raw[..., at : at + 2] = d.view(np.uint8).reshape(n, k // 256, 2)
    rows = raw.reshape(n, -1)
    kind = GGMLQuantizationType[fmt.upper()]
    dense = dequantize(rows, kind).reshape(n, k).astype(np.float32)
    return mx.array(rows), dense


def _check(got: mx.array, x: mx.array, dense: np.ndarray) -> None:
    check_float32(got, x, mx.array(dense))


def test_dequantize_gives_gguf_pys_weights_exactly(fmt: str) -> None:
    blocks, dense = _blocks(5, 768, fmt)
    assert np.array_equal(np.array(kquants.dequantize(blocks, fmt)), dense)
    # Rows taken as an embedding lookup takes them, batch axes kept.
    ids = mx.array([[4, 0], [2, 2]])
    picked = np.array(kquants.dequantize(blocks[ids], fmt))
    assert picked.shape == (2, 2, 768)
    assert np.array_equal(picked, dense[np.array(ids)])


@needs_ext
@pytest.mark.parametrize("rows", [1, 3, 12, 16, 64])
@pytest.mark.parametrize(("n", "k"), [(37, 512), (64, 256), (33, 1280), (3, 2048)])
def test_kernel_against_gguf_py(rows: int, n: int, k: int, native_isa: str, fmt: str) -> None:
    blocks, dense = _blocks(n, k, fmt, seed=rows * n)
    x = mx.random.normal((rows, k), key=mx.random.key(rows))
    _check(kquant_matmul(x, blocks, fmt), x, dense)


@needs_ext
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_portable_kernel(rows: int, fmt: str) -> None:
    from mlxcel.native import _ext

    ext: Any = _ext
    blocks, dense = _blocks(29, 768, fmt)
    x = mx.random.normal((rows, 768))
    ext.force_generic(True)
    try:
        _check(kquant_matmul(x, blocks, fmt), x, dense)
    finally:
        ext.force_generic(False)


@needs_ext
def test_batch_axes_and_strided_inputs(fmt: str) -> None:
    blocks, dense = _blocks(40, 512, fmt)
    x = mx.random.normal((2, 3, 512))
    got = kquant_matmul(x, blocks, fmt)
    assert got.shape == (2, 3, 40)
    _check(got.reshape(6, 40), x.reshape(6, 512), dense)
    sliced = mx.random.normal((9, 700))[::2, 100:612]
    _check(kquant_matmul(sliced, blocks, fmt), sliced, dense)


@needs_ext
def test_shapes_it_cannot_take_are_refused() -> None:
    from mlxcel.native import _ext

    ext: Any = _ext
    blocks, _ = _blocks(4, 512, "q6_k")
    with pytest.raises(ValueError, match="multiple of 256"):
        ext.kquant_matmul(mx.zeros((1, 500)), blocks, format="q6_k")
    with pytest.raises(ValueError, match=r"uint8 \[N, 420\]"):
        ext.kquant_matmul(mx.zeros((1, 512)), blocks[:, :400], format="q6_k")
    with pytest.raises(ValueError, match=r"uint8 \[N, 288\] \(q4_k"):
        ext.kquant_matmul(mx.zeros((1, 512)), blocks, format="q4_k")
    with pytest.raises(ValueError, match="float32"):
        ext.kquant_matmul(mx.zeros((1, 512), dtype=mx.float16), blocks, format="q6_k")
    with pytest.raises(ValueError, match="format must be"):
        ext.kquant_matmul(mx.zeros((1, 512)), blocks, format="q5_k")


def test_mlx_fallback_where_the_kernels_do_not_take_it(fmt: str) -> None:
    # float16 activations go to mlx ops on the decoded weights (and everything does where the
    # kernels are not built): same weights, float16's rounding.
    blocks, dense = _blocks(8, 256, fmt)
    x = mx.random.normal((2, 256), key=mx.random.key(3))
    got = kquant_matmul(x.astype(mx.float16), blocks, fmt)
    assert got.dtype == mx.float16
    want = x @ mx.array(dense).T
    # float16's rounding of the activations, the weights and every partial sum: a bound that
    # scales with the terms summed (a fixed atol failed now and then on large random sums).
    bound = 1e-2 * (mx.abs(x) @ mx.abs(mx.array(dense)).T) + 1e-3
    assert mx.all(mx.abs(got.astype(mx.float32) - want) <= bound).item()


def test_layers(fmt: str) -> None:
    blocks, dense = _blocks(48, 512, fmt)
    bias = mx.random.normal((48,))
    linear = NativeKQuantLinear(blocks, fmt, bias)
    assert (linear.input_dims, linear.output_dims) == (512, 48)
    x = mx.random.normal((3, 512))
    _check(linear(x) - bias, x, dense)
    table = NativeKQuantEmbedding(blocks, fmt)
    ids = mx.array([[7, 47, 0]])
    assert np.array_equal(np.array(table(ids)), dense[np.array(ids)])
    _check(table.as_linear(x), x, dense)


@needs_vnni
@pytest.mark.parametrize(("n", "k"), [(37, 512), (200, 1280), (8, 256)])
def test_int8_activations_within_the_rounding_bound(n: int, k: int, fmt: str) -> None:
    blocks, dense = _blocks(n, k, fmt)
    set_int8_activations("many-rows")
    for rows in (12, 16, 40, 300):  # one row tile, ragged ones, several
        x = mx.random.normal((rows, k)) * mx.random.uniform(0.1, 10.0, (rows, 1))
        check_int8(kquant_matmul(x, blocks, fmt), x, mx.array(dense))
    x = mx.random.normal((3, k))  # fewer than 12 rows: float32
    _check(kquant_matmul(x, blocks, fmt), x, dense)
    set_int8_activations("every-row")
    check_int8(kquant_matmul(x, blocks, fmt), x, mx.array(dense))


@needs_vnni
def test_int8_row_gets_the_same_bits_at_any_row_count(fmt: str) -> None:
    # --batch-invariant runs with int8 at every row count: a row's result must not depend on
    # the rows beside it (tied output heads are not checked by its layer probe).
    blocks, _ = _blocks(300, 512, fmt)
    x = mx.random.normal((48, 512))
    set_int8_activations("every-row")
    full = kquant_matmul(x, blocks, fmt)
    for rows in (1, 2, 5, 11, 12, 13, 16, 17, 33):
        for start in (0, 3, 48 - rows):
            part = kquant_matmul(x[start : start + rows], blocks, fmt)
            assert mx.array_equal(part, full[start : start + rows]).item(), (rows, start)


@needs_vnni
def test_a_prompt_pass_takes_int8_at_any_row_count(fmt: str) -> None:
    """K-quant layers follow the int8 rules affine ones do (docs/reference/http-api.md#seeds):
    3 rows read as a prompt get the bits they get among 16; a decode batch of 3 rows computes
    in float32 inside it."""
    from mlxcel.native import int8_like_rows, prompt_pass

    blocks, dense = _blocks(48, 512, fmt)
    x = mx.random.normal((16, 512), key=mx.random.key(5))
    set_int8_activations("many-rows")
    full = kquant_matmul(x, blocks, fmt)
    plain = kquant_matmul(x[:3], blocks, fmt)
    _check(plain, x[:3], dense)  # float32 outside a prompt pass
    with prompt_pass():
        assert mx.array_equal(kquant_matmul(x[:3], blocks, fmt), full[:3]).item()
        with int8_like_rows(3):
            _check(kquant_matmul(x, blocks, fmt), x, dense)
    assert mx.array_equal(kquant_matmul(x[:3], blocks, fmt), plain).item()

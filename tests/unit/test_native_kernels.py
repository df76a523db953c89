"""The native matmul kernels (mlxcel/native) against mlx's float32 reference.

Tests that take the ``native_isa`` fixture (tests/unit/conftest.py) run once per instruction set
the kernels have on this CPU (AVX-512 and AVX2 on an AVX-512 CPU), the kernels capped to it.

The float32 kernels first (int8 activations off, as every test here has them unless it asks):
tolerance: |ours - ref| <= 1e-5 * (|x| @ |W|.T) elementwise. Both sides are float32 sums of the
same products in different orders (ours: 16-lane partial sums per tile, 8 with AVX2); such sums
differ by at most ~K * 2^-24 of the sum of the terms' magnitudes, typically ~sqrt(K) * 2^-24
(< 3e-6 at K=1536), and |x| @ |W|.T is exactly that magnitude, so a wrong weight, scale or row
fails by orders of magnitude while a legitimate reordering never does.

Then int8 activations (AVX512-VNNI), whose error is bounded by how x is rounded: see
``_check_int8``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxcel.models.mlx_setup import mx
from mlxcel.native import (
    BF16_ROWS_THRESHOLD,
    ROWS_THRESHOLD,
    available,
    bf16_matmul,
    int8_activations,
    int8_like_rows,
    kernel_isa,
    prompt_pass,
    quantized_matmul,
    reason,
    set_int8_activations,
)
from mlxcel.native.build import HERE
from tests.unit.conftest import native_isas

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


@pytest.fixture(autouse=True)
def _float_kernels() -> Iterator[None]:
    set_int8_activations("off")
    yield
    set_int8_activations(None)  # the process default


@needs_ext
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 512])
@pytest.mark.parametrize("bits", [4, 8])
def test_rows(rows: int, bits: int, native_isa: str) -> None:
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
def test_shapes(k: int, group: int, n: int, bits: int, native_isa: str) -> None:
    w, s, b, dense = _quantized(n, k, bits, group, mx.bfloat16)
    # 1-8 rows take the tiles, 16 and 40 the rows kernel (one and several 16-row vectors).
    for rows in (1, 3, 16, 40):
        x = mx.random.normal((rows, k))
        _check(_qmm(x, w, s, b, group, bits), x, dense)


@needs_ext
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_scale_dtypes(scale_dtype: mx.Dtype, bits: int, group: int, native_isa: str) -> None:
    w, s, b, dense = _quantized(576, 1536, bits, group, scale_dtype)
    for rows in (1, 8, 16, 40):
        x = mx.random.normal((rows, 1536))
        _check(_qmm(x, w, s, b, group, bits), x, dense)


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
def test_vocabulary_sized_lm_head(bits: int, native_isa: str) -> None:
    w, s, b, dense = _quantized(49152, 576, bits, 32 if bits == 4 else 64, mx.float16)
    group = 32 if bits == 4 else 64
    for rows in (1, 16):
        x = mx.random.normal((rows, 576))
        _check(_qmm(x, w, s, b, group, bits), x, dense)


@needs_ext
def test_leading_dims_and_strided_inputs(native_isa: str) -> None:
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
def test_bf16(rows: int, n: int, k: int, native_isa: str) -> None:
    w = mx.random.normal((n, k)).astype(mx.bfloat16)
    x = mx.random.normal((rows, k))
    _check(bf16_matmul(x, w), x, w.astype(mx.float32))


@pytest.mark.skipif(
    native_isas()[:2] != ["avx512", "avx2"], reason="needs a CPU with AVX-512 and the kernels"
)
def test_isa_cap_runs_the_avx2_kernels() -> None:
    """Capped to AVX2 on an AVX-512 CPU (what a CPU without AVX-512 runs), the AVX2 kernels are
    what computes: the ISA says so, int8 activations are off (AVX2 has none), and sums come
    out grouped 8 lanes wide, so not all bits match the AVX-512 kernels' 16-lane sums."""
    ext: Any = _ext()
    w, s, b, dense = _quantized(1536, 576, 4, 32, mx.float16)
    wb = dense.astype(mx.bfloat16)
    x = mx.random.normal((3, 576))
    wide = (_qmm(x, w, s, b, 32, 4), bf16_matmul(x, wb))
    mx.eval(*wide)
    assert ext.set_isa_cap("avx2") == "avx2" == kernel_isa()
    try:
        assert set_int8_activations("every-row") == "off"
        narrow = (_qmm(x, w, s, b, 32, 4), bf16_matmul(x, wb))
        _check(narrow[0], x, dense)
        _check(narrow[1], x, wb.astype(mx.float32))
        for a, b_ in zip(narrow, wide, strict=True):
            assert not mx.array_equal(a, b_).item()
    finally:
        ext.set_isa_cap("avx512")
        set_int8_activations("off")


@needs_ext
def test_isa_environment_variable() -> None:
    """MLXCEL_NATIVE_ISA caps the kernels from the start; "generic" leaves mlx's own ops."""

    def run(isa: str) -> list[str]:
        code = (
            "import mlxcel.models.mlx_setup; from mlxcel import native; "
            "print(native.kernel_isa() or '-', native.int8_activations(), native.available())"
        )
        env = {**os.environ, "MLXCEL_NATIVE_ISA": isa, "MLXCEL_NATIVE_INT8": "every-row"}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return done.stdout.split()

    if "avx2" in native_isas():
        assert run("avx2") == ["avx2", "off", "True"]
    assert run("generic") == ["-", "off", "False"]


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
def test_default_model_on_native_kernels(monkeypatch: pytest.MonkeyPatch, native_isa: str) -> None:
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
def test_bfloat16_checkpoint_on_native_kernels(tmp_path: Path, native_isa: str) -> None:
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


# ---- int8 activations -------------------------------------------------------------------

needs_vnni = pytest.mark.skipif(
    not available() or set_int8_activations("every-row") == "off",
    reason="int8 activations need the native kernels and AVX512-VNNI",
)
set_int8_activations(None)


def _check_int8(got: mx.array, x: mx.array, dense: mx.array) -> None:
    """Each row of x is rounded per 32 inputs to multiples of d = max|x| / 127 (the block's),
    so an output is off by at most sum_k |W[n, k]| * d_k / 2, plus float32's share; a wrong
    weight, scale, bias or row fails by far more."""
    rows, k = x.shape
    amax = mx.abs(x).reshape(rows, k // 32, 32).max(axis=-1, keepdims=True)
    half_step = mx.broadcast_to(amax / 254, (rows, k // 32, 32)).reshape(rows, k)
    bound = half_step @ mx.abs(dense).T + 2e-5 * (mx.abs(x) @ mx.abs(dense).T) + 1e-30
    want = x @ dense.T
    assert got.shape == want.shape and got.dtype == mx.float32
    excess = (mx.abs(got - want) / bound).max().item()
    assert excess <= 1.0, f"error {excess:.3g}x the bound"
    # ... and it is not the float32 result either: the rounding of x shows.
    assert (mx.abs(got - want).max() > 0).item()


@needs_vnni
@pytest.mark.parametrize(("k", "group"), [(64, 32), (576, 32), (576, 64), (1536, 128)])
@pytest.mark.parametrize("n", [7, 200, 1536])
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_within_the_rounding_bound(k: int, group: int, n: int, bits: int) -> None:
    set_int8_activations("every-row")
    for scale_dtype in (mx.float16, mx.bfloat16, mx.float32):
        w, s, b, dense = _quantized(n, k, bits, group, scale_dtype)
        # 1-8 rows: columns as lanes; 12 and more: the rows kernel (one, several, ragged).
        for rows in (1, 3, 8, 11, 12, 16, 40, 300):
            x = mx.random.normal((rows, k)) * mx.random.uniform(0.1, 10.0, (rows, 1))
            _check_int8(_qmm(x, w, s, b, group, bits), x, dense)


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_row_gets_the_same_bits_at_any_row_count(bits: int) -> None:
    w, s, b, dense = _quantized(1536, 576, bits, 32, mx.float16)
    x = mx.random.normal((48, 576))
    set_int8_activations("every-row")
    full = _qmm(x, w, s, b, 32, bits)
    for rows in (1, 2, 5, 8, 11, 12, 13, 16, 17, 31, 33):
        for start in (0, 3, 48 - rows):
            part = _qmm(x[start : start + rows], w, s, b, 32, bits)
            assert mx.array_equal(part, full[start : start + rows]).item(), (rows, start)
    # "many-rows": the same kernel from 12 rows on; fewer rows take the float32 kernels.
    set_int8_activations("many-rows")
    assert mx.array_equal(_qmm(x[:12], w, s, b, 32, bits), full[:12]).item()
    _check(_qmm(x[:11], w, s, b, 32, bits), x[:11], dense)
    # Prompt-sized inputs stay on the kernels (not dequantise + OpenBLAS) with int8 on.
    big = mx.random.normal((ROWS_THRESHOLD[bits] + 40, 576))
    via_wrapper = quantized_matmul(big, w, s, b, group_size=32, bits=bits)
    assert mx.array_equal(via_wrapper, _qmm(big, w, s, b, 32, bits)).item()
    _check_int8(via_wrapper, big, dense)


@needs_vnni
def test_int8_modes() -> None:
    w, s, b, dense = _quantized(64, 576, 4, 32, mx.float16)
    x = mx.random.normal((16, 576))
    assert set_int8_activations("many-rows") == int8_activations() == "many-rows"
    # A graph computes with the mode it was built under.
    built = _qmm(x, w, s, b, 32, 4)
    set_int8_activations("off")
    _check_int8(built, x, dense)
    _check(_qmm(x, w, s, b, 32, 4), x, dense)
    with pytest.raises(ValueError, match="int8 mode"):
        set_int8_activations("sometimes")
    ext = _ext()
    ext.force_generic(True)  # type: ignore[attr-defined]
    try:
        assert set_int8_activations("every-row") == "off"  # the portable kernels have none
    finally:
        ext.force_generic(False)  # type: ignore[attr-defined]
    assert set_int8_activations("every-row") == "every-row"


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
def test_a_prompt_pass_takes_int8_at_any_row_count(bits: int) -> None:
    """Under many-rows, a prompt token's activations do not follow the rows read with it: 3
    rows read as a prompt get the bits they get among 16 (issue 40: a prompt suffix after a
    cache hit computed in float32, the same prompt read whole in int8)."""
    w, s, b, dense = _quantized(1536, 576, bits, 32, mx.float16)
    x = mx.random.normal((16, 576))
    set_int8_activations("many-rows")

    def qmm(rows: mx.array) -> mx.array:
        return quantized_matmul(rows, w, s, b, group_size=32, bits=bits)

    full = qmm(x)
    plain = qmm(x[:3])
    _check(plain, x[:3], dense)  # float32 outside a prompt pass
    with prompt_pass():
        assert mx.array_equal(qmm(x[:3]), full[:3]).item()
        # A decode batch's step inside says how many rows decide: 3 rows, float32.
        with int8_like_rows(3):
            _check(qmm(x), x, dense)
        assert mx.array_equal(qmm(x[:1]), full[:1]).item()  # restored on exit
    assert mx.array_equal(qmm(x[:3]), plain).item()
    # The other modes decide for every row alike: a prompt pass changes nothing under "off".
    set_int8_activations("off")
    with prompt_pass():
        _check(qmm(x), x, dense)


@needs_vnni
def test_batch_invariant_finds_int8_layers_row_invariant() -> None:
    """--batch-invariant runs with int8 at every row count: quantised layers need no padding."""
    import mlx.nn as nn

    from mlxcel.actors.model_runner import invariance
    from mlxcel.native.layers import install

    layer = nn.QuantizedLinear(576, 1536, bias=False, group_size=32, bits=4)
    install(layer)
    set_int8_activations("every-row")
    assert invariance._floor(layer, "linear", 64) == 1
    set_int8_activations("off")  # float32: the tiles and the rows kernel sum in other orders
    assert invariance._floor(layer, "linear", 64) != 1


# A fixed English passage: what the int8 model is scored on.
PASSAGE = (
    "The river ran high that spring, fed by snow from the northern hills. In the village, the "
    "miller watched the water climb the stones of his wheel-house and wondered whether the old "
    "dam would hold. His daughter, who kept the accounts, had warned him in the autumn that "
    "the timbers were rotten, but repairs cost money, and money had been scarce since the "
    "harvest failed. Now the whole valley depended on a wall of wet oak and hope. At dusk the "
    "neighbours came with lanterns and sandbags, and together they worked through the night, "
    "passing sacks from hand to hand while the rain drummed on their hoods."
)


@pytest.mark.slow
@needs_vnni
def test_default_model_with_int8_activations() -> None:
    """The default model with int8 activations reads a passage as float32 does: the next-token
    distributions barely move (mean KL), the likeliest token is mostly the same, and the
    passage is no less likely (measured: KL 3e-3, 96% of top tokens, loss within 0.01)."""
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    resolved = resolve_model(None)
    reference = load_model(resolved, native=False)
    quantized = load_model(resolved)
    tokens = reference.tokenizer.encode(PASSAGE)
    assert len(tokens) > 100
    x = mx.array([tokens])

    def log_probs(model: Any) -> mx.array:
        logits = model(x).astype(mx.float32)[0]
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    want = log_probs(reference.model)
    set_int8_activations(None)  # the default: a prompt this long is read with int8
    got = log_probs(quantized.model)
    kl = (mx.exp(want) * (want - got)).sum(axis=-1)
    same_top = (mx.argmax(want, -1) == mx.argmax(got, -1)).astype(mx.float32).mean().item()
    nxt = mx.array(tokens[1:])[:, None]
    loss_want = -mx.take_along_axis(want[:-1], nxt, -1).mean().item()
    loss_got = -mx.take_along_axis(got[:-1], nxt, -1).mean().item()
    assert kl.mean().item() < 1e-2, kl.mean().item()
    assert same_top >= 0.9, same_top
    assert abs(loss_got - loss_want) < 0.05, (loss_got, loss_want)
    assert kl.max().item() > 1e-6  # int8 was in force: the distributions did move

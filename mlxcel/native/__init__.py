"""Fast CPU matmuls for quantised and bfloat16 weights, and RMSNorm and RoPE as one graph node
each: an mlx C++ extension (``_ext``).

mlx's CPU kernels for anything but float32 are 4-40x slower than OpenBLAS float32, so on the CPU
mlxcel dequantises models to float32 and one decode stream reads ~4x more bytes per step than
the quantised weights hold. ``quantized_matmul`` and ``bf16_matmul`` here dequantise or widen
the weights in registers (AVX-512, or AVX2 with FMA and F16C on CPUs without it: chosen at run
time, ``kernel_isa()``) and compute in float32, with mlx's own semantics, as graph nodes on
mlx's CPU stream; on CPUs with AVX512-VNNI, quantised weights meet activations quantised to
int8 instead (``INT8_MODES`` below). ``MLXCEL_NATIVE_ISA`` (``avx512``, ``avx2``, ``generic``;
read once, at import) caps the instruction set, to run the AVX2 kernels on an AVX-512 CPU.

``kquant_matmul`` multiplies by a matrix held as GGUF's K-quant blocks (Q4_K or Q6_K,
``kquants``), decoded in registers the same way, so a Q4_K_M file's matrices keep their 4.5 and
6.56 bits a weight.

``rms_norm`` and ``rope`` are ``mx.fast.rms_norm`` and ``mx.fast.rope`` for float32 on the CPU,
where mlx has no kernels for them and builds ~11 and ~29 graph nodes instead; likewise
``attention`` for ``mx.fast.scaled_dot_product_attention`` and ``silu_mul`` for SwiGLU
(src/row_ops.h).

``available()`` says whether the extension runs here (``reason()`` says why not); when it
does not, both functions compute the same result with mlx ops, so callers need not care. The
extension is built by ``python -m mlxcel.native`` (``tools/setup.sh`` runs it).

Threads: calls of >= 512k multiply-adds (``MLXCEL_NATIVE_THREAD_MIN_MACS``) split their output
columns over a small persistent pool, one thread per physical core (``MLXCEL_NATIVE_THREADS``
overrides); idle workers poll for ``MLXCEL_NATIVE_SPIN_US`` (50) microseconds, then sleep.
Smaller calls run on mlx's stream thread alone: on 2 cores a second worker competes with mlx's
main thread, which encodes the graph while the stream computes (see src/ops.cpp).

This package imports ``mlx.core`` itself, not through ``mlxcel.models.mlx_setup``: the model
loader is meant to import it, and importing the loader's package back would be a cycle. Import
``mlxcel.models`` first (it preloads OpenBLAS), as every mlxcel entry point does.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType

import mlx.core as mx

from mlxcel.native import kquants

__all__ = [
    "BF16_ROWS_THRESHOLD",
    "INT8_MODES",
    "ROWS_THRESHOLD",
    "available",
    "bf16_matmul",
    "attention",
    "int8_activations",
    "int8_like_rows",
    "kernel_isa",
    "kquant_matmul",
    "prompt_pass",
    "quantized_matmul",
    "reason",
    "rms_norm",
    "rope",
    "set_int8_activations",
    "silu_mul",
]

# With int8 activations off: above this many rows (prefill chunks) the wrappers dequantise to
# float32 and let OpenBLAS do the matmul: once there are enough rows to pay for dequantising
# the whole matrix per call, OpenBLAS's GEMM beats our rows kernel. Measured here (2 cores, AMD
# EPYC Zen 4, g32 float16 scales, `tools/bench/kernels.py --rows 128 256 512`), median ms ours
# vs dequantise + OpenBLAS:
#   4-bit 576->1536:  128 rows 1.48 vs 2.96; 256 rows 2.74 vs 4.04; 512 rows 5.14 vs 6.24
#   4-bit 1536->576:  128 rows 1.93 vs 4.07; 256 rows 3.39 vs 4.08; 512 rows 6.85 vs 6.40
#   4-bit 576->576:   128 rows 0.99 vs 1.71; 256 rows 2.04 vs 2.58; 512 rows 3.91 vs 2.66
#   8-bit 1536->576:  128 rows 3.08 vs 4.07; 256 rows 6.25 vs 4.08
# so 4-bit crosses over between 256 and 512 rows, 8-bit between 128 and 256.
ROWS_THRESHOLD = {4: 256, 8: 128}
# bfloat16 takes the same rows kernel (widening instead of dequantising). Against widening to
# float32 + OpenBLAS, ms (a loop around _ext.bf16_matmul, 20 matrices a round, best of 3):
#   576->1536: 128 rows 2.85 vs 6.66; 256 rows 8.62 vs 7.05; 512 rows 11.5 vs 11.4
#   1536->576: 128 rows 2.66 vs 4.48; 256 rows 5.12 vs 5.84; 512 rows 11.4 vs 10.5
BF16_ROWS_THRESHOLD = 128


def _load() -> tuple[ModuleType | None, str]:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        where = f"{sys.platform} {platform.machine()}"
        return None, f"mlxcel native kernels are for Linux x86-64, not {where}"
    cap = os.environ.get("MLXCEL_NATIVE_ISA")
    if cap is not None and cap not in ("avx512", "avx2", "generic"):
        # The extension reads it too and ignores what it does not know: say so here.
        logging.getLogger(__name__).warning(
            "MLXCEL_NATIVE_ISA=%r is not avx512, avx2 or generic: ignored", cap
        )
    try:
        from mlxcel.native import _ext
    except ImportError as exc:
        return None, f"mlxcel native kernels are not built ({exc}); run: python -m mlxcel.native"
    try:
        # Builds a graph node only (nothing is evaluated). A module built against another mlx
        # or nanobind imports fine but cannot take mx.array arguments.
        _ext.bf16_matmul(mx.zeros((1, 16)), mx.zeros((1, 16), dtype=mx.bfloat16))
    except TypeError:
        return None, (
            "mlxcel native kernels were built against another mlx or nanobind; "
            "rebuild: python -m mlxcel.native --force"
        )
    if _ext.kernel_isa() not in ("avx512", "avx2"):
        return None, (
            "this CPU lacks AVX2 with FMA and F16C (and AVX-512), or MLXCEL_NATIVE_ISA=generic "
            "asks for the portable kernels: mlx's own kernels are used"
        )
    return _ext, ""


_EXT, _LOAD_REASON = _load()

# Int8 activations (``src/kernels_vnni.cpp``, CPUs with AVX512-VNNI): each row of x quantised
# per 32 inputs to int8, as llama.cpp does for its quantised dot products, and multiplied
# with the stored 4/8-bit weights in integers: 1.2-2x the float kernels from 12 rows on
# (decode batches, prompts); logits move by ~1e-2 (docs/performance.md).
#   "many-rows" (the default): from 12 rows on; fewer rows compute in float32. Rounding each
#     layer's input turns last-bit differences (a row's attention over a padded batch cache)
#     into differences of the rounding's size, so small batches, where interactive and
#     realtime use lives and where a seeded answer is promised its solo text beside others
#     (docs/reference/http-api.md#seeds), keep float32's numerics.
#   "every-row": at every row count (as fast below 12 rows: forward pass 23 ms at 1 row
#     either way). Both int8 kernels give a row the same bits at any count, which
#     --batch-invariant relies on (its attention is per row, so nothing else differs).
#   "off": float32 everywhere (logits equal the float32 model's up to summation order).
# MLXCEL_NATIVE_INT8 (off / many-rows / every-row; 0 means off) sets the default.
INT8_MODES = ("off", "many-rows", "every-row")


def _int8_default() -> str:
    value = os.environ.get("MLXCEL_NATIVE_INT8", "many-rows")
    value = {"0": "off", "1": "many-rows"}.get(value, value)
    return value if value in INT8_MODES else "many-rows"


def set_int8_activations(mode: str | None = None) -> str:
    """Choose which quantised matmuls take int8 activations (``INT8_MODES``; None: the
    default, ``MLXCEL_NATIVE_INT8``); returns the mode in force ("off" where unsupported).
    Process-wide; graphs already built keep the mode they were built with."""
    wanted = _int8_default() if mode is None else mode
    if wanted not in INT8_MODES:
        raise ValueError(f"int8 mode must be one of {INT8_MODES}, not {mode!r}")
    global _INT8
    _INT8 = (
        "off" if _EXT is None else INT8_MODES[_EXT.set_int8_activations(INT8_MODES.index(wanted))]
    )
    return _INT8


def int8_activations() -> str:
    """The int8 mode in force (see ``INT8_MODES``)."""
    return _INT8


# From how many rows `many-rows` takes int8 activations (kRowsKernelMin in src/kernels.h).
INT8_ROWS_MIN = 12

# Per thread: the row count `many-rows` judges this thread's quantised matmuls by, in place of
# each call's own (None: the call's). Graphs are built on the thread that runs the model, so a
# thread of its own per model (router mode) keeps its own.
_judged = threading.local()


@contextmanager
def int8_like_rows(rows: int) -> Iterator[None]:
    """Quantised matmuls built on this thread within take int8 activations or not as a call of
    ``rows`` rows would under the default ``many-rows`` mode, whatever their own row count (the
    other modes decide for every row alike and are left as they are).

    Why: under ``many-rows`` a row's numerics follow the row count of the call that computes
    it, and so what else the call holds: a prompt suffix of 11 tokens after a prompt-cache hit
    computed in float32, the whole prompt read fresh in int8 (logits ~6e-2 apart, a seeded
    answer another text); a row decoding beside a neighbour that verifies a proposal of 5
    tokens computed in int8, the same row beside a plain one in float32. The caller names the
    count that should decide: ``prompt_pass`` for prompts, a decode batch's rows for its steps
    (docs/reference/http-api.md#seeds). Nests; restored on exit."""
    before = getattr(_judged, "rows", None)
    _judged.rows = rows
    try:
        yield
    finally:
        _judged.rows = before


def prompt_pass() -> AbstractContextManager[None]:
    """Quantised matmuls built within read a prompt: int8 activations at every row count (under
    ``many-rows``), so a prompt token's KV is the same whether it was read alone, beside other
    prompts, after a prompt-cache hit or in any chunk size (the int8 kernels give a row the
    same bits at any count)."""
    return int8_like_rows(sys.maxsize)


def _node_int8() -> int:
    """The int8 mode for a quantised matmul built now on this thread: the index of a mode in
    ``INT8_MODES``, or -1 for the process's."""
    rows = getattr(_judged, "rows", None)
    if rows is None or _INT8 != "many-rows":
        return -1
    return INT8_MODES.index("every-row" if rows >= INT8_ROWS_MIN else "off")


_INT8 = "off"
set_int8_activations()


def kernel_isa() -> str:
    """The instruction set the kernels run with here: "avx512" or "avx2"; "" when they do not
    load (``reason()``)."""
    return "" if _EXT is None else _EXT.kernel_isa()


def reason() -> str:
    """One line saying why the kernels are not used here; empty when they are."""
    if _LOAD_REASON:
        return _LOAD_REASON
    if mx.default_device() != mx.cpu:
        return f"mlx's default device is {mx.default_device()}, not the CPU"
    return ""


def available() -> bool:
    """Whether quantized_matmul and bf16_matmul run the native kernels for float32 inputs."""
    return not reason()


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
) -> mx.array:
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)`` computed in float32.

    ``w``, ``scales``, ``biases`` are as ``mx.quantize`` makes them (affine mode; scales and
    biases float32, float16 or bfloat16). Float32 ``x`` [..., K] gives float32 [..., N]."""
    # With int8 activations the kernels stay ahead at any row count (3-4x dequantise +
    # OpenBLAS at 1024 rows), so prompts of any chunk size are read on them too.
    native_rows = _INT8 != "off" or _rows(x) <= ROWS_THRESHOLD.get(bits, 0)
    if x.dtype == mx.float32 and native_rows and available():
        assert _EXT is not None
        out: mx.array = _EXT.quantized_matmul(
            x, w, scales, biases, group_size=group_size, bits=bits, int8=_node_int8()
        )
        return out
    # float32 scales, so that neither path rounds a dequantised weight to 16 bits.
    scales = scales.astype(mx.float32)
    biases = biases.astype(mx.float32)
    if x.dtype == mx.float32 and not native_rows:
        weight = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
        return x @ weight.T
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=True, group_size=group_size, bits=bits
    )


def bf16_matmul(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T`` for bfloat16 ``w`` [N, K], computed in float32 (float32 ``x`` [..., K])."""
    if x.dtype == mx.float32 and _rows(x) <= BF16_ROWS_THRESHOLD and available():
        assert _EXT is not None
        out: mx.array = _EXT.bf16_matmul(x, w)
        return out
    return x @ w.astype(mx.float32).T


def kquant_matmul(x: mx.array, blocks: mx.array, fmt: str) -> mx.array:
    """``x @ W.T`` for ``W`` [N, K] held as GGUF's blocks of the K-quant format ``fmt``
    (``"q4_k"``: uint8 [N, K / 256 * 144], ``"q6_k"``: [N, K / 256 * 210]; ``kquants``),
    computed in float32 (float32 ``x`` [..., K]). The native kernel at every row count:
    dequantising with mlx ops and multiplying with OpenBLAS was 2-7x slower from 1 to 512 rows
    (Q6_K, 2048x8192 and 512x2048, 2 cores)."""
    if x.dtype == mx.float32 and available():
        assert _EXT is not None
        # The same per-thread int8 choice as quantized_matmul (prompt passes, seeded rows):
        # a K-quant layer's numerics follow the same rules as an affine one's.
        out: mx.array = _EXT.kquant_matmul(x, blocks, format=fmt, int8=_node_int8())
        return out
    return x @ kquants.dequantize(blocks, fmt).astype(x.dtype).T


def rms_norm(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, w, eps)``: one native node for float32 on the CPU."""
    if x.dtype == mx.float32 and w.dtype == mx.float32 and available():
        assert _EXT is not None
        out: mx.array = _EXT.rms_norm(x, w, eps)
        return out
    return mx.fast.rms_norm(x, w, eps)


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
) -> mx.array:
    """``mx.fast.rope(...)``: one native node for float32 on the CPU (``offset`` an int, or an
    integer array with one entry or one per batch entry)."""
    if x.dtype == mx.float32 and x.ndim >= 3 and available():
        assert _EXT is not None
        off = offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)
        if off.dtype != mx.int32:
            off = off.astype(mx.int32)
        if freqs is not None and freqs.dtype != mx.float32:
            freqs = freqs.astype(mx.float32)
        out: mx.array = _EXT.rope(
            x,
            dims,
            traditional=traditional,
            base=1.0 if base is None else base,
            scale=scale,
            offset=off,
            freqs=freqs,
        )
        return out
    return mx.fast.rope(
        x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
    )


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None,
) -> mx.array | None:
    """``mx.fast.scaled_dot_product_attention`` as one native node, or None where it does not
    apply (not float32, an unknown mask, the kernels unavailable): the caller then takes its
    own path. ``mask``: None, ``"causal"`` (bottom-right aligned), or bool (keep) / float32
    (added) broadcastable to ``[B, H, Lq, S]``. Keys a mask drops are skipped, so a row of a
    left-padded batch gets exactly the bits it gets alone."""
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        return None
    array_mask = None if isinstance(mask, str) else mask
    if (
        queries.ndim != 4
        or keys.ndim != 4
        or values.ndim != 4
        or not all(a.dtype == mx.float32 for a in (queries, keys, values))
        or (causal and queries.shape[2] > keys.shape[2])
        or (
            array_mask is not None
            and (array_mask.dtype not in (mx.bool_, mx.float32) or array_mask.ndim > 4)
        )
        or not available()
    ):
        return None
    assert _EXT is not None
    out: mx.array = _EXT.attention(
        queries, keys, values, scale=scale, causal=causal, mask=array_mask
    )
    return out


def silu_mul(gate: mx.array, x: mx.array) -> mx.array | None:
    """SwiGLU's ``gate * sigmoid(gate) * x`` as one native node, or None where it does not
    apply (not float32 arrays of one shape, the kernels unavailable)."""
    if (
        gate.dtype != mx.float32
        or x.dtype != mx.float32
        or gate.shape != x.shape
        or not available()
    ):
        return None
    assert _EXT is not None
    out: mx.array = _EXT.silu_mul(gate, x)
    return out

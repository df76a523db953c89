"""Matmul kernels at SmolLM2-135M's shapes: OpenBLAS float32 vs mlx's quantized_matmul vs ours.

    PYTHONPATH=. .venv/bin/python tools/bench/kernels.py [--rounds 7]

For each [K -> N] projection and row count, ms per call (a batch of calls per mx.eval, as in a
decode step, so one eval's overhead is spread) and GFLOP/s for: float32 ``x @ W.T``
(OpenBLAS), mlx ``quantized_matmul`` 4-bit g32, dequantise + float32 matmul (the wrappers' path
above ROWS_THRESHOLD), and ours (``mlxcel.native._ext``: 4-bit g32 and 8-bit g32 with float16
scales, as GGUF Q4_1 / Q8_0 convert, and bfloat16). Variants are interleaved round by round and
each figure is the median. Ratios are float32's time over the variant's (>1: faster). Ends with
a decode-step estimate: 30 layers' projections plus the lm_head, at 1 and 16 rows, and the
default model's measured decode step, float32 vs kept 4-bit on our kernels (``--decode-only``
runs just that).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from mlxcel.models.mlx_setup import mx
from mlxcel.native import _ext

# (K, N): q and o, k and v, gate and up, down, lm_head.
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
PER_LAYER = {(576, 576): 2, (576, 192): 2, (576, 1536): 2, (1536, 576): 1}
LAYERS = 30
ROWS = [1, 4, 8, 16, 32, 64, 128]
VARIANTS = ["f32", "mlx_q4", "deq_f32", "ours_q4", "ours_q8", "ours_bf16"]
# ROWS above mlxcel.native.ROWS_THRESHOLD go to dequantise + float32 in the wrappers; the
# ours_* columns call the kernels directly at every row count.


def _timed(fn: Callable[[], mx.array], calls: int) -> float:
    # OpenBLAS's idle threads spin for ~0.1 s after a call (OPENBLAS_THREAD_TIMEOUT), taking
    # a core from whatever runs next: each variant starts on a quiet machine.
    time.sleep(0.15)
    start = time.perf_counter()
    mx.eval([fn() for _ in range(calls)])
    return (time.perf_counter() - start) / calls * 1e3


class Weights:
    """One weight matrix in every format the variants read."""

    def __init__(self, k: int, n: int) -> None:
        self.f32 = mx.random.normal((n, k)) * 0.05
        self.w4, s4, b4 = mx.quantize(self.f32, group_size=32, bits=4)
        self.w8, s8, b8 = mx.quantize(self.f32, group_size=32, bits=8)
        self.s4, self.b4, self.s8, self.b8 = (a.astype(mx.float16) for a in (s4, b4, s8, b8))
        self.bf16 = self.f32.astype(mx.bfloat16)
        mx.eval(self.f32, self.w4, self.s4, self.b4, self.w8, self.s8, self.b8, self.bf16)


def measure(k: int, n: int, rows: int, rounds: int) -> dict[str, float]:
    # A model's weights (538 MB in float32) do not fit the 32 MB L3; one matrix called again
    # and again would. So calls cycle through copies worth >= 96 MB of float32.
    copies = [Weights(k, n) for _ in range(max(1, -(-96 * 2**20 // (4 * k * n))))]
    x = mx.random.normal((rows, k))
    mx.eval(x)
    turn = iter(range(1 << 62))

    def pick() -> Weights:
        return copies[next(turn) % len(copies)]

    def deq(w: Weights) -> mx.array:
        s, b = w.s4.astype(mx.float32), w.b4.astype(mx.float32)
        return x @ mx.dequantize(w.w4, s, b, group_size=32, bits=4).T

    def mlx_q4(w: Weights) -> mx.array:
        return mx.quantized_matmul(x, w.w4, w.s4, w.b4, group_size=32, bits=4)

    def ours_q4(w: Weights) -> mx.array:
        return _ext.quantized_matmul(x, w.w4, w.s4, w.b4, group_size=32, bits=4)

    def ours_q8(w: Weights) -> mx.array:
        return _ext.quantized_matmul(x, w.w8, w.s8, w.b8, group_size=32, bits=8)

    fns: dict[str, Callable[[], mx.array]] = {
        "f32": lambda: x @ pick().f32.T,
        "mlx_q4": lambda: mlx_q4(pick()),
        "deq_f32": lambda: deq(pick()),
        "ours_q4": lambda: ours_q4(pick()),
        "ours_q8": lambda: ours_q8(pick()),
        "ours_bf16": lambda: _ext.bf16_matmul(x, pick().bf16),
    }
    # Enough calls per eval for ~2 ms of float32 work, at most 32.
    calls = max(1, min(32, int(2e6 / max(1, k * n * rows // 50))))
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for name in VARIANTS:
        _timed(fns[name], calls)  # warm-up
    for _ in range(rounds):
        for name in VARIANTS:
            samples[name].append(_timed(fns[name], calls))
    return {name: statistics.median(s) for name, s in samples.items()}


def decode_step(rounds: int) -> None:
    """One stream's decode step on the default model: float32 vs kept 4-bit on our kernels."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model
    from mlxcel.native.check import install

    resolved = resolve_model(None)
    reference = load_model(resolved)
    quantized = load_model(resolved, keep_quantized=True)
    install(quantized.model)
    prompt = mx.array([reference.tokenizer.encode("Write a short story about a robot.")])

    def median_step(model: object, steps: int = 40) -> float:
        cache = make_prompt_cache(model)
        token = mx.argmax(model(prompt, cache=cache)[:, -1:], axis=-1)  # type: ignore[operator]
        mx.eval(token)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)  # type: ignore[operator]
            mx.eval(token)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    f32: list[float] = []
    q4: list[float] = []
    for _ in range(rounds):
        time.sleep(0.15)
        f32.append(median_step(reference.model))
        time.sleep(0.15)
        q4.append(median_step(quantized.model))
    a, b = statistics.median(f32), statistics.median(q4)
    print(
        f"measured decode step, 1 stream: float32 {a:.1f} ms ({1e3 / a:.1f} tok/s), "
        f"4-bit on ours {b:.1f} ms ({1e3 / b:.1f} tok/s): {a / b:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--decode-only", action="store_true", help="only the default model's decode step"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS, help="row counts to measure")
    parser.add_argument(
        "--shapes", nargs="+", help="K:N pairs (default: every SmolLM2-135M projection)"
    )
    args = parser.parse_args()
    shapes = [tuple(map(int, p.split(":"))) for p in args.shapes] if args.shapes else SHAPES
    if args.decode_only:
        decode_step(args.rounds)
        return
    print(f"threads: {_ext.pool_threads()}, kernels: {_ext.kernel_isa()}")
    header = "shape K->N     rows " + " ".join(f"{v:>16}" for v in VARIANTS)
    print(header + "    (ms per call, GFLOP/s; ratio = f32 ms / variant ms)")
    results: dict[tuple[int, int, int], dict[str, float]] = {}
    for k, n in shapes:
        for rows in args.rows:
            ms = measure(k, n, rows, args.rounds)
            results[(k, n, rows)] = ms
            flops = 2.0 * k * n * rows
            cells = [f"{ms[v]:7.3f} {flops / ms[v] / 1e6:7.1f}" for v in VARIANTS]
            ratios = " ".join(f"{ms['f32'] / ms[v]:5.2f}x" for v in VARIANTS[1:])
            print(f"{k:5d}->{n:<6d} {rows:5d} " + " ".join(f"{c:>16}" for c in cells))
            print(f"{'':18}ratios vs f32 ({', '.join(VARIANTS[1:])}): {ratios}")
    if set(shapes) != set(SHAPES) or not {1, 16} <= set(args.rows):
        return
    print("\ndecode-step estimate (30 layers' 7 projections + lm_head), ms:")
    for rows in (1, 16):
        totals = {
            v: LAYERS * sum(c * results[(k, n, rows)][v] for (k, n), c in PER_LAYER.items())
            + results[(576, 49152, rows)][v]
            for v in VARIANTS
        }
        line = "  ".join(f"{v} {t:7.2f} ({totals['f32'] / t:4.2f}x)" for v, t in totals.items())
        print(f"  rows {rows:2d}: {line}")
    decode_step(3)


if __name__ == "__main__":
    main()

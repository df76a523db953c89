"""Where one all-MiniLM-L6-v2 encoder layer spends its time, op by op (not a test).

    .venv/bin/python tools/bench/embeddings_profile.py [--tokens 16] [--batch 32]

Each step is evaluated on its own (``mx.eval`` boundaries), repeated, and reported as the best
wall time and the best process CPU time of the repeats. On a shared machine the CPU time is the
steadier figure for single-threaded ops (mlx's CPU elementwise kernels); for the matmuls it also
counts OpenBLAS's second thread, so wall time is the one to read there. ``torch`` figures for
the same shapes come from ``--st-python`` (a venv with torch), when given.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Callable
from typing import Any

import mlxcel.models  # noqa: F401  isort: skip  (OpenBLAS before mlx)

from mlxcel.models import fast_math
from mlxcel.models.embedding import load_embedder, resolve_embedding_model
from mlxcel.models.mlx_setup import mx

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TORCH = r"""
import sys, time, torch
import torch.nn.functional as F
b, n, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
d, f, h = 384, 1536, 12
x, hid = torch.randn(b, n, d), torch.randn(b, n, f)
wd, wi, wo = torch.randn(d, d), torch.randn(f, d), torch.randn(d, f)
bd, bi = torch.zeros(d), torch.zeros(f)
q = torch.randn(b, h, n, d // h)
mask = torch.zeros(b, 1, 1, n)
steps = [("linear 384->384", lambda: F.linear(x, wd, bd)),
         ("attention (sdpa)", lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask)),
         ("add + LayerNorm", lambda: F.layer_norm(x + x, (d,))),
         ("linear 384->1536", lambda: F.linear(x, wi, bi)),
         ("gelu (erf)", lambda: F.gelu(hid)),
         ("linear 1536->384", lambda: F.linear(hid, wo, bd))]
with torch.inference_mode():
    for name, fn in steps:
        fn()
        best = 1e9
        for _ in range(reps):
            t = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t)
        print(f"{name}\t{best * 1e3:.2f}")
"""


def best_of(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    mx.eval(fn())
    wall = cpu = float("inf")
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        mx.eval(fn())
        wall = min(wall, time.perf_counter() - t)
        cpu = min(cpu, time.process_time() - c)
    return wall * 1e3, cpu * 1e3


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--st-python", default="")
    args = p.parse_args()
    model = load_embedder(resolve_embedding_model(MODEL), role="embedding")._model
    b, n = args.batch, args.tokens
    ids = mx.random.randint(1000, 2000, (b, n))
    types = mx.zeros((b, n), mx.int32)
    ones = mx.ones((b, n), mx.int32)
    mask = mx.zeros((b, 1, 1, n))
    x = model.embeddings(ids, types)
    mx.eval(x, mask)
    layer = model.encoder.layer[0]
    attn = layer.attention.attn
    d, h = x.shape[-1], attn.heads

    def heads(t: Any) -> Any:
        return t.reshape(b, n, h, d // h).transpose(0, 2, 1, 3)

    q = heads(attn.query(x))
    ctx = fast_math.attention(q, q, q, scale=(d // h) ** -0.5, mask=mask)
    a = layer.attention.output(ctx.transpose(0, 2, 1, 3).reshape(b, n, d), x)
    inter = layer.intermediate.dense(a)
    act = layer.intermediate._act(inter)
    mx.eval(q, ctx, a, inter, act)
    steps: list[tuple[str, int, Callable[[], Any]]] = [
        ("linear 384->384 (q, k, v, out)", 4, lambda: attn.query(x)),
        (
            "attention (sdpa, mlx's own: for comparison, not used)",
            0,
            lambda: mx.fast.scaled_dot_product_attention(
                q, q, q, scale=(d // h) ** -0.5, mask=mask
            ),
        ),
        (
            "attention (sdpa, fast_math: vectorised exp)",
            1,
            lambda: fast_math.attention(q, q, q, scale=(d // h) ** -0.5, mask=mask),
        ),
        ("split/merge heads (copies)", 2, lambda: mx.contiguous(heads(x))),
        (
            "add + LayerNorm (fast_math, BLAS means)",
            2,
            lambda: layer.attention.output.LayerNorm(a + x),
        ),
        ("linear 384->1536", 1, lambda: layer.intermediate.dense(a)),
        ("gelu (erf, fast_math)", 1, lambda: layer.intermediate._act(inter)),
        ("linear 1536->384", 1, lambda: layer.output.dense(act)),
    ]
    torch_ms: dict[str, str] = {}
    if args.st_python:
        out = subprocess.run(
            [args.st_python, "-c", TORCH, str(b), str(n), str(args.reps)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        torch_ms = dict(line.split("\t") for line in out.splitlines() if "\t" in line)
    print(f"one layer, batch {b} x {n} tokens (best of {args.reps})")
    print("| step | times per layer | mlx wall ms | mlx CPU ms | torch wall ms |")
    print("|---|---|---|---|---|")
    total = 0.0
    for name, count, fn in steps:
        wall, cpu = best_of(fn, args.reps)
        total += wall * count
        key = next((k for k in torch_ms if name.startswith(k.split(" (")[0])), "")
        print(f"| {name} | {count} | {wall:.2f} | {cpu:.2f} | {torch_ms.get(key, '-')} |")
    wall, cpu = best_of(lambda: layer(x, mask), args.reps)
    print(f"| whole layer | 1 | {wall:.2f} | {cpu:.2f} | |")
    print(f"sum of steps x count: {total:.1f} ms")
    wall, _ = best_of(lambda: model(ids, types, ones), max(3, args.reps // 4))
    print(f"whole encoder (6 layers): {wall:.0f} ms -> {b / wall * 1e3:.0f} sentences/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

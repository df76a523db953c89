"""llama-server's command line, as launch scripts write it for llama.cpp.

Scripts pass llama.cpp's one-dash multi-letter flags (``-ngl 99``, ``-fa on``, ``-ctk f16``)
and flags for things MLX decides by itself (GPU layers, flash attention, mmap). argparse
would read ``-ngl 99`` as ``-n gl`` and ``-t 8`` as an abbreviation of ``-to``, so the short
forms are rewritten to their long names first, abbreviations are off, and the GGML flags are
accepted here, hidden from ``--help``: a value that asks for nothing MLX does not already do is
accepted, one that asks for something else stops the server with the reason.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# llama.cpp's one-dash multi-letter spellings -> their long names.
SHORT_FORMS = {
    "-ngl": "--n-gpu-layers",
    "-fa": "--flash-attn",
    "-ctk": "--cache-type-k",
    "-ctv": "--cache-type-v",
    "-ub": "--ubatch-size",
    "-tb": "--threads-batch",
    "-cb": "--cont-batching",
    "-nocb": "--no-cont-batching",
    "-md": "--model-draft",
}
# KV cache types that ask for the cache MLX keeps (unquantised).
PLAIN_KV = ("f16", "fp16", "f32", "bf16")


def rewrite(argv: Sequence[str]) -> list[str]:
    """``-ngl 99`` and ``-ngl=99`` -> ``--n-gpu-layers 99``; everything else as given."""
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if flag in SHORT_FORMS:
            arg = SHORT_FORMS[flag] + eq + value
        out.append(arg)
    return out


def add_flags(p: argparse.ArgumentParser) -> None:
    hidden = argparse.SUPPRESS
    p.add_argument(
        "-t",
        "--threads",
        type=int,
        default=-1,
        help="threads per matmul (OpenBLAS on Linux); -1: one per core",
    )
    p.add_argument("--threads-batch", type=int, default=-1, help=hidden)
    p.add_argument("--n-gpu-layers", "--gpu-layers", default=None, help=hidden)
    p.add_argument("--flash-attn", default="auto", help=hidden)
    p.add_argument("--cache-type-k", default="f16", help=hidden)
    p.add_argument("--cache-type-v", default="f16", help=hidden)
    p.add_argument("-b", "--batch-size", type=int, default=None, help=hidden)
    p.add_argument("--ubatch-size", type=int, default=None, help=hidden)
    p.add_argument("--cont-batching", action="store_true", help=hidden)
    p.add_argument("--no-cont-batching", action="store_true", help=hidden)
    p.add_argument("--jinja", action="store_true", help=hidden)
    p.add_argument("--no-jinja", action="store_true", help=hidden)
    p.add_argument("--mmap", action="store_true", help=hidden)
    p.add_argument("--no-mmap", action="store_true", help=hidden)
    p.add_argument("--mlock", action="store_true", help=hidden)


def check(args: argparse.Namespace) -> list[str]:
    """Stop on a GGML flag that asks for what MLX does not do; return notes for the log."""
    refused = []
    if args.threads_batch not in (-1, args.threads):
        refused.append("--threads-batch: one thread count serves prompts and decoding here (-t)")
    for flag, value in (
        ("--cache-type-k", args.cache_type_k),
        ("--cache-type-v", args.cache_type_v),
    ):
        if value not in PLAIN_KV:
            refused.append(f"{flag} {value}: the KV cache is not quantised here")
    if args.no_cont_batching:
        refused.append("--no-cont-batching: requests are always batched here")
    if args.no_jinja:
        refused.append("--no-jinja: chat templates are always rendered with Jinja here")
    if args.mlock:
        refused.append("--mlock: MLX keeps the weights in its own buffers; nothing to lock")
    if args.flash_attn not in ("on", "off", "auto", "1", "0", "true", "false"):
        refused.append(f"--flash-attn {args.flash_attn}: expected on, off or auto")
    if refused:
        raise SystemExit("error: " + "; ".join(refused))
    notes = []
    if args.n_gpu_layers is not None:
        notes.append(
            f"--n-gpu-layers {args.n_gpu_layers}: MLX runs the whole model on its default "
            "device (Metal on Apple silicon, CUDA with mlxcel's cuda12/cuda13 extra on an "
            "NVIDIA GPU, the CPU elsewhere)"
        )
    if args.ubatch_size is not None:
        notes.append("--ubatch-size: ignored (prompts are read in --prefill-chunk-size chunks)")
    return notes

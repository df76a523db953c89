#!/usr/bin/env python
"""Slot save/restore and context shift: what they cost, and what saving costs the other slots.

Starts ``mlxcel serve`` on the default model (or ``--model``) twice:

1. ``-np 2 --slot-save-path TMP``: reads a ``--words``-long prompt in slot 0, then, while slot 1
   streams ``--tokens`` tokens, saves slot 0. Prints ``save_ms``, the file's size, ``restore_ms``,
   and slot 1's gaps between tokens (median, and the largest: the one the save may stretch).
2. ``-np 1 -c CTX --context-shift``: the decode rate of a request that stays inside the context
   against one that shifts it several times; the difference per shift is the re-read of the kept
   tokens (actors/model_runner/slots.py says why they are read again).

    .venv/bin/python tools/bench/slots.py [--words 1500] [--tokens 40] [--ctx 128]
        [--only save|shift]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.conftest import free_port  # noqa: E402 - after sys.path


def start(args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxcel", "serve", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


def complete(base: str, **body: Any) -> dict[str, Any]:
    body = {"temperature": 0, "ignore_eos": True, **body}
    r = httpx.post(f"{base}/completion", json=body, timeout=1200)
    r.raise_for_status()
    return dict(r.json())


def saving(base: str, words: int, tokens: int) -> None:
    prompt = " ".join(f"word{i}" for i in range(words))
    first = complete(base, prompt=prompt, n_predict=1, id_slot=0)
    stamps: list[float] = []

    def stream() -> None:
        body = {"prompt": "Tell a story.", "n_predict": tokens, "ignore_eos": True}
        body |= {"stream": True, "id_slot": 1}
        with httpx.stream("POST", f"{base}/completion", json=body, timeout=600) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    stamps.append(time.perf_counter())

    t = threading.Thread(target=stream)
    t.start()
    while len(stamps) < tokens // 2:
        time.sleep(0.01)
    start = time.perf_counter()
    saved = httpx.post(f"{base}/slots/0?action=save", json={"filename": "b.bin"}, timeout=600)
    end = time.perf_counter()
    t.join()
    out = saved.json()
    restored = httpx.post(
        f"{base}/slots/1?action=restore", json={"filename": "b.bin"}, timeout=600
    ).json()
    print(
        f"slot of {first['tokens_evaluated']} tokens: n_saved {out['n_saved']}, "
        f"{out['n_written'] / 1e6:.1f} MB, save_ms {out['timings']['save_ms']:.0f}, "
        f"restore_ms {restored['timings']['restore_ms']:.0f}"
    )
    gaps = [(a, b - a) for a, b in zip(stamps, stamps[1:], strict=False)]
    during = [g for a, g in gaps if a < end and a + g > start]
    other = [g for a, g in gaps if not (a < end and a + g > start)]
    print(
        f"slot 1's gaps between tokens: during the save {[round(g * 1000) for g in during]} "
        f"ms; otherwise median {statistics.median(other) * 1000:.0f} ms, "
        f"largest {max(other) * 1000:.0f} ms (the server logs the model runner's share)"
    )


def shifting(base: str, ctx: int) -> None:
    half = " ".join(f"w{i}" for i in range(ctx // 4))  # about ctx / 2 tokens
    read = complete(base, prompt=half, n_predict=1)
    inside = complete(base, prompt="Once upon a time", n_predict=ctx // 2)
    across = complete(base, prompt="Once upon a time", n_predict=3 * ctx)
    a = inside["timings"]["predicted_ms"] / inside["timings"]["predicted_n"]
    b = across["timings"]["predicted_ms"] / across["timings"]["predicted_n"]
    print(
        f"-c {ctx}: a shift re-reads ~{ctx // 2} tokens: reading {read['tokens_evaluated']} "
        f"took {read['timings']['prompt_ms']:.0f} ms; decoding {a:.0f} ms/token inside the "
        f"context, {b:.0f} ms/token over {3 * ctx} tokens (shifting every ~{ctx // 2})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--words", type=int, default=1500)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--only", choices=("save", "shift"))
    opts = ap.parse_args()
    model = ["-m", opts.model] if opts.model else []
    if opts.only != "shift":
        with tempfile.TemporaryDirectory() as tmp:
            proc, base = start([*model, "-np", "2", "-c", "8192", "--slot-save-path", tmp])
            try:
                saving(base, opts.words, opts.tokens)
            finally:
                proc.terminate()
                proc.wait()
    if opts.only == "save":
        return
    proc, base = start([*model, "-np", "1", "-c", str(opts.ctx), "--context-shift"])
    try:
        shifting(base, opts.ctx)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()

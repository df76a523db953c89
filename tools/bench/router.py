"""Router mode (issue 25): does loading one model stall another's stream, and does unloading
give the memory back?

A models folder with a tiny generated llama (``tiny``) and the default SmolLM2 as its float32
copy (``smollm2``, ~540 MB, the peers' serving copy: ``serving.float32_folder``). One stream
on ``tiny`` decodes without pause; after ``--seconds`` alone, ``smollm2`` is loaded (by a
request) while it runs. Printed: the stream's inter-token gap p50 / p90 / max before and during
the load, and their ratio; then the server's resident memory before the load, loaded, and
after ``POST /models/unload``, for ``--cycles`` load/unload cycles (does it come back, and
does it stay flat?).

    .venv/bin/python tools/bench/router.py [--seconds 5] [--cycles 3]
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

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools" / "bench"))


def stream(base: str, stop: threading.Event, arrivals: list[float]) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if '"content"' in line:
                        arrivals.append(time.monotonic())
                    if stop.is_set():
                        break


def gaps_in(arrivals: list[float], start: float, end: float) -> list[float]:
    return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if start <= a < end]


def describe(gaps: list[float]) -> str:
    p50, p90, top = statistics.median(gaps), statistics.quantiles(gaps, n=10)[8], max(gaps)
    return f"p50 {p50 * 1000:6.1f} ms  p90 {p90 * 1000:6.1f} ms  max {top * 1000:6.1f} ms"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--cycles", type=int, default=3)
    a = p.parse_args()

    from serving import float32_folder
    from soak import rss_mb

    from mlxcel.models.resolve import resolve_model
    from tests.conftest import free_port
    from tests.support.tiny_model import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="router-bench-"))
    build_tiny_model(root / "tiny")
    (root / "smollm2").symlink_to(float32_folder(str(resolve_model(None, None).path)))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxcel", "serve", "--models-dir", str(root), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        httpx.post(base + "/v1/chat/completions", json={**chat, "model": "tiny"}, timeout=120)
        stop = threading.Event()
        arrivals: list[float] = []
        runner = threading.Thread(target=stream, args=(base, stop, arrivals))
        runner.start()
        time.sleep(a.seconds)
        started = time.monotonic()
        httpx.post(base + "/v1/chat/completions", json={**chat, "model": "smollm2"}, timeout=300)
        loaded = time.monotonic()
        time.sleep(0.5)
        stop.set()
        runner.join()
        alone = gaps_in(arrivals, started - a.seconds + 1, started)
        during = gaps_in(arrivals, started, loaded)
        print(f"smollm2 (float32) loaded in {loaded - started:.2f} s while 'tiny' streamed")
        print(f"  tiny's gaps alone:       {describe(alone)}")
        print(f"  tiny's gaps during load: {describe(during)}")
        print(
            f"  ratio during/alone: p50 {statistics.median(during) / statistics.median(alone):.2f}x"
            f"  max {max(during) / max(alone):.2f}x  ({len(during)} tokens during the load)"
        )
        unload = {"model": "smollm2"}
        httpx.post(base + "/models/unload", json=unload, timeout=120)
        for cycle in range(1, a.cycles + 1):
            before = rss_mb(proc.pid)
            httpx.post(
                base + "/v1/chat/completions", json={**chat, "model": "smollm2"}, timeout=300
            )
            up = rss_mb(proc.pid)
            httpx.post(base + "/models/unload", json=unload, timeout=120)
            after = rss_mb(proc.pid)
            print(
                f"cycle {cycle}: RSS before {before:6.0f} MiB, loaded {up:6.0f} MiB, "
                f"unloaded {after:6.0f} MiB (kept {after - before:+.0f} MiB)"
            )
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()

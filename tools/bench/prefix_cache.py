"""Prompt-cache and /metrics benchmark for mlxcel (issue: native routes and operations).

1. TTFT of a request whose prompt shares a ~1,000-token prefix with a finished one, against
   the cold TTFT of the same prompt with the cache emptied first (target <= 0.3x).
2. /metrics scrape latency while 8 streams generate (target < 10 ms).

Usage: python tools/bench/prefix_cache.py [--model PATH] [--rounds 5]
Starts its own server on a free port (the embedded default model unless --model).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ttft(
    url: str, messages: list[dict[str, str]], extra: dict[str, Any] | None = None
) -> tuple[float, int]:
    """Seconds to the first token streamed, and the prompt tokens the cache served."""
    body = {
        "messages": messages,
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    tic = time.perf_counter()
    first = None
    cached = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if first is None and '"content":"' in line and '"role"' not in line:
                first = time.perf_counter() - tic
            if '"cached_tokens"' in line:
                cached = int(line.split('"cached_tokens":')[1].split("}")[0])
    assert first is not None
    return first, cached


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen[bytes], str] | None:
    """`mlxcel serve --parallel 8` on a free port, healthy; None if it did not start."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlxcel", "serve", "--port", str(port), "--parallel", "8"]
    cmd += [*extra, *(["-m", model] if model else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            proc.wait()
            return None
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    started = start_server(args.model, ["--metrics"])
    if started is None:
        print("server did not start", file=sys.stderr)
        return 1
    proc, url = started
    try:
        prefix = " ".join(f"rule{i}" for i in range(330))  # ~1,000 tokens with the template
        cold, warm = [], []
        for i in range(args.rounds):
            httpx.post(f"{url}/v1/cache/reset")
            first = [
                {"role": "system", "content": prefix},
                {"role": "user", "content": f"Question {i}a?"},
            ]
            second = [
                {"role": "system", "content": prefix},
                {"role": "user", "content": f"Question {i}b?"},
            ]
            t_cold, c0 = ttft(url, first)
            t_warm, c1 = ttft(url, second)
            assert c0 == 0 and c1 > 900, (c0, c1)
            cold.append(t_cold)
            warm.append(t_warm)
        c, w = statistics.median(cold), statistics.median(warm)
        print("| measure | value |\n|---|---|")
        print(f"| cold TTFT p50 (~1,000-token prompt) | {c * 1000:.0f} ms |")
        print(f"| warm TTFT p50 (shared prefix cached, {c1} tokens) | {w * 1000:.0f} ms |")
        print(
            f"| warm / cold | {w / c:.2f}x "
            f"(target <= 0.30x: {'met' if w / c <= 0.3 else 'MISSED'}) |"
        )

        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                body = {
                    "messages": [{"role": "user", "content": "Tell me a story"}],
                    "max_tokens": 64,
                    "stream": True,
                    "cache_prompt": False,
                }
                with httpx.stream(
                    "POST", f"{url}/v1/chat/completions", json=body, timeout=600
                ) as r:
                    for _ in r.iter_lines():
                        pass

        threads = [threading.Thread(target=load, daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        samples = []
        with httpx.Client() as client:
            for _ in range(50):
                tic = time.perf_counter()
                client.get(f"{url}/metrics").raise_for_status()
                samples.append(time.perf_counter() - tic)
                time.sleep(0.05)
        stop.set()
        samples.sort()
        p50, p99 = samples[len(samples) // 2], samples[int(len(samples) * 0.99) - 1]
        print(
            f"| /metrics scrape under 8 streams, p50 / p99 | "
            f"{p50 * 1000:.1f} / {p99 * 1000:.1f} ms "
            f"(target < 10 ms: {'met' if p50 < 0.010 else 'MISSED'}) |"
        )
        for t in threads:
            t.join(timeout=120)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

#!/usr/bin/env python
"""Structured-output and per-request sampling cost under batching (issue 3's targets).

Starts ``mlxcel serve`` (the embedded SmolLM2-135M unless ``--model``) with ``--parallel 4``
and drives it with a closed loop of ``--concurrency`` clients, non-streaming chat requests,
in alternating rounds so machine noise hits every case alike. Per case: aggregate output tok/s
(sum of usage.completion_tokens / wall time of the case's rounds).

  plain      temperature 0.8, ignore_eos, ``--tokens`` tokens each (the reference)
  json       response_format json_schema (a story object), the grammar enforced per row;
             ends when the JSON is complete, so tok/s is per produced token
  seeded     a distinct seed per request + repetition/presence/frequency penalties, ignore_eos

Targets: json >= 0.7x plain, seeded >= 0.9x plain (no serial fallback).

    .venv/bin/python tools/bench/structured.py [--rounds 2] [--requests 8] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "characters": {"type": "array", "items": {"type": "string"}},
        "story": {"type": "string"},
    },
    "required": ["title", "characters", "story"],
    "additionalProperties": False,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def body(case: str, i: int, tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": f"Session {i:04d}. You are a storyteller."},
            {"role": "user", "content": "Write a long story about a lighthouse keeper as JSON."},
        ],
        "max_tokens": tokens,
        "temperature": 0.8,
    }
    if case == "json":
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "story", "schema": SCHEMA, "strict": True},
        }
    else:
        out["ignore_eos"] = True
    if case == "seeded":
        out |= {
            "seed": 1000 + i,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.3,
            "frequency_penalty": 0.3,
        }
    return out


def run_case(url: str, case: str, n: int, concurrency: int, tokens: int) -> tuple[int, float]:
    """(completion tokens, wall seconds) for n requests at the given concurrency."""

    def one(i: int) -> int:
        r = httpx.post(f"{url}/v1/chat/completions", json=body(case, i, tokens), timeout=600)
        r.raise_for_status()
        data = r.json()
        if case == "json" and data["choices"][0]["finish_reason"] == "stop":
            json.loads(data["choices"][0]["message"]["content"])  # must parse
        return int(data["usage"]["completion_tokens"])

    tic = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(one, range(n)))
    return total, time.perf_counter() - tic


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8, help="requests per case per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlxcel", "serve", "--port", str(port), "--parallel", "4"]
    if args.model:
        cmd += ["-m", args.model]
    log = tempfile.NamedTemporaryFile(prefix="mlxcel-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"server did not start; see {log.name}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        cases = ("plain", "json", "seeded")
        for case in cases:  # warm every path (grammar compile, seeded samplers) once
            run_case(url, case, args.concurrency, args.concurrency, 16)
        totals = {c: [0, 0.0] for c in cases}
        for _ in range(args.rounds):
            for case in cases:
                n, s = run_case(url, case, args.requests, args.concurrency, args.tokens)
                print(f"  {case}: {n} tokens in {s:.1f} s", file=sys.stderr, flush=True)
                totals[case][0] += n
                totals[case][1] += s
        rate = {c: totals[c][0] / totals[c][1] for c in cases}
        print(f"concurrency {args.concurrency}, {args.rounds} rounds x {args.requests} requests")
        print("| case | tokens | tok/s | vs plain | target |")
        print("|---|---:|---:|---:|---|")
        targets = {"plain": None, "json": 0.7, "seeded": 0.9}
        for c in cases:
            r = rate[c] / rate["plain"]
            t = targets[c]
            verdict = "" if t is None else (f">= {t}x: " + ("met" if r >= t else "missed"))
            print(f"| {c} | {totals[c][0]} | {rate[c]:.1f} | {r:.2f}x | {verdict} |")
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())

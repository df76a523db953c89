"""What the seed promise costs in time to first token (issue 40, item 4).

A seeded prompt reuses from the prompt cache only the KV that a fresh read computes alike:
what an earlier request read as its prompt, not its last prompt token nor its answer (decode
steps computed those). An unseeded prompt reuses everything cached. Measured, per round:

1. a ~1,000-token system prompt shared with a finished request (another question): TTFT of a
   seeded request and of an unseeded one (both should reuse the whole prefix);
2. the second turn of a conversation whose first turn (that prompt and a 64-token answer) is
   cached: TTFT seeded (re-reads the answer) against unseeded (reuses it).

Usage: python tools/bench/seeded_cache.py [--model PATH] [--rounds 5]
Starts its own server on a free port (the embedded default model unless --model).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_cache import start_server, ttft  # noqa: E402 - after sys.path


def answer(url: str, messages: list[dict[str, str]]) -> str:
    body = {"messages": messages, "max_tokens": 64, "temperature": 1.0, "seed": 7}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    started = start_server(args.model, [])
    if started is None:
        print("server did not start", file=sys.stderr)
        return 1
    proc, url = started
    seeded: dict[str, Any] = {"temperature": 1.0, "seed": 1}
    results: dict[str, list[tuple[float, int]]] = {}
    try:
        prefix = " ".join(f"rule{i}" for i in range(330))  # ~1,000 tokens with the template
        for i in range(args.rounds):
            for kind, extra in (("seeded", seeded), ("unseeded", {"temperature": 1.0})):
                httpx.post(f"{url}/v1/cache/reset")
                system = {"role": "system", "content": prefix}
                first = [system, {"role": "user", "content": f"Question {i}a?"}]
                said = answer(url, first)
                second = [system, {"role": "user", "content": f"Question {i}b?"}]
                results.setdefault(f"shared prefix, {kind}", []).append(ttft(url, second, extra))
                follow = [*first, {"role": "assistant", "content": said}]
                follow.append({"role": "user", "content": "And then?"})
                results.setdefault(f"second turn, {kind}", []).append(ttft(url, follow, extra))
    finally:
        proc.terminate()
        proc.wait()
    print("| request | TTFT p50 | cached tokens |\n|---|---:|---:|")
    for name, samples in results.items():
        t = statistics.median(s[0] for s in samples)
        cached = statistics.median(s[1] for s in samples)
        print(f"| {name} | {t * 1000:.0f} ms | {cached:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

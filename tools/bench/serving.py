#!/usr/bin/env python
"""Serving throughput benchmark: mlxcel vs mlx_lm.server vs raw mlx-lm BatchGenerator
(and, with ``--llama-server``, vs llama.cpp's own ``llama-server``).

One run:

1. starts ``mlxcel serve`` (``--parallel`` = the highest concurrency tested) and
   ``mlx_lm.server`` on the same MLX model folder (default: the embedded
   SmolLM2-135M-Instruct, float32), one after the other, each on a free
   127.0.0.1 port, waits for ``/health`` and warms each up; with
   ``--llama-server`` also llama.cpp's ``llama-server`` (found on PATH or built
   once from source and cached: ``tools/bench/llama_server.py``) on the packaged
   Q4_1 GGUF of the same model (``--llama-gguf`` for another), with ``-np`` = the
   highest concurrency tested and ``-t 2``;
2. drives each server with the same closed-loop streaming chat load (``stream: true``,
   ``stream_options.include_usage``) at each concurrency level, every request
   asking for exactly ``--tokens`` output tokens (``temperature`` 0, a "write a
   long story" instruction so EOS is not hit; the usage count is checked);
3. measures per level: aggregate output tok/s (all output tokens / wall time of
   the level), TTFT p50/p90 (send -> first non-empty content delta; a role-only
   chunk does not count), inter-token latency (per request: mean gap between
   content chunks; then the median across requests);
4. after both servers are stopped, runs the raw in-process mlx-lm
   ``BatchGenerator`` in a subprocess at the same batch sizes (same prompts,
   same token budget, continuous batching with ``completion_batch_size`` = the
   level) as the ceiling;
5. prints a markdown table with ratios (with ``--llama-server``: mlxcel /
   llama-server aggregate tok/s and TTFT p50 too) and whether the targets are met.

Exit status is non-zero only on errors (a server failing to start, a request
failing, a token-count mismatch with ``--strict``), never on a missed target.

    .venv/bin/python tools/bench/serving.py                    # 1 4 16, 64 tokens
    .venv/bin/python tools/bench/serving.py --quick            # smoke: 1 4, few requests
    .venv/bin/python tools/bench/serving.py --concurrency 1 4 16 --tokens 64 --requests-per-level 32
    .venv/bin/python tools/bench/serving.py --llama-server --concurrency 1 4 16 32 64
    .venv/bin/python tools/bench/serving.py --llama-server --model-size 1b --skip mlx_lm raw

``--model-size 1b|3b|8b`` (with ``--quant Q4_0|Q8_0``) serves a random-weight GGUF in the shape
of Llama-3.2-1B, Qwen2.5-3B or Llama-3.1-8B (``tools/bench/sized_models.py``, built once and
cached) to mlxcel (``-m FILE``) and llama-server alike; the MLX peers would need a float32 copy
(32 GB at 8B), so they are skipped. Requests carry ``ignore_eos`` so every answer has exactly
``--tokens`` tokens whatever the weights say.

OpenBLAS: the mlxcel server loads it itself; mlx_lm.server and the raw worker
are started through ``mlxcel.models.blas.preload_blas()`` before ``mlx.core`` is
imported so all three use the same BLAS. llama-server uses its own ggml kernels
on the quantised weights as stored, so its numbers compare serving stacks, not
the same arithmetic.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable

TOPICS = [
    "a lighthouse keeper",
    "a lost robot",
    "a dragon who fears fire",
    "a clockmaker",
    "a city under the sea",
    "a talking cat",
    "a desert caravan",
    "a time-travelling baker",
    "a mountain monastery",
    "a pirate librarian",
    "a haunted train",
    "a garden on Mars",
    "a shy giant",
    "an old violin",
    "a village of inventors",
    "a winter festival",
    "a secret tunnel",
    "a forgotten king",
    "a river spirit",
    "a space station cook",
    "a carnival magician",
    "a map that redraws itself",
    "twin astronomers",
    "a paper boat",
    "a wandering knight",
    "a cloud shepherd",
    "a bookshop at midnight",
    "a glass forest",
    "a retired detective",
    "a stormy island",
    "a circus elephant",
    "a broken compass",
]
STYLES = [
    "Use vivid descriptions of the places and people.",
    "Tell it slowly, with many small details and dialogue.",
    "Describe every scene carefully, from morning until night.",
    "Include a journey, several characters and a surprising ending.",
]


def make_messages(i: int, run_tag: str) -> list[dict]:
    """Distinct prompts of similar length (~45-60 tokens with the chat template).

    The unique tag comes first (system message) so no server can reuse a cached
    prompt prefix beyond the first few template tokens.
    """
    topic = TOPICS[i % len(TOPICS)]
    style = STYLES[(i // len(TOPICS) + i) % len(STYLES)]
    return [
        {"role": "system", "content": f"Session {run_tag}-{i:04d}. You are a patient storyteller."},
        {
            "role": "user",
            "content": f"Write a very long story of at least 2000 words about {topic}. {style}",
        },
    ]


# ----------------------------------------------------------------------------- utils


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_busy_s() -> float:
    """Machine-wide busy CPU seconds so far (all cores), from /proc/stat; 0 where absent."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    # user nice system idle iowait irq softirq steal ...
    return (sum(v[:8]) - v[3] - v[4]) / _TCK


def group_cpu_s(pgid: int | None) -> float:
    """CPU seconds used so far by every live process in process group ``pgid``."""
    if pgid is None:
        return 0.0
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(rest[2]) == pgid:
            total += int(rest[11]) + int(rest[12])
    return total / _TCK


class CpuWatch:
    """How many cores *other* processes (not the bench client, not the server) kept busy."""

    def __init__(self, pgid: int | None) -> None:
        self.pgid = pgid
        self.t0 = time.perf_counter()
        self.busy0 = cpu_busy_s()
        self.grp0 = group_cpu_s(pgid)
        t = os.times()
        self.me0 = t.user + t.system

    def stop(self) -> tuple[float, float]:
        """(cores used by the watched group, cores used by others) over the window."""
        wall = time.perf_counter() - self.t0
        t = os.times()
        me = t.user + t.system - self.me0
        grp = group_cpu_s(self.pgid) - self.grp0
        busy = cpu_busy_s() - self.busy0
        return grp / wall, max(0.0, busy - grp - me) / wall


def default_model_path() -> str:
    # In a subprocess so this (light) client never imports mlx itself.
    code = (
        "from mlxcel.models.resolve import resolve_model;"
        "from mlxcel.paths import default_cache_dir;"
        "print(resolve_model(None, default_cache_dir()).path)"
    )
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return out.stdout.strip().splitlines()[-1]


def default_gguf() -> str:
    # The packaged Q4_1 GGUF of the default model (llama-server's input), asked in a child too.
    code = "from mlxcel.models.default import default_gguf_path; print(default_gguf_path())"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return out.stdout.strip().splitlines()[-1]


_F32_CODE = r"""
import json, shutil, sys
from pathlib import Path
from mlxcel.models.blas import preload_blas
preload_blas()
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.utils import dequantize_model, load, save_model
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
model, _, config = load(str(src), lazy=True, return_config=True)
for _, m in model.named_modules():
    # Dequantise with float32 scales (as mlxcel's loader does), never float16.
    if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and mx.issubdtype(
        m.scales.dtype, mx.floating
    ):
        m.scales = m.scales.astype(mx.float32)
        if m.get("biases") is not None:
            m.biases = m.biases.astype(mx.float32)
dequantize_model(model)
model.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v,
                      model.parameters()))
mx.eval(model.parameters())
tmp = dst.with_name(dst.name + ".tmp")
shutil.rmtree(tmp, ignore_errors=True)
tmp.mkdir(parents=True)
save_model(tmp, model)
raw = json.loads((src / "config.json").read_text())
for k in ("quantization", "quantization_config"):
    raw.pop(k, None)
raw["torch_dtype"] = "float32"
(tmp / "config.json").write_text(json.dumps(raw, indent=2))
skip = ("config.json", "model.safetensors.index.json")
for f in src.iterdir():
    if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
        shutil.copy(f, tmp / f.name)
shutil.rmtree(dst, ignore_errors=True)
tmp.rename(dst)
"""


def float32_folder(model: str) -> str:
    """``model`` itself when it is unquantised, else a cached float32 copy of it.

    mlxcel dequantises to float32 at load; mlx_lm.server and BatchGenerator would
    run the quantised layers as they are (much slower on CPU). So all three get
    the same float32 weights, the ones mlxcel computes with.
    """
    cfg = json.loads((Path(model) / "config.json").read_text())
    if "quantization" not in cfg and "quantization_config" not in cfg:
        return model
    dst = (
        Path(os.environ.get("MLXCEL_CACHE_DIR", Path.home() / ".cache" / "mlxcel"))
        / "bench"
        / (Path(model).name + "-float32")
    )
    if not (dst / "config.json").exists():
        print(f"dequantising {model} -> {dst} (float32, once)", flush=True)
        subprocess.run([PY, "-c", _F32_CODE, model, str(dst)], cwd=REPO, check=True)
    return str(dst)


# ----------------------------------------------------------------------------- servers


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()
        self.proc = None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def ours(model: str, parallel: int, logdir: Path, extra: list[str] | None = None) -> Server:
    port = free_port()
    # `python -m mlxcel` rather than the console script: the same code, and it runs where
    # mlxcel is on PYTHONPATH without being installed (tools/bench/gpu.sh's offline mode).
    argv = [
        PY,
        "-m",
        "mlxcel",
        "serve",
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(parallel),
        *(extra or []),
    ]
    return Server("mlxcel", argv, port, logdir / "mlxcel.log")


def mlx_lm_server(model: str, parallel: int, logdir: Path) -> Server:
    port = free_port()
    sargv = [
        "mlx_lm.server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--decode-concurrency",
        str(max(parallel, 1)),
        "--log-level",
        "WARNING",
    ]
    code = (
        "from mlxcel.models.blas import preload_blas; print('BLAS:', preload_blas(), flush=True);"
        f"import sys; sys.argv = {sargv!r};"
        "from mlx_lm.server import main; main()"
    )
    return Server("mlx_lm.server", [PY, "-c", code], port, logdir / "mlx_lm_server.log")


def llama_cpp_server(
    binary: Path, gguf: str, parallel: int, ctx: int, logdir: Path, extra: list[str]
) -> Server:
    """llama.cpp's server: ``-np parallel -t 2``, ``ctx`` tokens of context per slot."""
    import llama_server  # tools/bench/llama_server.py, beside this script

    port = free_port()
    argv = llama_server.command(binary, Path(gguf), port, parallel, ctx, threads=2, extra=extra)
    return Server("llama-server", argv, port, logdir / "llama_server.log")


def resident_gib(pid: int, key: str = "VmRSS") -> float | None:
    """The process's resident memory (``VmRSS``) or its peak (``VmHWM``), GiB; None where
    /proc does not say (not Linux, or the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_line(server: Server, peak: bool) -> str:
    """Resident memory for the log lines: now (after load) or the peak of the run."""
    pid = server.proc.pid if server.proc is not None else -1
    gib = resident_gib(pid, "VmHWM" if peak else "VmRSS")
    return "resident ?" if gib is None else f"{'peak ' if peak else ''}resident {gib:.2f} GiB"


async def wait_ready(client, server: Server, timeout: float) -> None:  # noqa: ASYNC109 - a poll loop; its error names the timeout
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc is not None and server.proc.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}"
            )
        try:
            r = await client.get(f"{server.base}/health", timeout=2.0)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f}s:\n{server.log_tail()}")


# ----------------------------------------------------------------------------- load client


@dataclass
class ReqResult:
    ok: bool
    error: str = ""
    ttft: float = float("nan")
    itl: float = float("nan")  # mean gap between content chunks
    chunks: int = 0  # non-empty content deltas
    usage_tokens: int | None = None
    finish_reason: str | None = None
    latency: float = float("nan")

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks


async def one_request(client, base: str, messages: list[dict], max_tokens: int) -> ReqResult:
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Both servers take it: exactly max_tokens tokens, whatever the weights (a random
        # checkpoint's EOS may come at any step).
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = None
    finish = None
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return ReqResult(ok=False, error=f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                ev = json.loads(data)
                if ev.get("usage"):
                    usage = ev["usage"].get("completion_tokens")
                for ch in ev.get("choices") or []:
                    if ch.get("delta", {}).get("content"):
                        stamps.append(now)
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
    except Exception as e:  # noqa: BLE001 - reported, counted as an error
        return ReqResult(ok=False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if not stamps:
        return ReqResult(ok=False, error="no content", usage_tokens=usage, finish_reason=finish)
    itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return ReqResult(
        ok=True,
        ttft=stamps[0] - t0,
        itl=itl,
        chunks=len(stamps),
        usage_tokens=usage,
        finish_reason=finish,
        latency=end - t0,
    )


@dataclass
class Level:
    concurrency: int
    requests: int
    wall: float
    tokens: int
    tok_s: float
    ttft_p50: float
    ttft_p90: float
    itl_p50: float
    server_cores: float = float("nan")
    other_cores: float = float("nan")
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


async def run_level(
    client,
    base: str,
    conc: int,
    n_req: int,
    tokens: int,
    first_idx: int,
    tag: str,
    pgid: int | None = None,
) -> Level:
    """Closed loop: ``conc`` workers, each sends its next request when the last ends."""
    queue = list(range(first_idx, first_idx + n_req))
    queue.reverse()
    results: list[ReqResult] = []

    async def worker() -> None:
        while queue:
            i = queue.pop()
            results.append(await one_request(client, base, make_messages(i, tag), tokens))

    watch = CpuWatch(pgid)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall = time.perf_counter() - t0
    server_cores, other_cores = watch.stop()
    good = [r for r in results if r.ok]
    total = sum(r.tokens for r in good)
    mism = []
    for r in good:
        if r.tokens != tokens or (r.usage_tokens is not None and r.chunks != r.usage_tokens):
            mism.append(f"usage={r.usage_tokens} chunks={r.chunks} finish={r.finish_reason}")
    return Level(
        concurrency=conc,
        requests=n_req,
        wall=wall,
        tokens=total,
        tok_s=total / wall,
        ttft_p50=pct([r.ttft for r in good], 50),
        ttft_p90=pct([r.ttft for r in good], 90),
        itl_p50=statistics.median([r.itl for r in good if r.itl == r.itl] or [float("nan")]),
        server_cores=server_cores,
        other_cores=other_cores,
        errors=[r.error for r in results if not r.ok],
        mismatches=mism,
    )


async def bench_server(
    server: Server, levels: list[int], n_for, tokens: int, ready_timeout: float, tag: str
) -> dict[int, Level]:
    import httpx

    limits = httpx.Limits(
        max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4
    )
    timeout = httpx.Timeout(connect=10.0, read=600.0, write=30.0, pool=600.0)
    out: dict[int, Level] = {}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t0 = time.monotonic()
        await wait_ready(client, server, ready_timeout)
        print(
            f"  {server.name}: ready in {time.monotonic() - t0:.1f}s, "
            f"{memory_line(server, peak=False)}",
            flush=True,
        )
        # Warm-up: one alone, then a small concurrent batch (compiles / allocates batch shapes).
        warm = await one_request(client, server.base, make_messages(9000, tag + "w"), 8)
        if not warm.ok:
            raise RuntimeError(f"{server.name} warm-up failed: {warm.error}\n{server.log_tail()}")
        wl = min(4, max(levels))
        await asyncio.gather(
            *(
                one_request(client, server.base, make_messages(9001 + k, tag + "w"), 8)
                for k in range(wl)
            )
        )
        idx = 0
        for c in levels:
            n = n_for(c)
            lv = await run_level(client, server.base, c, n, tokens, idx, tag, server.proc.pid)
            idx += n
            out[c] = lv
            print(
                f"  {server.name} c={c:<3} {lv.tok_s:7.1f} tok/s  TTFT p50 {lv.ttft_p50:6.3f}s "
                f"p90 {lv.ttft_p90:6.3f}s  ITL p50 {lv.itl_p50 * 1000:6.1f}ms  "
                f"({lv.tokens} tok / {lv.wall:.1f}s, {len(lv.errors)} err, "
                f"{len(lv.mismatches)} mismatch; "
                f"server {lv.server_cores:.2f} cores, other processes {lv.other_cores:.2f} cores)",
                flush=True,
            )
            for e in lv.errors[:3]:
                print(f"    error: {e}", flush=True)
            for m in lv.mismatches[:3]:
                print(f"    token-count mismatch: {m}", flush=True)
        print(f"  {server.name}: {memory_line(server, peak=True)}", flush=True)
    return out


# ----------------------------------------------------------------------------- raw worker


def raw_worker(model: str, levels: list[int], n_for_list: list[int], tokens: int, tag: str) -> None:
    """Runs in its own process: raw mlx-lm BatchGenerator, continuous batching."""
    from mlxcel.models.blas import preload_blas

    blas = preload_blas()
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    mdl, tok = load(model)
    res = {"blas": str(blas), "levels": {}}

    def prompts(first: int, n: int) -> list[list[int]]:
        return [
            tok.apply_chat_template(
                make_messages(i, tag), add_generation_prompt=True, tokenize=True
            )
            for i in range(first, first + n)
        ]

    def run(batch: int, ps: list[list[int]], max_tok: int) -> tuple[int, float]:
        # stop_tokens=None: never stops early, exactly max_tok tokens per sequence.
        gen = BatchGenerator(
            mdl, max_tokens=max_tok, completion_batch_size=batch, prefill_batch_size=min(8, batch)
        )
        t0 = time.perf_counter()
        gen.insert(ps, [max_tok] * len(ps))
        done, n_tok = 0, 0
        while done < len(ps):
            _, gresps = gen.next()
            for r in gresps:
                n_tok += 1
                if r.finish_reason is not None:
                    done += 1
        wall = time.perf_counter() - t0
        gen.close()
        return n_tok, wall

    run(min(4, max(levels)), prompts(9000, min(4, max(levels))), 8)  # warm-up
    idx = 0
    for c, n in zip(levels, n_for_list, strict=False):
        ps = prompts(idx, n)
        idx += n
        plen = statistics.mean(len(p) for p in ps)
        watch = CpuWatch(None)
        n_tok, wall = run(c, ps, tokens)
        _, other = watch.stop()  # "other" here: everything but this worker
        res["levels"][str(c)] = {
            "tokens": n_tok,
            "wall": wall,
            "tok_s": n_tok / wall,
            "prompt_len": plen,
            "other_cores": other,
        }
        print(
            f"  raw BatchGenerator b={c:<3} {n_tok / wall:7.1f} tok/s ({n_tok} tok / {wall:.1f}s, "
            f"prompt ~{plen:.0f} tok; other processes {other:.2f} cores)",
            file=sys.stderr,
            flush=True,
        )
    mx.synchronize()
    print(json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- report


def fmt(x: float, spec: str = ".1f") -> str:
    return "–" if x is None or x != x else format(x, spec)


def ratio(a, b) -> str:
    if a is None or b is None or a != a or b != b or b == 0:
        return "–"
    return f"{a / b:.2f}x"


def report(levels, res_ours, res_mlx, res_raw, tokens, res_llama=None) -> tuple[str, list[str]]:
    """The table; ``res_llama`` (``--llama-server``'s results, else None) adds its columns."""
    ll = res_llama is not None
    peers = " / mlx_lm / llama" if ll else " / mlx_lm"
    lines = [
        f"Output tokens per request: {tokens}. tok/s = all output tokens / wall time of the level; "
        "TTFT = send -> first content delta; ITL = per-request mean gap between content chunks, "
        "median across requests. Other CPU load: cores kept busy by processes outside the "
        f"benchmark during the level (machine has {os.cpu_count()}); much above 0 means the "
        "numbers are disturbed."
        + (
            " llama = llama.cpp's llama-server on the GGUF named above (its own kernels, "
            "weights as stored); TTFT ours/llama below 1 means mlxcel answers first."
            if ll
            else ""
        ),
        "",
        "| conc | mlxcel tok/s | mlx_lm.server tok/s | raw BatchGenerator tok/s "
        + ("| llama-server tok/s " if ll else "")
        + "| ours/mlx_lm | ours/raw "
        + ("| ours/llama | TTFT p50 ours/llama " if ll else "")
        + f"| TTFT p50 ours{peers} (s) | TTFT p90 ours{peers} (s) | ITL p50 ours{peers} (ms) "
        + f"| other CPU load ours{peers} / raw (cores) |",
        "|---:" * (13 if ll else 10) + "|",
    ]

    def trio(a: float | None, b: float | None, c: float | None, spec: str) -> str:
        return " / ".join(fmt(x, spec) for x in ((a, b, c) if ll else (a, b)))

    for c in levels:
        o = res_ours.get(c)
        m = res_mlx.get(c)
        r = res_raw.get(c)
        lv = (res_llama or {}).get(c)
        ot = o.tok_s if o else None
        mt = m.tok_s if m else None
        rt = r["tok_s"] if r else None
        lt = lv.tok_s if lv else None
        cells = [str(c), fmt(ot), fmt(mt), fmt(rt)]
        if ll:
            cells.append(fmt(lt))
        cells += [ratio(ot, mt), ratio(ot, rt)]
        if ll:
            cells += [
                ratio(ot, lt),
                ratio(o.ttft_p50 if o else None, lv.ttft_p50 if lv else None),
            ]
        cells += [
            trio(*(x.ttft_p50 if x else None for x in (o, m, lv)), ".3f"),
            trio(*(x.ttft_p90 if x else None for x in (o, m, lv)), ".3f"),
            trio(*(x.itl_p50 * 1000 if x else None for x in (o, m, lv)), ".1f"),
            trio(*(x.other_cores if x else None for x in (o, m, lv)), ".2f")
            + f" / {fmt(r.get('other_cores') if r else None, '.2f')}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    top = max(levels)
    o, m, r = res_ours.get(top), res_mlx.get(top), res_raw.get(top)
    targets = []
    if o and m:
        targets.append(
            f"[{'MET' if o.tok_s >= m.tok_s else 'MISSED'}] c={top}: mlxcel tok/s >= 1.0x "
            f"mlx_lm.server ({o.tok_s / m.tok_s:.2f}x)"
        )
    if o and r:
        targets.append(
            f"[{'MET' if o.tok_s >= 0.8 * r['tok_s'] else 'MISSED'}] c={top}: mlxcel tok/s >= "
            f"0.8x raw BatchGenerator ({o.tok_s / r['tok_s']:.2f}x)"
        )
    if o and m:
        targets.append(
            f"[{'MET' if o.ttft_p50 <= m.ttft_p50 else 'MISSED'}] c={top}: mlxcel TTFT p50 <= "
            f"mlx_lm.server ({o.ttft_p50:.3f}s vs {m.ttft_p50:.3f}s)"
        )
    return "\n".join(lines), targets


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--concurrency", type=int, nargs="+", default=None, help="levels (default 1 4 16)"
    )
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request (default 64)")
    ap.add_argument(
        "--requests-per-level",
        type=int,
        default=None,
        help="requests per level (default: max(4, 2 x concurrency); quick: concurrency)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke check: levels 1 4, fewer requests")
    ap.add_argument(
        "--model", default=None, help="MLX model folder (default: the embedded SmolLM2 one)"
    )
    ap.add_argument(
        "--model-size",
        choices=["1b", "3b", "8b"],
        default=None,
        help="a random-weight GGUF of that size for mlxcel and llama-server (sized_models.py); "
        "skips the MLX peers",
    )
    import sized_models  # tools/bench/sized_models.py, beside this script

    ap.add_argument("--quant", default="Q4_0", choices=sized_models.QUANTS)
    ap.add_argument(
        "--mlxcel-float32",
        action="store_true",
        help="give mlxcel the peers' float32 copy too (by default it loads the folder itself: "
        "a quantised model's layers run on its native kernels)",
    )
    ap.add_argument(
        "--keep-quantized",
        action="store_true",
        help="give the MLX peers a quantised --model as it is, not a float32 copy (mlxcel always "
        "gets the folder itself: on the CPU its quantised layers run on the native kernels); "
        "also skips writing that copy, which a 1B or larger model's float32 folder makes slow",
    )
    ap.add_argument(
        "--parallel", type=int, default=None, help="mlxcel --parallel (default: max level)"
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=["mlxcel", "mlx_lm", "raw"])
    ap.add_argument(
        "--mlxcel-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for `mlxcel serve` (repeatable), e.g. --mlxcel-arg=--cache-ram=0",
    )
    ap.add_argument(
        "--llama-server",
        action="store_true",
        help="also run llama.cpp's llama-server as a peer (found on PATH, or built once from "
        "source and cached; see tools/bench/llama_server.py)",
    )
    ap.add_argument(
        "--llama-gguf",
        default=None,
        help="GGUF for --llama-server (default: the packaged Q4_1 SmolLM2 one)",
    )
    ap.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for llama-server (repeatable), e.g. --llama-arg=--cache-ram=0",
    )
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--strict", action="store_true", help="exit 1 on token-count mismatches too")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--raw-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--raw-n", type=int, nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()

    levels = a.concurrency or ([1, 4] if a.quick else [1, 4, 16])
    tag = a.tag or format(int(time.time()) % 100000, "05d")

    if a.raw_worker:
        raw_worker(a.model, levels, a.raw_n, a.tokens, tag)
        return 0

    def n_for(c: int) -> int:
        if a.requests_per_level:
            return max(a.requests_per_level, c)
        return c if a.quick else max(4, 2 * c)

    # mlxcel serves the folder as a user's server does (a quantised one on the native kernels,
    # the default model's included); the MLX peers get the float32 copy, their fastest here.
    if a.model_size:
        sized = str(sized_models.build(a.model_size, a.quant))
        a.skip = sorted({*a.skip, "mlx_lm", "raw"})
        a.llama_gguf = a.llama_gguf or sized
        source = model = sized
    else:
        source = a.model or default_model_path()
        model = source if a.keep_quantized else float32_folder(source)
    ours_model = model if a.mlxcel_float32 else source
    parallel = a.parallel or max(levels)
    logdir = Path(tempfile.mkdtemp(prefix="mlxcel-bench-"))
    # Asked in a child: this process stays free of mlx (it only drives the load).
    where = subprocess.run(
        [PY, "-c", "from mlxcel.models import device; print(device.describe().label)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    print(
        f"device: {where.stdout.strip() or where.stderr.strip()}\n"
        f"model: {ours_model} (mlxcel), {model} (MLX peers)\n"
        f"levels: {levels}, tokens/request: {a.tokens}, "
        f"requests/level: {[n_for(c) for c in levels]}, logs: {logdir}",
        flush=True,
    )

    llama: Server | None = None
    if a.llama_server:
        import llama_server  # tools/bench/llama_server.py, beside this script

        try:
            binary = llama_server.find_or_build()
            gguf = a.llama_gguf or default_gguf()
        except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f"ERROR: llama-server: {e}", flush=True)
            return 1
        # Context per slot: the prompt (~60 tokens with the template) + the output + room.
        llama = llama_cpp_server(
            binary, gguf, max(levels), max(512, a.tokens + 256), logdir, a.llama_arg
        )
        ver = "; ".join(llama_server.version(binary).splitlines()) or "version unknown"
        print(f"llama-server: {binary} ({ver})")
        print(f"llama-server model: {gguf}", flush=True)

    failed = False
    res: dict[str, dict] = {"mlxcel": {}, "mlx_lm": {}, "llama": {}}
    for key in ("mlxcel", "mlx_lm", "llama"):
        if key in a.skip:
            continue
        if key == "mlxcel":
            srv = ours(ours_model, parallel, logdir, a.mlxcel_arg)
        elif key == "mlx_lm":
            srv = mlx_lm_server(model, parallel, logdir)
        elif llama is not None:
            srv = llama
        else:
            continue
        print(f"starting {srv.name} on :{srv.port}", flush=True)
        srv.start()
        try:
            res[key] = asyncio.run(
                bench_server(srv, levels, n_for, a.tokens, a.ready_timeout, tag + key[0])
            )
        except Exception as e:  # noqa: BLE001 - reported, the run fails at the end
            print(f"ERROR: {srv.name}: {e}", flush=True)
            failed = True
        finally:
            srv.stop()

    raw: dict[int, dict] = {}
    if "raw" not in a.skip:
        print("running raw BatchGenerator (subprocess)", flush=True)
        argv = [
            PY,
            str(Path(__file__).resolve()),
            "--raw-worker",
            "--model",
            model,
            "--tokens",
            str(a.tokens),
            "--concurrency",
            *map(str, levels),
            "--raw-n",
            *[str(n_for(c)) for c in levels],
            "--tag",
            tag + "r",
        ]
        p = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
        if p.returncode != 0:
            print(f"ERROR: raw worker exited {p.returncode}", flush=True)
            failed = True
        else:
            raw = {
                int(k): v
                for k, v in json.loads(p.stdout.strip().splitlines()[-1])["levels"].items()
            }

    table, targets = report(
        levels, res["mlxcel"], res["mlx_lm"], raw, a.tokens, res["llama"] if llama else None
    )
    print("\n" + table + "\n")
    print("Targets (at the highest concurrency):")
    for t in targets:
        print("  " + t)

    for key in ("mlxcel", "mlx_lm", "llama"):
        for lv in res[key].values():
            if lv.errors:
                failed = True
            if lv.mismatches:
                print(
                    f"WARNING: {key} c={lv.concurrency}: {len(lv.mismatches)} requests did not "
                    f"produce exactly {a.tokens} tokens (e.g. {lv.mismatches[0]})"
                )
                failed = failed or a.strict
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "model": model,
                    "tokens": a.tokens,
                    "levels": levels,
                    "mlxcel": {c: asdict(v) for c, v in res["mlxcel"].items()},
                    "mlx_lm": {c: asdict(v) for c, v in res["mlx_lm"].items()},
                    "raw": raw,
                    "llama_server": {c: asdict(v) for c, v in res["llama"].items()},
                    "targets": targets,
                },
                indent=2,
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

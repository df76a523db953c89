#!/usr/bin/env python
"""Prompt processing: tokens/s reading one prompt of 512 and 2048 tokens, mlxcel against
llama.cpp's ``llama-bench`` (``pp512``, ``pp2048``) from the same build as the benchmark's
llama-server, on the same GGUF (issue 37, item 1).

    .venv/bin/python tools/bench/prompt.py --model-size 1b [--quant Q4_0] [--lengths 512 2048]
    .venv/bin/python tools/bench/prompt.py --gguf FILE

mlxcel: ``mlxcel serve -m FILE`` on 127.0.0.1, then for each length a warm-up and ``--runs``
requests to the native ``/completion`` with that many random token ids as the prompt,
``n_predict`` 1 and ``cache_prompt`` false (every run reads the whole prompt); the figure is
the server's own ``timings.prompt_per_second``, median over the runs. llama-bench: ``-p N -n 0
-t 2 -r RUNS`` (its mean), both on 2 threads. The prompt cache is off on our side
(``--cache-ram 0``), so nothing is reused across runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import llama_server  # noqa: E402 - beside this script, found through the sys.path line above
import sized_models  # noqa: E402 - likewise
from serving import Server, ours  # noqa: E402 - likewise


def llama_bench(gguf: Path, lengths: list[int], runs: int) -> dict[int, float]:
    binary = llama_server.find_or_build_tool("llama-bench")
    argv = [str(binary), "-m", str(gguf), "-p", ",".join(map(str, lengths)), "-n", "0"]
    argv += ["-t", "2", "-r", str(runs), "-o", "json"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return {int(r["n_prompt"]): float(r["avg_ts"]) for r in json.loads(out)}


def _post(base: str, body: dict[str, object], timeout: float) -> dict[str, object]:
    import httpx

    r = httpx.post(f"{base}/completion", json=body, timeout=timeout)
    r.raise_for_status()
    data: dict[str, object] = r.json()
    return data


def mlxcel_prompts(
    gguf: Path, lengths: list[int], runs: int, vocab: int, extra: list[str]
) -> dict[int, float]:
    import httpx

    logdir = Path(tempfile.mkdtemp(prefix="mlxcel-prompt-"))
    ctx = max(lengths) + 64
    srv: Server = ours(str(gguf), 1, logdir, ["--ctx-size", str(ctx), "--cache-ram", "0", *extra])
    srv.start()
    rng = random.Random(0)
    try:
        deadline = time.monotonic() + 900
        while True:
            if srv.proc is not None and srv.proc.poll() is not None:
                raise RuntimeError(f"mlxcel exited:\n{srv.log_tail()}")
            try:
                if httpx.get(f"{srv.base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlxcel not ready:\n{srv.log_tail()}")
            time.sleep(0.5)
        rates: dict[int, float] = {}
        for n in lengths:
            seen = []
            for i in range(runs + 1):  # the first is a warm-up
                ids = [rng.randrange(100, vocab - 1) for _ in range(n)]
                body = {"prompt": ids, "n_predict": 1, "cache_prompt": False, "temperature": 0}
                timings = _post(srv.base, body, 900)["timings"]
                assert isinstance(timings, dict)
                if int(timings["prompt_n"]) != n:
                    raise RuntimeError(f"read {timings['prompt_n']} prompt tokens, sent {n}")
                if i:
                    seen.append(float(timings["prompt_per_second"]))
            rates[n] = statistics.median(seen)
        return rates
    finally:
        srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--model-size", choices=sorted(sized_models.SHAPES))
    which.add_argument("--gguf", type=Path)
    ap.add_argument("--quant", default="Q4_0", choices=sized_models.QUANTS)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mlxcel-arg", action="append", default=[], metavar="ARG")
    a = ap.parse_args()
    if a.model_size:
        gguf = sized_models.build(a.model_size, a.quant)
        vocab = sized_models.SHAPES[a.model_size].vocab
    else:
        gguf = a.gguf
        import gguf as gg

        vocab = len(gg.GGUFReader(str(gguf)).fields["tokenizer.ggml.tokens"].data)
    print(f"model: {gguf}", flush=True)
    theirs = llama_bench(gguf, a.lengths, a.runs)
    mine = mlxcel_prompts(gguf, a.lengths, a.runs, vocab, a.mlxcel_arg)
    print("| prompt tokens | mlxcel tok/s | llama-bench tok/s | ratio |")
    print("|---:|---:|---:|---:|")
    for n in a.lengths:
        print(f"| {n} | {mine[n]:.1f} | {theirs[n]:.1f} | {mine[n] / theirs[n]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

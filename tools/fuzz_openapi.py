#!/usr/bin/env python
"""Fuzz every HTTP route with schemathesis, from the server's own `/openapi.json`.

    .venv/bin/python tools/fuzz_openapi.py                    # embedded model, 200 examples/route
    .venv/bin/python tools/fuzz_openapi.py --max-examples 1000 --max-time 3600
    .venv/bin/python tools/fuzz_openapi.py --quick --model DIR  # the suite's short run

One server with every route enabled (``--metrics --slots --props``, an API key, MiniLM for
embeddings, a reranker when ``--reranker`` names one, Whisper and Piper for audio; generation
capped by ``-n`` so that a valid request is answered quickly) is fuzzed by ``st run`` over the
document the server publishes. The check is schemathesis's ``not_a_server_error``: no answer
may be a 5xx, except 501 (a route this model or server cannot serve: /infill without FIM
tokens, as llama-server answers it). The verdict is read from schemathesis's record of every
request (HAR): exit status 0 when no answer was an unexpected 5xx, some requests were served
(2xx), the server's log shows no unexpected error and the server is still healthy at the end.
Per-route counts of 2xx/4xx/5xx are printed, so a schema that stops producing valid requests
shows.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.launch import serve  # noqa: E402 - after sys.path

KEY = "fuzz-key"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
# 501: a feature this server or model does not have (llama-server's "not supported" status).
CONFIG = """\
[checks.not_a_server_error]
expected-statuses = ["1xx", "2xx", "3xx", "4xx", 501]
"""


def start(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    flags = ["--api-key", KEY, "--metrics", "--slots", "--props", "-n", str(args.n_predict)]
    flags += ["--parallel", "4", "--embedding-model", MINILM]
    if args.reranker:
        flags += ["--reranker-model", args.reranker]
    if args.model:
        flags += ["-m", args.model]
    return serve(flags, args.port, log)


def fuzz(base: str, args: argparse.Namespace, config: Path, har: Path) -> int:
    # In the scratch folder: schemathesis keeps a .schemathesis cache where it runs.
    st = Path(sys.executable).with_name("st")
    cmd = [str(st), "--no-color", "--config-file", str(config), "run", f"{base}/openapi.json"]
    cmd += ["-H", f"Authorization: Bearer {KEY}", "--checks", "not_a_server_error"]
    cmd += ["--phases", "examples,coverage,fuzzing", "--max-examples", str(args.max_examples)]
    cmd += ["--workers", str(args.workers), "--request-timeout", "120"]
    cmd += ["--seed", str(args.seed), "--warnings", "off"]
    cmd += ["--report", "har", "--report-har-path", str(har)]
    if args.max_time:
        cmd += ["--max-time", str(args.max_time)]
    return subprocess.run(cmd, cwd=config.parent).returncode


def answers(har: Path, document: dict[str, Any]) -> dict[str, collections.Counter[str]]:
    """Status classes per documented operation, from schemathesis's HAR record of every
    request it sent (probes with other methods and made-up paths are left out)."""
    routes = {
        (method.upper(), re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", path) + "$")): path
        for path, item in document["paths"].items()
        for method in item
    }
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for entry in json.loads(har.read_text())["log"]["entries"]:
        method = entry["request"]["method"]
        path = urllib.parse.urlsplit(entry["request"]["url"]).path
        for (m, pattern), name in routes.items():
            if m == method and pattern.match(path):
                out[f"{method} {name}"][f"{entry['response']['status'] // 100}xx"] += 1
                break
    return out


def unexpected_5xx(har: Path) -> list[str]:
    """Every 5xx but 501 (a feature this server or model lacks), with the request that got it."""
    out = []
    for entry in json.loads(har.read_text())["log"]["entries"]:
        status = entry["response"]["status"]
        if status >= 500 and status != 501:
            body = entry["request"].get("postData", {}).get("text", "")
            out.append(
                f"{status} {entry['request']['method']} {entry['request']['url']} {body[:300]}"
            )
    return out


def server_errors(log: Path) -> list[str]:
    """Lines of the server's log that say something went wrong inside it."""
    markers = ("Traceback", "unexpected error", "Exception in ASGI")
    return [
        line
        for line in log.read_text(errors="replace").splitlines()
        if any(m in line for m in markers)
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="chat model (default: the embedded one)")
    p.add_argument("--reranker", default=None, help="reranker model for the rerank routes")
    p.add_argument("--max-examples", type=int, default=200, help="per operation and phase")
    p.add_argument("--max-time", type=int, default=0, help="stop after this many seconds")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=20261204)
    p.add_argument("-n", "--n-predict", type=int, default=8, help="the server's -n")
    p.add_argument("--port", type=int, default=8093)
    p.add_argument("--quick", action="store_true", help="20 examples per operation")
    p.add_argument("--workdir", type=Path, help="where the config and request record go")
    args = p.parse_args()
    if args.quick:
        args.max_examples = 20
    scratch = args.workdir or Path(tempfile.mkdtemp(prefix="mlxcel-fuzz-"))
    config = scratch / "schemathesis.toml"
    config.write_text(CONFIG)
    log = scratch / "server.log"
    proc, base = start(args, log)
    har = scratch / "requests.har"
    try:
        document = httpx.get(base + "/openapi.json", timeout=30).json()
        status = fuzz(base, args, config, har)
        alive = proc.poll() is None and httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    errors = server_errors(log)
    if not har.exists():
        print("schemathesis wrote no record of its requests")
        return 1
    seen = answers(har, document)
    print("\nanswers per route (2xx: the fuzzer's request was valid and served):")
    for route, counts in sorted(seen.items()):
        print(f"  {route:<48} " + "  ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    served = sum(c["2xx"] for c in seen.values())
    bad = unexpected_5xx(har)
    for line in bad[:20]:
        print("5xx:", line)
    print(f"\nschemathesis exit {status}; server alive after the run: {alive}")
    print(f"server log {log}; every request and answer in {har}")
    for line in errors[:20]:
        print("server:", line)
    if status != 0 and not bad:
        # Schemathesis exits 1 on its own internal errors too (a generator crash on one
        # operation): reported, but the verdict is the server's answers.
        print("schemathesis reported errors of its own; see its report above")
    print(
        f"{sum(seen[r].total() for r in seen)} requests, {served} served, {len(bad)} unexpected 5xx"
    )
    return 0 if alive and not errors and not bad and served else 1


if __name__ == "__main__":
    raise SystemExit(main())

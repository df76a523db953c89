"""Schemathesis against the server's own /openapi.json (tools/fuzz_openapi.py --quick): every
documented operation fuzzed, valid requests among them (generation included), and no 5xx
but 501 for a feature the model lacks. The long run is the same tool without --quick."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, free_port
from tests.support.tiny_reranker import build_tiny_reranker


def test_quick_fuzz_finds_no_server_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    reranker = build_tiny_reranker(tmp_path / "tiny-reranker")
    run = subprocess.run(
        [
            sys.executable,
            "tools/fuzz_openapi.py",
            "--quick",
            "--model",
            str(tiny_model_dir),
            "--reranker",
            str(reranker),
            "--port",
            str(free_port()),
            "--workdir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-6000:]
    assert "0 unexpected 5xx" in report, report[-6000:]
    # The fuzzer built valid requests for the generation routes of every family (a schema that
    # only ever produced 400s would pass the 5xx check without testing generation at all).
    for route in (
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /completion",
        "POST /v1/messages",
        "POST /v1/responses",
        "POST /v1/embeddings",
        "POST /v1/rerank",
    ):
        line = next((x for x in report.splitlines() if x.strip().startswith(route + " ")), "")
        assert "2xx" in line, f"{route}: {line!r}\n{report[-6000:]}"

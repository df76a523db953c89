"""`mlxcel serve` started by a tool (soak, fuzzing, benchmarks) and waited on until healthy."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def serve(args: list[str], port: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``mlxcel serve --port PORT *args`` with its output in ``log``; return the process
    and its base URL once /health answers 200 (SystemExit if it exits or takes over 300 s)."""
    cmd = [sys.executable, "-m", "mlxcel", "serve", "--port", str(port), *args]
    with log.open("wb") as out:  # the child keeps its own handle
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited early; see {log}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"server did not start; see {log}")

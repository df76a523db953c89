"""The soak's short version: waves of mixed traffic over every route family, a fifth of it
abandoned at random moments, a realtime session speaking throughout (tools/bench/soak.py on
the tiny model). Its targets are what an operator would check: no 5xx, every 503 with
Retry-After, nothing left busy or queued after a wave, resident memory flat, the same answer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, free_port


def test_quick_soak_meets_its_targets(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            "tools/bench/soak.py",
            "--quick",
            "--model",
            str(tiny_model_dir),
            "--realtime",
            "1",
            "--voice-period",
            "4",
            "--port",
            str(free_port()),
            "--json",
            str(result),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    # Every wave ran and reported (a soak that sent nothing would meet its targets too).
    assert report.count("5xx 0, broken 0, 503 without Retry-After 0") == 3, report
    assert "all targets met" in report

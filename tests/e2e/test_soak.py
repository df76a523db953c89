"""The soak's short version: waves of mixed traffic over every route family, a fifth of it
abandoned at random moments, a realtime session speaking throughout (tools/bench/soak.py on
the tiny model). Its targets are what an operator would check: no 5xx, every 503 with
Retry-After, nothing left busy or queued after a wave, resident memory flat, the same answer."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, free_port
from tests.support.tiny_model import build_tiny_model


def soak(*flags: str, timeout: float = 600) -> str:
    """Run tools/bench/soak.py with ``flags``; its report (it must meet its targets)."""
    run = subprocess.run(
        [sys.executable, "tools/bench/soak.py", "--port", str(free_port()), *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    assert "all targets met" in report
    return report


def test_quick_soak_meets_its_targets(tiny_model_dir: Path) -> None:
    report = soak(
        "--quick", "--model", str(tiny_model_dir), "--realtime", "1", "--voice-period", "4"
    )
    # Every wave ran and reported (a soak that sent nothing would meet its targets too).
    assert report.count("5xx 0, broken 0, 503 without Retry-After 0") == 3, report


def test_router_soak_swaps_models_under_mixed_traffic(tmp_path: Path) -> None:
    """Router mode: three tiny chat models against --models-max 2, named at random by the
    traffic (and one by a realtime session throughout), so they load and unload under load."""
    models = [build_tiny_model(tmp_path / f"tiny-{i}", seed=i) for i in range(3)]
    flags = [f"--router-model={m}" for m in models]
    report = soak(
        "--router", str(tmp_path / "models"), *flags,
        "--waves", "2", "--requests", "30", "--clients", "6",
        "--realtime", "1", "--voice-period", "4",
    )  # fmt: skip
    assert report.count("5xx 0, broken 0, 503 without Retry-After 0") == 2, report
    # The models did swap under the traffic: more loads than the three first ones.
    last = re.findall(r"model loads so far: (.*)", report)[-1]
    loads = [int(part.rsplit(" ", 1)[1]) for part in last.split(", ")]
    assert len(loads) == 3 and sum(loads) > 3, report

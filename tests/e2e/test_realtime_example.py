"""The documented example client (examples/realtime_client.py) runs against a real server."""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

from tests.conftest import REPO, ServerProcess
from tests.support.realtime import spoken


def test_example_client_asks_and_gets_a_spoken_answer(
    tiny_server: ServerProcess, tmp_path: Path
) -> None:
    question = tmp_path / "question.wav"
    with wave.open(str(question), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(22_050)
        w.writeframes(spoken(rate=22_050).astype("<i2").tobytes())
    answer = tmp_path / "answer.wav"
    url = tiny_server.base_url.replace("http://", "ws://")
    run = subprocess.run(
        [
            sys.executable,
            "examples/realtime_client.py",
            str(question),
            "--url",
            url,
            "--out",
            str(answer),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    heard = next(line for line in run.stdout.splitlines() if line.startswith("you said:"))
    assert "capital" in heard.lower() and "france" in heard.lower()
    with wave.open(str(answer), "rb") as w:
        assert w.getframerate() == 22_050
        assert w.getnframes() > 22_050 // 10

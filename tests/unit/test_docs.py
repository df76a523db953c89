"""Docs that are derived from code stay in step with it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_message_table_is_current() -> None:
    p = subprocess.run(
        [sys.executable, "tools/gen_message_table.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr


def test_every_cli_flag_is_documented() -> None:
    from mlxcel.cli import main

    out = subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout
    assert main is not None
    flags = set(re.findall(r"(--[a-z][a-z0-9-]+)", out)) - {"--help"}
    doc = (REPO / "docs" / "reference" / "cli.md").read_text()
    missing = sorted(f for f in flags if f"`{f}`" not in doc)
    assert not missing, f"flags missing from docs/reference/cli.md: {missing}"

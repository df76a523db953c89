"""The style guide's tooling: ruff (with the ASYNC rules) over the whole tree, ruff's
formatting, mypy strict on ``mlxcel/``, and a reason on every ignore.

The tools and their versions come from the ``test`` extra (pyproject.toml); their settings too.
mypy takes about a minute without its cache (``.mypy_cache``, ignored by git).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_ruff_check_passes() -> None:
    p = _run("ruff", "check", "--no-fix", ".")
    assert p.returncode == 0, p.stdout + p.stderr


def test_ruff_format_leaves_the_code_as_it_is() -> None:
    p = _run("ruff", "format", "--check", "mlxcel", "tests", "tools")
    assert p.returncode == 0, p.stdout + p.stderr


def test_mypy_strict_passes() -> None:
    p = _run("mypy")
    assert p.returncode == 0, p.stdout + p.stderr


def _python_files(*folders: str) -> list[Path]:
    return sorted(f for folder in folders for f in (REPO / folder).rglob("*.py"))


def test_every_ignore_carries_a_reason() -> None:
    """``# type: ignore[code]  # why`` in the type-checked package, ``# noqa: E501 - why`` in
    everything ruff reads: the same line says why the check does not apply."""
    type_ignore = re.compile(r"#\s*type:\s*ignore(?!\[[\w\-, ]+\]\s+#\s*\S)")
    noqa = re.compile(r"#\s*noqa(?!:\s*[A-Z]+[0-9]+(?:,\s*[A-Z]+[0-9]+)*\s+\S)")
    bare = []
    for path in _python_files("mlxcel", "tests", "tools"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            checked_by_mypy = path.is_relative_to(REPO / "mlxcel")
            if noqa.search(line) or (checked_by_mypy and type_ignore.search(line)):
                bare.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not bare, "ignores without a reason:\n" + "\n".join(bare)

"""The layering is a contract: ``lint-imports`` checks the import graph against the contracts
in pyproject.toml (``[tool.importlinter]``), drawn in docs/discussion/architecture.md.

    cli > server > drain > http > actors > models | runtime > native > paths

plus: no mlx or web framework in the runtime, no web framework in actors or models, no event
loop in models, nothing of the server in the Python client, no cycles between siblings.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Top-level parts of the package outside the layers, and why.
OUTSIDE_THE_LAYERS = {
    "mlxcel": "the package itself: imports only the client",
    "mlxcel.client": "the Python client, held apart by its own contract",
    "mlxcel.cli_compat": "llama-server flag spellings for the CLI; imports nothing of mlxcel",
}


def _lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    # The `lint-imports` command, run by this interpreter wherever its scripts are installed.
    command = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", command, "--no-cache", "--no-logo", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _config() -> dict[str, object]:
    with (REPO / "pyproject.toml").open("rb") as f:
        config: dict[str, object] = tomllib.load(f)["tool"]["importlinter"]
    return config


def test_import_contracts_are_kept() -> None:
    p = _lint_imports()
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_top_level_module_is_in_a_layer() -> None:
    """A new top-level package cannot slip past the layering by not being named in it."""
    contracts = _config()["contracts"]
    assert isinstance(contracts, list)
    (layers,) = (c["layers"] for c in contracts if c["id"] == "layers")
    layered = {name.strip() for layer in layers for name in layer.split("|")}
    package = REPO / "mlxcel"
    present = {"mlxcel"} | {
        f"mlxcel.{p.stem}"
        for p in package.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert present - layered == set(OUTSIDE_THE_LAYERS), "put it in a layer (pyproject.toml)"

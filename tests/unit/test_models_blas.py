"""OpenBLAS must be loaded before mlx.core, and importing mlxcel.models must stay cheap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.models.blas import BlasInfo, preload_blas

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
{first}
from mlxcel.models import BLAS
maps = open("/proc/self/maps").read() if sys.platform == "linux" else ""
print(json.dumps({{
    "name": BLAS.name, "fast": BLAS.fast,
    "openblas_mapped": "libopenblas" in maps,
    "heavy": sorted(m for m in ("mlx.core", "mlx_lm", "transformers") if m in sys.modules),
}}))
"""


def _probe(first: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE.format(first=first)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return dict(json.loads(result.stdout))


def test_preload_is_idempotent() -> None:
    info = preload_blas()
    assert isinstance(info, BlasInfo)
    assert preload_blas() is info


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS preloading is Linux-only")
def test_import_loads_openblas_and_nothing_heavy() -> None:
    # tools/setup.sh installs it on Linux; its absence is a failure, not a skip.
    assert preload_blas().name == "openblas", "apt-get install libopenblas0-pthread"
    probe = _probe("")
    assert probe == {"name": "openblas", "fast": True, "openblas_mapped": True, "heavy": []}


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS preloading is Linux-only")
def test_too_late_is_reported_as_slow() -> None:
    probe = _probe("import mlx.core")
    assert (probe["name"], probe["fast"]) == ("reference", False)

"""Load a fast BLAS into the process before MLX binds its bundled one.

The Linux ``mlx[cpu]`` wheel links a reference BLAS (float32 1024^3 matmul at
a few GFLOP/s). Loading OpenBLAS with ``RTLD_GLOBAL`` *before* ``mlx.core`` is
imported puts its ``sgemm_`` first in the global symbol scope, so MLX's calls
bind to it (measured 2 -> 40-56 GFLOP/s on 2 cores, ~170 on more). Loading it
after ``mlx.core`` is imported changes nothing (measured), so we say so
instead of pretending.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading

import attrs

__all__ = ["BlasInfo", "preload_blas"]

log = logging.getLogger(__name__)


@attrs.frozen
class BlasInfo:
    """Which BLAS MLX's CPU matmuls will use.

    ``name`` is ``"accelerate"``, ``"openblas"`` or ``"reference"``; ``path`` is
    the library we loaded (None when we loaded none); ``fast`` is False when
    float32 matmuls will run on the reference BLAS.
    """

    name: str
    path: str | None
    fast: bool


_lock = threading.Lock()
_info: BlasInfo | None = None


def _candidates() -> list[str]:
    machine = platform.machine()
    paths = [
        # Debian/Ubuntu libopenblas0-pthread: the threaded build.
        f"/usr/lib/{machine}-linux-gnu/openblas-pthread/libopenblas.so.0",
        f"/usr/lib/{machine}-linux-gnu/libopenblas.so.0",
        # Fedora / RHEL layout.
        "/usr/lib64/libopenblas.so.0",
    ]
    override = os.environ.get("MLXCEL_OPENBLAS")
    if override:
        paths.insert(0, override)
    return paths


def _find_library() -> str | None:
    # ctypes.util pulls in subprocess (~90 ms); only pay for it as a fallback.
    import ctypes.util

    return ctypes.util.find_library("openblas")


def _load() -> BlasInfo:
    if sys.platform == "darwin":
        # MLX on macOS links Accelerate, which is already fast.
        return BlasInfo(name="accelerate", path=None, fast=True)
    if "mlx.core" in sys.modules:
        # Too late: MLX's BLAS symbols are already bound (measured: loading
        # OpenBLAS now leaves matmuls at reference speed).
        log.warning(
            "mlx.core was imported before mlxcel.models; float32 matmuls will use "
            "the slow reference BLAS. Import mlxcel.models first."
        )
        return BlasInfo(name="reference", path=None, fast=False)
    for path in [*_candidates(), _find_library()]:
        if path is None:
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return BlasInfo(name="openblas", path=path, fast=True)
    log.warning(
        "OpenBLAS not found (Debian: apt-get install libopenblas0-pthread); "
        "float32 matmuls will use the slow reference BLAS bundled with mlx"
    )
    return BlasInfo(name="reference", path=None, fast=False)


def preload_blas() -> BlasInfo:
    """Load OpenBLAS globally if ``mlx.core`` is not imported yet; idempotent.

    Call it before anything imports ``mlx.core``; importing ``mlxcel.models``
    does. The first call decides, later calls return the same answer.
    """
    global _info
    with _lock:
        if _info is None:
            _info = _load()
        return _info

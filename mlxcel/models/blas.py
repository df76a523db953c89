"""Load a fast BLAS into the process before MLX binds its bundled one.

The Linux ``mlx[cpu]`` wheel links a reference BLAS (float32 1024^3 matmul at
a few GFLOP/s). Loading OpenBLAS with ``RTLD_GLOBAL`` *before* ``mlx.core`` is
imported puts its ``sgemm_`` first in the global symbol scope, so MLX's calls
bind to it (measured 2 -> 40-56 GFLOP/s on 2 cores, ~170 on more). Loading it
after ``mlx.core`` is imported changes nothing (measured), so we say so
instead of pretending.

With a GPU backend (the ``mlx[cuda12]`` / ``mlx[cuda13]`` wheels, Metal) the model's matmuls
never reach a BLAS, so the preload is only what it is for any other work mlx leaves on the CPU
device (the CUDA wheel bundles the same reference BLAS): harmless, and nothing is worth a
warning there.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading

import attrs

__all__ = ["BlasInfo", "preload_blas", "fewer_threads", "threads"]

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
_lib: ctypes.CDLL | None = None
_threads_lock = threading.Lock()
_single_users = 0
_saved_threads = 0


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
        _slow_cpu_matmuls(
            "mlx.core was imported before mlxcel.models; float32 matmuls will use "
            "the slow reference BLAS. Import mlxcel.models first."
        )
        return BlasInfo(name="reference", path=None, fast=False)
    for path in [*_candidates(), _find_library()]:
        if path is None:
            continue
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        global _lib
        _lib = lib
        return BlasInfo(name="openblas", path=path, fast=True)
    _slow_cpu_matmuls(
        "OpenBLAS not found (Debian: apt-get install libopenblas0-pthread); "
        "float32 matmuls will use the slow reference BLAS bundled with mlx"
    )
    return BlasInfo(name="reference", path=None, fast=False)


def _slow_cpu_matmuls(message: str) -> None:
    # Only the CPU wheel puts the model's matmuls in BLAS. Read from the package metadata (mlx.core
    # must not be imported before the preload), and only on this rare path (~ms).
    from mlxcel.models.device import gpu_wheel_installed

    (log.info if gpu_wheel_installed() else log.warning)(message)


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


def threads() -> int | None:
    """How many threads OpenBLAS multiplies on now (None: MLX is not on our OpenBLAS)."""
    if _lib is None:
        return None
    return int(_lib.openblas_get_num_threads())


class fewer_threads:  # noqa: N801 - used as a context manager, like a function
    """OpenBLAS on ``1/share`` of its threads while the block runs (no-op for other BLAS).

    For work already split across cores (the encoder's mlx streams, each on its own core;
    the speech models of open realtime sessions next to the chat model): all threads per
    matmul there would only fight over the same cores. OpenBLAS 0.3.21 has no
    per-thread setting, so this is process-wide: a generation step running at that moment
    also multiplies on fewer threads (it shares the cores with the encoder anyway). Nested
    and concurrent users are counted; the last one out restores the thread count. On a GPU
    the model's steps use no BLAS, so there it only changes mlx work on the CPU device.
    """

    def __init__(self, share: int) -> None:
        self._share = share

    def __enter__(self) -> None:
        global _single_users, _saved_threads
        if _lib is None:
            return
        with _threads_lock:
            if _single_users == 0:
                _saved_threads = int(_lib.openblas_get_num_threads())
                _lib.openblas_set_num_threads(max(1, _saved_threads // self._share))
            _single_users += 1

    def __exit__(self, *exc: object) -> None:
        global _single_users
        if _lib is None:
            return
        with _threads_lock:
            _single_users -= 1
            if _single_users == 0:
                _lib.openblas_set_num_threads(_saved_threads)

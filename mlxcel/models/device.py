"""Which device mlx computes on, and which mlx backend wheel is installed.

mlx chooses its default device itself: the GPU when its backend has one (Metal on a Mac; CUDA
with the ``mlx[cuda12]`` / ``mlx[cuda13]`` wheel and an NVIDIA driver), else the CPU. mlxcel
follows that choice and has no flag to override it: the device is chosen when the backend wheel
is installed (``MLXCEL_CUDA=12 ./tools/setup.sh``, or the ``cuda12`` / ``cuda13`` extra), and a
CPU run on a GPU machine is what the CPU wheel is for. ``CUDA_VISIBLE_DEVICES`` picks the GPU.

What is tuned for the CPU asks ``on_cpu()``: OpenBLAS (``blas``), ``fast_math`` and the float32
load (``loader``), the embedder's split over cores (``embedding``). On a GPU each of them leaves
the work to mlx's own kernels.

On Linux the backend is a separate wheel (``mlx-cpu``, ``mlx-cuda-12``, ``mlx-cuda-13``), each
writing the same ``mlx/lib/libmlx.so``, so exactly one must be installed; ``installed_backends``
reads that from the package metadata without importing ``mlx.core`` (which fails without one,
and, with a CUDA wheel, without the NVIDIA driver's ``libcuda.so.1``).
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Any

import attrs

__all__ = [
    "BACKEND_WHEELS",
    "DeviceInfo",
    "NoBackend",
    "describe",
    "gpu_wheel_installed",
    "installed_backends",
    "on_cpu",
]

# The wheels that carry libmlx.so, and the backend each one is.
BACKEND_WHEELS = {
    "mlx-cpu": "cpu",
    "mlx-cuda-12": "cuda",
    "mlx-cuda-13": "cuda",
    "mlx-metal": "metal",
}

_INSTALL_HINT = (
    "install one backend: `pip install 'mlxcel[cpu]'`, `'mlxcel[cuda12]'` or `'mlxcel[cuda13]'` "
    "(or `./tools/setup.sh`, with MLXCEL_CUDA=12 or 13 for an NVIDIA GPU)"
)


class NoBackend(RuntimeError):
    """``mlx.core`` cannot be imported: no backend wheel, or a CUDA one without its libraries."""


@attrs.frozen
class DeviceInfo:
    """Where the model computes.

    ``kind`` is ``"cpu"`` or ``"gpu"``; ``backend`` is ``"cpu"``, ``"cuda"`` or ``"metal"``;
    ``name`` is what mlx reports for the device ("NVIDIA H200", "Apple M2 Max"; "" when it
    says nothing).
    """

    kind: str
    backend: str
    name: str = ""

    @property
    def label(self) -> str:
        """One line for the log and ``/props``: ``"gpu (cuda: NVIDIA H200)"``, ``"cpu"``."""
        if self.kind == "cpu":
            return f"cpu ({self.name})" if self.name else "cpu"
        return f"gpu ({self.backend}: {self.name})" if self.name else f"gpu ({self.backend})"


def installed_backends() -> tuple[str, ...]:
    """The mlx backend wheels installed (``BACKEND_WHEELS`` names), without importing mlx."""
    found = []
    for wheel in BACKEND_WHEELS:
        try:
            metadata.distribution(wheel)
        except metadata.PackageNotFoundError:
            continue
        found.append(wheel)
    return tuple(found)


def gpu_wheel_installed() -> bool:
    """A CUDA or Metal backend is installed: mlx will put the model on a GPU, not in BLAS."""
    if sys.platform == "darwin":
        return True  # mlx on macOS is the Metal build
    return any(BACKEND_WHEELS[w] != "cpu" for w in installed_backends())


def describe(core: Any = None) -> DeviceInfo:
    """The device mlx computes on by default; imports ``mlx.core`` (``core`` replaces it in tests).

    Raises ``NoBackend`` with what to install when ``mlx.core`` cannot be imported."""
    if core is None:
        core = _import_core()
    device = core.default_device()
    if device == core.cpu:
        return DeviceInfo(kind="cpu", backend="cpu", name=_name(core, device))
    backend = "cuda" if core.cuda.is_available() else "metal" if core.metal.is_available() else ""
    return DeviceInfo(kind="gpu", backend=backend or "unknown", name=_name(core, device))


def on_cpu() -> bool:
    """mlx's default device is the CPU (what the CPU-tuned paths ask before they apply)."""
    import mlx.core as mx

    return bool(mx.default_device() == mx.cpu)


def _name(core: Any, device: Any) -> str:
    try:
        info = core.device_info(device)
    except Exception:  # noqa: BLE001 - a name is decoration: an older mlx or backend has none
        return ""
    return str(info.get("device_name", ""))


def _import_core() -> Any:
    try:
        import mlx.core as mx
    except ImportError as error:
        wheels = installed_backends()
        if not wheels and sys.platform != "darwin":
            raise NoBackend(f"mlx has no backend installed ({error}); {_INSTALL_HINT}") from error
        if len(wheels) > 1:
            raise NoBackend(
                f"mlx cannot load ({error}): several backend wheels are installed "
                f"({', '.join(wheels)}), which overwrite each other's libmlx.so; uninstall all "
                f"of them, then {_INSTALL_HINT}"
            ) from error
        if any(BACKEND_WHEELS[w] == "cuda" for w in wheels):
            raise NoBackend(
                f"mlx's CUDA backend ({', '.join(wheels)}) cannot load: {error}. It needs the "
                "NVIDIA driver (libcuda.so.1) and the CUDA libraries its wheel depends on; "
                "without an NVIDIA GPU, install the CPU backend instead (`pip install "
                "'mlxcel[cpu]'`, or `./tools/setup.sh` without MLXCEL_CUDA)"
            ) from error
        raise NoBackend(f"mlx cannot load: {error}") from error
    return mx

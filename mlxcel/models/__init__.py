"""Model loading: MLX and HF folders, GGUF files, hub repos, the embedded default.

Importing this package loads OpenBLAS before anything can import ``mlx.core``
(see ``blas.py``); everything else is imported lazily, so ``import
mlxcel.models`` stays cheap and never touches MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlxcel.models import fd_limit
from mlxcel.models.blas import BlasInfo, preload_blas
from mlxcel.models.errors import ModelError, ModelNotFound, UnsupportedModel

BLAS: BlasInfo = preload_blas()
# mlx_lm would lower the open-file limit when imported (fd_limit.py).
fd_limit.install()

if TYPE_CHECKING:
    from mlxcel.models.gguf import convert_gguf
    from mlxcel.models.loader import LoadedModel, load_model, release_thread_streams
    from mlxcel.models.resolve import ResolvedModel, default_cache_dir, resolve_model

__all__ = [
    "BLAS",
    "BlasInfo",
    "LoadedModel",
    "ModelError",
    "ModelNotFound",
    "ResolvedModel",
    "UnsupportedModel",
    "convert_gguf",
    "default_cache_dir",
    "load_model",
    "preload_blas",
    "release_thread_streams",
    "resolve_model",
]

_LAZY = {
    "convert_gguf": "mlxcel.models.gguf",
    "LoadedModel": "mlxcel.models.loader",
    "load_model": "mlxcel.models.loader",
    "release_thread_streams": "mlxcel.models.loader",
    "ResolvedModel": "mlxcel.models.resolve",
    "default_cache_dir": "mlxcel.models.resolve",
    "resolve_model": "mlxcel.models.resolve",
}


def __getattr__(name: str) -> Any:
    # PEP 562: the heavy modules (mlx, mlx_lm, transformers) load on first use.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

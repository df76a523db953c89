"""Where mlxcel keeps its files on disk.

Below both ``runtime`` (whose settings default to it) and ``models`` (which resolves and caches
models under it), so that neither has to import the other.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$MLXCEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/mlxcel``, else ``~/.cache/mlxcel``."""
    if env := os.environ.get("MLXCEL_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "mlxcel"

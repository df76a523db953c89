"""Giving memory back when the server goes idle.

Two layers keep freed memory from the operating system. mlx's allocator keeps freed buffers for
reuse (bounded by ``mx.set_cache_limit``; ``mx.clear_cache`` empties it). Below it, glibc's
malloc keeps freed heap pages in its arenas (``runtime/allocator.py`` sets it up so that large
blocks go back on free; small ones stay). Both are emptied on the step that finds the batch
empty, so a busy server pays nothing and a quiet one sits at its floor: the model, the prompt
cache and what the other workers hold.
"""

from __future__ import annotations

import mlx.core as mx

from mlxcel.runtime import allocator


def release_idle_memory() -> None:
    mx.clear_cache()
    allocator.trim()

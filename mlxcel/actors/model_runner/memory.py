"""Giving memory back when the server goes idle.

Two layers keep freed memory from the operating system. mlx's allocator keeps freed buffers for
reuse (bounded by ``mx.set_cache_limit``; ``mx.clear_cache`` empties it). Below it, glibc's
malloc keeps freed heap pages in its arenas: after a burst of batched steps (KV buffers copied
as the batch grows, activations of every size) the process stays at its high-water mark even
though nothing uses the pages. ``malloc_trim(0)`` hands those pages back. Both run on the step
that finds the batch empty, so a busy server pays nothing and a quiet one sits at its floor:
the model, the prompt cache and what the other workers hold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

import mlx.core as mx


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None  # macOS's allocator returns free pages by itself
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_idle_memory() -> None:
    mx.clear_cache()
    if (trim := _malloc_trim()) is not None:
        trim(0)

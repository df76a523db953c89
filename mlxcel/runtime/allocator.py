"""glibc malloc settings for a long-lived server, and giving free heap pages back.

mlx's CPU backend allocates every array with ``malloc``. glibc's defaults suit short programs,
not a server whose threads (the model runner, mlx's stream, tokenizers, speech workers) each
allocate and free arrays of every size for hours:

- each thread that allocates gets an arena of its own, up to 8 per core, and freed memory in
  one arena is never used by another thread's allocations;
- allocations above the mmap threshold get pages of their own that go back on ``free``, but
  the threshold rises (up to 32 MiB) each time such a block is freed, so after a while KV
  buffers and activations are carved from the arenas too, between long-lived prompt-cache
  entries that pin the pages around them; free chunks there stay resident until reused or
  trimmed.

Measured with tools/bench/soak.py (docs/performance.md, "Soak"): resident memory outside mlx's
own arrays grew to several GB with the defaults. Two arenas let threads reuse each other's
freed memory at no measured cost in speed. A fixed mmap threshold (128 KiB or 4 MiB, so that
large blocks go back on ``free``) cut that memory further but cost 6-15% of throughput at 16
streams (a fresh mapping, zeroed by the kernel, for every activation of a new size), so it is
not set. ``trim`` (``malloc_trim``) hands the arenas' free pages back once the batch empties.
``configure`` runs at start, before any thread or model; ``MALLOC_ARENA_MAX``,
``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES`` in the environment win over it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

# mallopt parameter (malloc.h).
M_ARENA_MAX = -8
ARENAS = 2
OVERRIDES = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None  # macOS's allocator returns free pages by itself
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is None or not hasattr(libc, "malloc_trim"):  # musl has neither
            return None
    except OSError:
        return None
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc


def configure() -> bool:
    """Apply the server's malloc settings; False where glibc is absent or the user set them."""
    libc = _glibc()
    if libc is None or any(name in os.environ for name in OVERRIDES):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, ARENAS) == 1)


def trim() -> None:
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)

"""Import mlx through here: OpenBLAS is loaded first, and an exit hook is set.

``from mlxcel.models.mlx_setup import mx`` is safe anywhere; a bare
``import mlx.core`` is safe only after ``mlxcel.models`` was imported, and
import sorters put third-party ``mlx`` above first-party ``mlxcel``.

mlx 0.32 can abort at interpreter exit ("terminate called without an active
exception", ml-explore/mlx#3126) when arrays were evaluated on a thread other
than the main one, which is exactly how the model runner works. Measured: a
``mx.synchronize()`` on the main thread after the worker finished brings the
rate from ~1 in 3 runs to 0 in 30, so we register one with atexit (it runs
after non-daemon threads are joined).
"""

from __future__ import annotations

import atexit
import contextlib
import sys

from mlxcel.models.blas import preload_blas

preload_blas()

import mlx.core as mx  # noqa: E402  (after preload_blas on purpose)

__all__ = ["mx"]


def _drain_at_exit() -> None:
    streams = [None]
    # mlx_lm decodes on a stream of its own; drain it too.
    generate = sys.modules.get("mlx_lm.generate")
    if generate is not None and hasattr(generate, "generation_stream"):
        streams.append(generate.generation_stream)
    for stream in streams:
        # Best effort: a failing drain must not turn a clean exit into a crash.
        with contextlib.suppress(Exception):
            mx.synchronize(stream)


atexit.register(_drain_at_exit)

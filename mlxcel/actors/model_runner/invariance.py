"""``--batch-invariant``: the layers a batch goes through as a whole give each row the same bits
whatever the number of rows.

With the mode on, a decode row attends to its own keys (``models.fast_lm``) and prompts are read
one at a time, so what still sees other rows is a matmul over [rows, features] (and a norm over
each row). OpenBLAS sums a small product (rows x outputs x inputs up to about 10^6) with its
small-matrix kernel and a larger one with its blocked kernel, in different orders: measured
here, SmolLM2's [576 x 1536] projection gives one row different bits than two rows do, and its
[192 x 576] one for up to 6 rows. From some row count on, every count agrees. ``prepare`` finds
that count for each distinct layer of the loaded model, once, and makes the layer pad a smaller
batch with zero rows up to it (the padding costs little: a step's matmuls are bound by reading
the weights, not by the rows). A layer with no such count up to ``MAX_ROWS``, or a norm that is
not row-wise, is reported and the server does not start in this mode.

Nothing here is BLAS-specific but the numbers above: ``prepare`` compares bits of whatever the
default device computes. On a GPU (CUDA, Metal) mlx's matmul kernels also pick their tiling by
shape, so the floors it finds are that GPU's, and where no row count up to ``MAX_ROWS`` agrees
the mode is refused at start, as on the CPU. Decode attention on a GPU is mlx's fused kernel
run one row at a time (``fast_lm``), so a row's shapes are the same alone or in a batch.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Rows compared against; a layer that needs more padding than this is refused.
MAX_ROWS = 64


def prepare(model: Any, parallel: int) -> str | None:
    """Make ``model``'s batched layers row-invariant for batches of 1 to ``parallel`` rows.

    Returns None when done, else a sentence saying which layer cannot be (nothing changed).
    """
    rows = max(parallel, MAX_ROWS)
    floors: dict[tuple[str, tuple[int, ...]], int] = {}
    layers = []
    for name, module in model.named_modules():
        kind = _kind(module)
        if kind is None:
            continue
        signature = (type(module).__name__, tuple(module.weight.shape))
        if signature not in floors:
            floor = _floor(module, kind, rows)
            if floor is None or floor > MAX_ROWS:
                return (
                    f"layer {name!r} ({type(module).__name__} {tuple(module.weight.shape)}) gives "
                    f"a row bits that depend on the number of rows beside it up to {rows} rows, "
                    "so answers would depend on the batch; run without --batch-invariant"
                )
            floors[signature] = floor
        if kind == "linear" and floors[signature] > 1:
            layers.append((module, floors[signature]))
    for module, floor in layers:
        _pad_rows(module, floor)
    return None


def _kind(module: Any) -> str | None:
    if isinstance(module, nn.Linear | nn.QuantizedLinear):
        return "linear"
    if isinstance(module, nn.RMSNorm | nn.LayerNorm):
        return "norm"
    return None


def _width(module: Any) -> int:
    if isinstance(module, nn.QuantizedLinear):
        return int(module.weight.shape[-1]) * 32 // int(module.bits)
    return int(module.weight.shape[-1])


def _floor(module: Any, kind: str, rows: int) -> int | None:
    """The smallest row count from which every count up to ``rows`` gives each row the bits
    it has in a batch of ``rows``; None if even ``rows - 1`` does not."""
    x = mx.random.normal((rows, _width(module)), key=mx.random.key(0))
    full = module(x)
    mx.eval(full)
    floor = None
    for m in range(rows - 1, 0, -1):
        if not bool(mx.array_equal(module(x[:m]), full[:m]).item()):
            break
        floor = m
    if kind == "norm":
        return 1 if floor == 1 else None  # a norm must be row-wise outright
    return floor


class _Padded:
    """Mixed into a layer's class: fewer rows than ``_min_rows`` are padded up to it."""

    _min_rows = 1

    def __call__(self, x: mx.array) -> mx.array:
        width = x.shape[-1]
        n = x.size // width if width else 0
        if n >= self._min_rows or n == 0:
            return super().__call__(x)  # type: ignore[misc,no-any-return]  # nn.Linear's
        flat = x.reshape(n, width)
        padded = mx.concatenate([flat, mx.zeros((self._min_rows - n, width), x.dtype)])
        out = super().__call__(padded)[:n]  # type: ignore[misc]  # nn.Linear's
        return out.reshape(*x.shape[:-1], out.shape[-1])  # type: ignore[no-any-return]  # nn.Linear is untyped


_classes: dict[type, type] = {}


def _pad_rows(module: Any, floor: int) -> None:
    """Give this one layer (not its class: other models share it) the padding."""
    cls = type(module)
    if not issubclass(cls, _Padded):
        if cls not in _classes:
            _classes[cls] = type(f"RowPadded{cls.__name__}", (_Padded, cls), {})
        module.__class__ = _classes[cls]
    module._min_rows = floor

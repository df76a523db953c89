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
the weights, not by the rows).

Some BLAS builds have no such count: OpenBLAS on an Intel Xeon (SkylakeX kernels) gives a row
bits that depend on the row count and on the row's place in the matrix, at every count up to
64. A linear layer there computes a decode batch ([rows, 1, features]) one row at a time, each
row the same call it is alone (``_RowByRow``; checked at start like the padding). That reads
the layer's weights once per row: at 64 rows a step's matmuls take ~6x as long. Prompts are
read one at a time in this mode, in the same chunks alone or not, so their matmuls are left
whole. A norm that is not row-wise, or a layer for which neither way holds, is reported and
the server does not start in this mode.

Nothing here is BLAS-specific but the numbers above: ``prepare`` compares bits of whatever the
default device computes. On a GPU (CUDA, Metal) mlx's matmul kernels also pick their tiling by
shape, so the floors it finds are that GPU's, and where no row count up to ``MAX_ROWS`` agrees
the mode is refused at start, as on the CPU. Decode attention on a GPU is mlx's fused kernel
run one row at a time (``fast_lm``), so a row's shapes are the same alone or in a batch.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.native.layers import NativeKQuantLinear

log = logging.getLogger(__name__)

# Rows compared against; a layer that needs more padding than this is refused.
MAX_ROWS = 64
# A layer's "floor" when no row count agrees but one row at a time does.
ROW_BY_ROW = 0


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
            if (floor is None or floor > MAX_ROWS) and kind == "linear":
                floor = ROW_BY_ROW if _row_by_row_holds(module, rows) else None
            if floor is None or floor > MAX_ROWS:
                return (
                    f"layer {name!r} ({type(module).__name__} {tuple(module.weight.shape)}) gives "
                    f"a row bits that depend on the number of rows beside it up to {rows} rows, "
                    "so answers would depend on the batch; run without --batch-invariant"
                )
            floors[signature] = floor
        if kind == "linear" and floors[signature] != 1:
            layers.append((module, floors[signature]))
    for module, floor in layers:
        if floor == ROW_BY_ROW:
            _mix_in(module, _RowByRow)
        else:
            _pad_rows(module, floor)
    one_by_one = sum(floor == ROW_BY_ROW for _, floor in layers)
    if one_by_one:
        log.warning(
            "--batch-invariant: %d of %d linear layers compute a decode batch one row at a "
            "time (this BLAS gives a row other bits at every row count): decoding is slower",
            one_by_one,
            sum(1 for _, m in model.named_modules() if _kind(m) == "linear"),
        )
    return None


def _kind(module: Any) -> str | None:
    if isinstance(module, nn.Linear | nn.QuantizedLinear | NativeKQuantLinear):
        return "linear"
    if isinstance(module, nn.RMSNorm | nn.LayerNorm):
        return "norm"
    return None


def _width(module: Any) -> int:
    if isinstance(module, nn.QuantizedLinear):
        return int(module.weight.shape[-1]) * 32 // int(module.bits)
    if isinstance(module, NativeKQuantLinear):
        return module.input_dims
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


def _row_by_row_holds(module: Any, rows: int) -> bool:
    """Whether a decode batch computed one row at a time gives each row, at every place and
    every count, its bits alone."""
    x = mx.random.normal((rows, 1, _width(module)), key=mx.random.key(0))
    alone = [module(x[i : i + 1]) for i in range(rows)]
    mx.eval(alone)
    full = _one_by_one(module, x)
    return all(bool(mx.array_equal(full[i : i + 1], alone[i]).item()) for i in range(rows))


class _RowByRow:
    """Mixed into a layer's class: a decode batch ([rows, 1, features]) is computed one row at
    a time (see the module's docstring); any other input is computed whole."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 3 and x.shape[1] == 1 and x.shape[0] > 1:
            return _one_by_one(super().__call__, x)  # type: ignore[misc]  # nn.Linear's
        return super().__call__(x)  # type: ignore[misc,no-any-return]  # nn.Linear's


def _one_by_one(call: Any, x: mx.array) -> mx.array:
    return mx.concatenate([call(x[i : i + 1]) for i in range(x.shape[0])])


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


_classes: dict[tuple[type, type], type] = {}


def _mix_in(module: Any, mixin: type) -> None:
    """Give this one layer (not its class: other models share it) ``mixin``'s ``__call__``."""
    cls = type(module)
    if not issubclass(cls, mixin):
        if (mixin, cls) not in _classes:
            _classes[mixin, cls] = type(
                f"{mixin.__name__.strip('_')}{cls.__name__}", (mixin, cls), {}
            )
        module.__class__ = _classes[mixin, cls]


def _pad_rows(module: Any, floor: int) -> None:
    """Give this one layer the padding up to ``floor`` rows."""
    _mix_in(module, _Padded)
    module._min_rows = floor

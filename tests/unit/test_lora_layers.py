"""models/lora.py against mlx-lm's own LoRALinear: each row of a mixed batch computes what
mlx-lm's layer computes for that row's adapter (the config scale included), and a row at
scale 0 gets exactly the base layer's output."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tuner.lora import LoRALinear

from mlxcel.models.lora import MultiLoraLinear, RowScales


def test_each_row_computes_its_own_adapter_as_mlx_lm_does() -> None:
    mx.random.seed(0)
    base = nn.Linear(16, 12, bias=False)
    refs = []
    for rank, scale in ((4, 2.0), (2, 20.0)):
        ref = LoRALinear.from_base(base, r=rank, scale=scale)
        ref.lora_b = mx.random.normal((rank, 12))
        refs.append(ref)
    rows = RowScales()
    layer = MultiLoraLinear(
        base, [(k, r.lora_a, r.lora_b * r.scale) for k, r in enumerate(refs)], rows
    )
    x = mx.random.normal((3, 5, 16))
    rows.set(mx.array([[1.0, 0.0], [0.0, 0.5], [0.0, 0.0]]))
    y = layer(x)
    assert mx.allclose(y[0], refs[0](x[0]), atol=1e-4)
    half = base(x[1]) + 0.5 * (refs[1](x[1]) - base(x[1]))
    assert mx.allclose(y[1], half, atol=1e-4)
    # A row without an adapter adds exactly nothing to what the base layer gives it in the
    # same matrix (a BLAS may give a row other bits in another matrix: its place counts).
    assert mx.array_equal(y[2], base(x)[2])
    rows.set(None)  # no row uses an adapter: the base layer alone
    assert mx.array_equal(layer(x), base(x))

"""LoRA adapters (``--lora``): mlx-lm's format, applied per batch row.

An adapter is what ``mlx_lm.lora`` writes: a folder with ``adapter_config.json``
(``fine_tune_type``, ``lora_parameters.scale``) and ``adapters.safetensors`` holding, per
adapted linear layer ``P``, ``P.lora_a`` (in x r) and ``P.lora_b`` (r x out); the layer computes
``base(x) + scale * (x @ lora_a) @ lora_b``.

Every adapter stays separate, so rows of one batch may use different ones: each adapted layer
is wrapped once in a ``MultiLoraLinear`` holding the adapters' A matrices side by side
(in x R, R the sum of their ranks) and their B matrices stacked (R x out, already multiplied by
each adapter's own config scale). A forward pass multiplies ``x @ A`` by a per-row, per-column
scale (the row's scale for the adapter owning that column), then by B: one pair of matmuls
whatever the mix of adapters, and a row whose scales are all 0 gets exactly ``base(x)``.
When no row of the pass uses an adapter, the LoRA term is skipped: the base model's speed.

The per-row scales come from ``RowScales``, which the batch's model wrapper (``LoraModel``)
sets before each forward pass from the rows of the batch making it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxcel.models.errors import AdapterError
from mlxcel.native.layers import NativeKQuantLinear

# What marks a prompt-cache key whose KV was computed under adapters.
LORA_TAG = "\x00lora:"


@attrs.frozen
class Adapter:
    """One loaded adapter: its folder, and per adapted layer path (A, B times its scale)."""

    path: Path
    layers: dict[str, tuple[mx.array, mx.array]]


def load_adapter(path: Path) -> Adapter:
    """Read an mlx-lm adapter folder; AdapterError says what is wrong with it."""
    config_file = path / "adapter_config.json"
    weights_file = path / "adapters.safetensors"
    if not path.is_dir():
        raise AdapterError(f"--lora {path}: not a folder (expected mlx-lm's adapter folder)")
    for f in (config_file, weights_file):
        if not f.is_file():
            raise AdapterError(f"--lora {path}: no {f.name} in it (mlx-lm's adapter format)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise AdapterError(f"--lora {path}: adapter_config.json is not JSON ({e})") from None
    try:
        kind = config.get("fine_tune_type", "lora")
        scale = float(config["lora_parameters"]["scale"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise AdapterError(
            f"--lora {path}: adapter_config.json has no number at lora_parameters.scale"
        ) from None
    if kind != "lora":
        raise AdapterError(f"--lora {path}: fine_tune_type {kind!r}; only 'lora' is served")
    try:
        weights = mx.load(str(weights_file))
    except Exception as e:  # mlx raises plain RuntimeError/ValueError for a bad file
        raise AdapterError(f"--lora {path}: adapters.safetensors unreadable ({e})") from None
    assert isinstance(weights, dict)
    layers: dict[str, tuple[mx.array, mx.array]] = {}
    for name in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise AdapterError(f"--lora {path}: {name} is not a LoRA weight (lora_a / lora_b)")
        if leaf == "lora_a":
            b = weights.get(prefix + ".lora_b")
            if b is None:
                raise AdapterError(f"--lora {path}: {name} has no {prefix}.lora_b")
            layers[prefix] = (weights[name], b * scale)
    if not layers:
        raise AdapterError(f"--lora {path}: adapters.safetensors holds no LoRA weights")
    return Adapter(path, layers)


class RowScales:
    """The scales of the forward pass being made: rows x adapters, or None (no adapter)."""

    def __init__(self) -> None:
        self.current: mx.array | None = None
        # Per adapter set of a layer: its (rows, R) column scales for this pass. Layers
        # adapted by the same adapters (usually all) share one: one gather a pass, not one
        # a layer (each small op costs about as much as a decode token's matmul here).
        self._columns: dict[tuple[tuple[int, ...], Any], mx.array] = {}

    def set(self, scales: mx.array | None) -> None:
        self.current = scales
        self._columns.clear()

    def columns(self, owners: tuple[int, ...], owner: mx.array, dtype: Any) -> mx.array:
        assert self.current is not None
        key = (owners, dtype)
        col = self._columns.get(key)
        if col is None:
            col = self.current[:, owner].astype(dtype)[:, None, :]
            self._columns[key] = col
        return col


class MultiLoraLinear(nn.Module):
    """A linear layer plus every adapter that adapts it (see the module docstring)."""

    def __init__(
        self, base: nn.Module, parts: list[tuple[int, mx.array, mx.array]], rows: RowScales
    ) -> None:
        super().__init__()
        self.base = base
        dtype = _dtype(base)
        self._a = mx.concatenate([a for _, a, _ in parts], axis=1).astype(dtype)
        self._b = mx.concatenate([b for _, _, b in parts], axis=0).astype(dtype)
        # Per column of A: the adapter it belongs to (an index into a row's scales).
        self._owners = tuple(k for k, a, _ in parts for _ in range(a.shape[1]))
        self._owner = mx.array(self._owners)
        self._rows = rows
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y: mx.array = self.base(x)
        scales = self._rows.current
        if scales is None:
            return y
        # (rows, 1, R): each column scaled by its row's scale for the adapter owning it.
        z = (x @ self._a) * self._rows.columns(self._owners, self._owner, x.dtype)
        # One fused op for y + z @ B (a row at scale 0 adds exact zeros: it gets y).
        out: mx.array = mx.addmm(y, z, self._b)
        return out


def _dtype(linear: nn.Module) -> Any:
    if isinstance(linear, nn.QuantizedLinear):
        return linear.scales.dtype
    if isinstance(linear, NativeKQuantLinear):
        return mx.float32  # what its matmul gives
    return linear.weight.dtype


def _dims(linear: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a linear layer, or None for a module an adapter cannot adapt."""
    if isinstance(linear, nn.QuantizedLinear):
        out, packed = linear.weight.shape
        return packed * 32 // linear.bits, out
    if isinstance(linear, NativeKQuantLinear):
        return linear.input_dims, linear.output_dims
    if isinstance(linear, nn.Linear):
        out, inp = linear.weight.shape
        return inp, out
    return None


def install(model: nn.Module, adapters: Sequence[Adapter], rows: RowScales) -> None:
    """Wrap every layer some adapter adapts; AdapterError when one does not fit the model."""
    modules = dict(model.named_modules())
    parts: dict[str, list[tuple[int, mx.array, mx.array]]] = {}
    for k, adapter in enumerate(adapters):
        for name, (a, b) in adapter.layers.items():
            module = modules.get(name)
            dims = _dims(module) if module is not None else None
            if dims is None:
                raise AdapterError(
                    f"--lora {adapter.path}: the model has no linear layer {name} "
                    "(an adapter trained for another model?)"
                )
            r = a.shape[1] if a.ndim == 2 else -1
            if a.shape != (dims[0], r) or b.shape != (r, dims[1]):
                raise AdapterError(
                    f"--lora {adapter.path}: {name} is {dims[0]} -> {dims[1]}, the adapter's "
                    f"A {tuple(a.shape)} / B {tuple(b.shape)} do not fit it"
                )
            parts.setdefault(name, []).append((k, a, b))
    wrapped = [(name, MultiLoraLinear(modules[name], p, rows)) for name, p in parts.items()]
    model.update_modules(tree_unflatten(wrapped))
    mx.eval(model.parameters())


class LoraModel:
    """The model as the batches call it: before each forward pass, the scales of the rows
    making it are set (``scales_for(caller, cache, n_rows)``: rows x adapters, None when none
    uses an adapter); everything else is the model's."""

    def __init__(
        self,
        model: Any,
        rows: RowScales,
        scales_for: Callable[[Any, Any, int], mx.array | None],
    ) -> None:
        self._model = model
        self._rows = rows
        self._scales_for = scales_for

    def __call__(self, inputs: mx.array, *args: Any, cache: Any = None, **kw: Any) -> Any:
        # The batch making this pass is its caller (mlx-lm's batches, ours, the speculative
        # one: each calls ``self.model(..., cache=self.prompt_cache)`` from a method of its
        # own, some on a batch that exists only for that call, such as a split being
        # started): its ``uids`` name the rows, in order.
        caller = sys._getframe(1).f_locals.get("self")
        self._rows.set(self._scales_for(caller, cache, int(inputs.shape[0])))
        try:
            return self._model(inputs, *args, cache=cache, **kw)
        finally:
            self._rows.set(None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def scale_tag(scales: Sequence[float]) -> str:
    """What a prompt-cache key carries so KV computed under one set of adapter scales is
    never served to a request under another ('' for no adapter: the base model's entries)."""
    if not any(scales):
        return ""
    return LORA_TAG + ",".join(repr(float(s)) for s in scales)

"""GGUF blocks kept as stored in a converted model folder, and put in place at load.

MLX's affine layout holds a GGUF's Q4_K matrices in 5 bits a weight (a float16 scale and bias
per 32) and its Q6_K ones in 9 (requantised to 8 bits: sub-blocks of 16 do not fit a group of
32), where the file takes 4.5 and 6.56 (``gguf_read``). So the folder holds each such matrix
twice: as affine triplets in ``model.safetensors`` (what mlx-lm loads, and what every device
can run) and as the file's own blocks in ``BLOCKS_FILE``, under the layer's name plus its
format's suffix (``gguf_read.BLOCK_SUFFIXES``). mlx-lm reads only ``model*.safetensors``; where
the native kernels run, ``install`` swaps the layers for ``NativeKQuantLinear`` /
``NativeKQuantEmbedding`` over the blocks before anything is evaluated, so the affine copy is
never read from disk and the weights are the file's.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear

from mlxcel.models.gguf_read import BLOCK_SUFFIXES
from mlxcel.models.mlx_setup import mx
from mlxcel.native import kquants
from mlxcel.native.layers import NativeKQuantEmbedding, NativeKQuantLinear

__all__ = ["BLOCKS_FILE", "install", "save"]

BLOCKS_FILE = "gguf-blocks.safetensors"


def save(dest: Path, blocks: dict[str, mx.array]) -> None:
    """Write ``blocks`` (layer name + a ``BLOCK_SUFFIXES`` suffix -> uint8 blocks
    [N, K / 256 * block bytes]) into the folder ``dest``; nothing when there are none."""
    if blocks:
        mx.save_safetensors(str(dest / BLOCKS_FILE), blocks, metadata={"format": "gguf-blocks"})


def _dims(module: Module) -> tuple[int, int] | None:
    """(rows, inputs) of a Linear or Embedding layer, quantised or not; None for others."""
    if isinstance(module, QuantizedLinear | QuantizedEmbedding):
        rows, packed = module["weight"].shape
        return rows, packed * 32 // module.bits
    if isinstance(module, Linear | Embedding):
        rows, inputs = module["weight"].shape
        return rows, inputs
    return None


def _replacement(module: Module | None, blocks: mx.array, fmt: str) -> Module | None:
    dims = None if module is None else _dims(module)
    if module is None or dims != (blocks.shape[0], kquants.inputs(blocks, fmt)):
        return None  # a name or shape mlx-lm's model changed: its affine copy serves
    if isinstance(module, Embedding | QuantizedEmbedding):
        return NativeKQuantEmbedding(blocks, fmt)
    return NativeKQuantLinear(blocks, fmt, module["bias"] if "bias" in module else None)


def install(model: Module, folder: Path) -> int:
    """Swap the layers of ``model`` whose blocks ``folder`` holds for the native K-quant
    layers, in place (call before the model's weights are evaluated, on the CPU with the native
    kernels available); returns how many."""
    from mlx.utils import tree_unflatten

    path = folder / BLOCKS_FILE
    if not path.is_file():
        return 0
    modules = dict(model.named_modules())
    replaced: list[tuple[str, Module]] = []
    stored = cast(dict[str, mx.array], mx.load(str(path)))  # safetensors: a dict
    for key, blocks in stored.items():
        suffix = next((s for s in BLOCK_SUFFIXES.values() if key.endswith(s)), None)
        if suffix is None:
            continue
        name = key.removesuffix(suffix)
        new = _replacement(modules.get(name), blocks, suffix.removeprefix("."))
        if new is not None:
            replaced.append((name, new))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced)

"""GGUF blocks kept as stored in a converted model folder, and put in place at load.

A GGUF's Q6_K matrices cannot be repacked exactly into MLX's affine layout (``gguf_read``), so
the folder holds each twice: as 8-bit affine triplets in ``model.safetensors`` (what mlx-lm
loads, and what every device can run) and as the file's own blocks in ``BLOCKS_FILE``, under
the layer's name plus ``gguf_read.Q6K_SUFFIX``. mlx-lm reads only ``model*.safetensors``;
where the native kernels run, ``install`` swaps the layers for ``NativeQ6kLinear`` /
``NativeQ6kEmbedding`` over the blocks before anything is evaluated, so the 8-bit copy is never
read from disk and the weights are the file's (6.56 bits a weight, not 9).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear

from mlxcel.models.gguf_read import Q6K_SUFFIX
from mlxcel.models.mlx_setup import mx
from mlxcel.native import q6k
from mlxcel.native.layers import NativeQ6kEmbedding, NativeQ6kLinear

__all__ = ["BLOCKS_FILE", "install", "save"]

BLOCKS_FILE = "gguf-blocks.safetensors"


def save(dest: Path, blocks: dict[str, mx.array]) -> None:
    """Write ``blocks`` (layer name + ``Q6K_SUFFIX`` -> uint8 blocks [N, K / 256 * 210]) into the
    folder ``dest``; nothing when there are none."""
    if blocks:
        mx.save_safetensors(str(dest / BLOCKS_FILE), blocks, metadata={"format": "gguf-q6_k"})


def _dims(module: Module) -> tuple[int, int] | None:
    """(rows, inputs) of a Linear or Embedding layer, quantised or not; None for others."""
    if isinstance(module, QuantizedLinear | QuantizedEmbedding):
        rows, packed = module["weight"].shape
        return rows, packed * 32 // module.bits
    if isinstance(module, Linear | Embedding):
        rows, inputs = module["weight"].shape
        return rows, inputs
    return None


def _replacement(module: Module | None, blocks: mx.array) -> Module | None:
    dims = None if module is None else _dims(module)
    if module is None or dims != (blocks.shape[0], q6k.inputs(blocks)):
        return None  # a name or shape mlx-lm's model changed: its 8-bit copy serves
    if isinstance(module, Embedding | QuantizedEmbedding):
        return NativeQ6kEmbedding(blocks)
    return NativeQ6kLinear(blocks, module["bias"] if "bias" in module else None)


def install(model: Module, folder: Path) -> int:
    """Swap the layers of ``model`` whose blocks ``folder`` holds for the native Q6_K layers,
    in place (call before the model's weights are evaluated, on the CPU with the native kernels
    available); returns how many."""
    from mlx.utils import tree_unflatten

    path = folder / BLOCKS_FILE
    if not path.is_file():
        return 0
    modules = dict(model.named_modules())
    replaced: list[tuple[str, Module]] = []
    stored = cast(dict[str, mx.array], mx.load(str(path)))  # safetensors: a dict
    for key, blocks in stored.items():
        if not key.endswith(Q6K_SUFFIX):
            continue
        name = key.removesuffix(Q6K_SUFFIX)
        new = _replacement(modules.get(name), blocks)
        if new is not None:
            replaced.append((name, new))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced)

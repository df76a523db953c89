"""Convert a GGUF file into an MLX model folder.

The folder holds ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``, so
``mlx_lm.utils.load(folder)`` and ``transformers.AutoTokenizer`` read it
directly. ``gguf_read`` decodes the file (quantised tensors as MLX affine
triplets ``x.weight``, ``x.scales``, ``x.biases``, group 32); ``gguf_arch`` names
the tensors and builds the config; ``gguf_tokenizer`` rebuilds the tokenizer from
the vocabulary in the metadata. A quantised folder also keeps the file's Q4_K and
Q6_K blocks as stored, for the native CPU kernels (``gguf_blocks``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from mlxcel.models import gguf_blocks
from mlxcel.models.gguf_arch import config_from_metadata, convert_tensor
from mlxcel.models.gguf_read import BLOCK_SUFFIXES, GROUP_SIZE, read_gguf
from mlxcel.models.gguf_tokenizer import build_tokenizer, generation_config, tokenizer_config
from mlxcel.models.mlx_setup import mx

__all__ = ["GROUP_SIZE", "convert_gguf"]


def _quant_params(weights: dict[str, mx.array], name: str) -> tuple[int, int]:
    packed, scales = weights[f"{name}.weight"], weights[f"{name}.scales"]
    in_dims = scales.shape[-1] * GROUP_SIZE
    return GROUP_SIZE, packed.shape[-1] * 32 // in_dims


def _convert_weights(
    raw: dict[str, mx.array], config: dict[str, Any], *, keep_quantized: bool
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    weights: dict[str, mx.array] = {}
    for name, array in raw.items():
        converted = convert_tensor(name, array, config)
        if converted is not None:
            weights[converted[0]] = converted[1]

    quantized = sorted(n[: -len(".scales")] for n in weights if n.endswith(".scales"))
    if keep_quantized:
        if not quantized:
            return weights, None
        layer_bits = {n: _quant_params(weights, n)[1] for n in quantized}
        common = Counter(layer_bits.values()).most_common(1)[0][0]
        block: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
        # Per-layer entries where bits differ (Q8_0 embeddings in a Q4_1 file):
        # mlx_lm reads these before it falls back to the defaults.
        for n, b in layer_bits.items():
            if b != common:
                block[n] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
        return weights, block

    for n in quantized:
        group_size, bits = _quant_params(weights, n)
        # Float32 scales/biases: dequantising in float16 would round every value.
        weights[f"{n}.weight"] = mx.dequantize(
            weights[f"{n}.weight"],
            weights.pop(f"{n}.scales").astype(mx.float32),
            weights.pop(f"{n}.biases").astype(mx.float32),
            group_size=group_size,
            bits=bits,
        )
    return {k: v.astype(mx.float32) for k, v in weights.items()}, None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, dest: Path, *, keep_quantized: bool = False) -> Path:
    """Write an MLX model folder for ``gguf_path`` into ``dest`` (created) and return it.

    Weights are dequantised to float32 (CPU float32 matmuls are the fast path
    here); ``keep_quantized=True`` writes the affine triplets and the
    ``quantization`` config block instead, losslessly and ~5x smaller, and
    the Q4_K and Q6_K matrices' blocks as stored beside them (``gguf_blocks``).
    """
    gguf = read_gguf(gguf_path)
    raw, md = gguf.tensors, gguf.metadata
    suffixes = tuple(BLOCK_SUFFIXES.values())
    stored = {n: raw.pop(n) for n in [n for n in raw if n.endswith(suffixes)]}
    long, short = raw.get("rope_factors_long.weight"), raw.get("rope_factors_short.weight")
    config = config_from_metadata(
        md,
        tied="output.weight" not in raw,
        rope_freqs=raw.get("rope_freqs.weight"),
        rope_factors=None if long is None and short is None else (long, short),
    )
    weights, quantization = _convert_weights(raw, config, keep_quantized=keep_quantized)
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization

    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    if keep_quantized:
        blocks = {}
        for name, array in stored.items():
            converted = convert_tensor(name, array, config)  # q/k rows unpermuted, renamed
            if converted is not None:
                blocks[converted[0]] = converted[1]
        gguf_blocks.save(dest, blocks)
    _write_json(dest / "config.json", config)
    build_tokenizer(md).save(str(dest / "tokenizer.json"))
    _write_json(
        dest / "tokenizer_config.json", tokenizer_config(md, config["max_position_embeddings"])
    )
    _write_json(dest / "generation_config.json", generation_config(md))
    return dest

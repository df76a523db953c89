"""A tiny random-weight llama with SmolLM2's real tokenizer, for fast tests.

2 layers, hidden 64, 4 heads / 2 KV heads, 49,152-token vocabulary: ~28 MB,
loads in well under a second and decodes at a few hundred tokens/s on CPU.
The output layer is untied on purpose: with random *tied* weights the logits
favour the input token, so greedy decoding repeats one token forever.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mlxcel.models.mlx_setup import mx
from mlxcel.models.resolve import resolve_model

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 2048,
    "vocab_size": 49152,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _shapes() -> list[tuple[str, tuple[int, ...]]]:
    c = TINY_CONFIG
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q_dims = c["num_attention_heads"] * c["head_dim"]
    kv_dims = c["num_key_value_heads"] * c["head_dim"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (q_dims, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv_dims, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv_dims, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, q_dims)),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{p}.mlp.up_proj.weight", (inter, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, inter)),
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
        ]
    return [*shapes, ("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def _random_weights(seed: int) -> dict[str, mx.array]:
    import numpy as np

    # numpy's seeded generator gives the same numbers on every machine;
    # mlx_lm loads strictly, so a wrong name or shape fails loudly.
    rng = np.random.default_rng(seed)
    weights: dict[str, mx.array] = {}
    for name, shape in _shapes():
        if name.endswith("norm.weight"):
            array = np.ones(shape, dtype=np.float32)
        else:
            array = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        weights[name] = mx.array(array)
    return weights


def build_tiny_model(
    dest: Path,
    *,
    chat_template: str | None = None,
    cache_dir: Path | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write the tiny model folder into ``dest`` (created) and return ``dest``.

    ``dtype`` is the precision the weights are stored in ("float32", "bfloat16", ...).
    The tokenizer files come from the cached conversion of the packaged
    SmolLM2 GGUF (``cache_dir`` defaults to ``$MLXCEL_CACHE_DIR``), and so does
    the chat template unless ``chat_template`` is given.
    """
    source = resolve_model(None, cache_dir).path
    dest.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(source / name, dest / name)
    if chat_template is not None:
        config_path = dest / "tokenizer_config.json"
        tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
        tokenizer_config["chat_template"] = chat_template
        config_path.write_text(
            json.dumps(tokenizer_config, indent=2, ensure_ascii=False), encoding="utf-8"
        )
    config = {**TINY_CONFIG, "torch_dtype": dtype}
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in _random_weights(seed).items()}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dest

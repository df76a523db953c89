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


def _shapes(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
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


def _random_weights(seed: int, config: dict[str, Any]) -> dict[str, mx.array]:
    import numpy as np

    # numpy's seeded generator gives the same numbers on every machine;
    # mlx_lm loads strictly, so a wrong name or shape fails loudly.
    rng = np.random.default_rng(seed)
    weights: dict[str, mx.array] = {}
    for name, shape in _shapes(config):
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
    special_tokens: tuple[str, ...] = (),
    eos_tokens: tuple[str, ...] = (),
) -> Path:
    """Write the tiny model folder into ``dest`` (created) and return ``dest``.

    ``dtype`` is the precision the weights are stored in ("float32", "bfloat16", ...).
    The tokenizer files come from the cached conversion of the packaged
    SmolLM2 GGUF (``cache_dir`` defaults to ``$MLXCEL_CACHE_DIR``), and so does
    the chat template unless ``chat_template`` is given. ``special_tokens`` are added to the
    vocabulary (after SmolLM2's, the embeddings grown to match) as a family's real tokenizer
    has them; those in ``eos_tokens`` end generation too.
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
    if special_tokens:
        config = _add_special_tokens(dest, config, special_tokens, eos_tokens)
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in _random_weights(seed, config).items()}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dest


def _add_special_tokens(
    dest: Path, config: dict[str, Any], tokens: tuple[str, ...], eos: tuple[str, ...]
) -> dict[str, Any]:
    """Append ``tokens`` to the tokenizer as special tokens; the config with the vocabulary
    (and, with ``eos``, the end-of-generation ids) that covers them."""
    first = int(config["vocab_size"])
    ids = {token: first + i for i, token in enumerate(tokens)}
    path = dest / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    entry = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    tokenizer["added_tokens"] += [
        {"id": i, "content": t, **entry, "special": True} for t, i in ids.items()
    ]
    path.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    config_path = dest / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    decoder = tokenizer_config.setdefault("added_tokens_decoder", {})
    for t, i in ids.items():
        decoder[str(i)] = {"content": t, **entry, "special": True}
    config_path.write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False), encoding="utf-8"
    )
    eos_ids = [config["eos_token_id"], *(ids[t] for t in eos)]
    if eos:
        generation = dest / "generation_config.json"
        gen = json.loads(generation.read_text(encoding="utf-8"))
        generation.write_text(json.dumps({**gen, "eos_token_id": eos_ids}), encoding="utf-8")
    return {**config, "vocab_size": first + len(tokens), "eos_token_id": eos_ids}

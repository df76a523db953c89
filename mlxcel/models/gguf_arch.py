"""GGUF architectures: the HF config mlx-lm builds the model from, and tensor names.

Each supported ``general.architecture`` maps onto an mlx-lm model class; its metadata keys
(``{arch}.*``) become the config, and llama.cpp's tensor names become the HF ones.
"""

from __future__ import annotations

from typing import Any

from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.gguf_meta import ROLE_KEYS as _ROLE_KEYS
from mlxcel.models.gguf_meta import f32 as _f32
from mlxcel.models.gguf_meta import require as _require
from mlxcel.models.gguf_meta import value as _value
from mlxcel.models.mlx_setup import mx

__all__ = ["config_from_metadata", "convert_tensor", "hf_name", "unpermute"]

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def config_from_metadata(md: dict[str, Any], *, tied: bool) -> dict[str, Any]:
    """An HF ``LlamaForCausalLM`` config.json built from GGUF ``llama.*`` keys."""
    arch = _value(md, "general.architecture")
    if arch != "llama":
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported (only llama)")
    if _value(md, "llama.rope.scaling.type") not in (None, "none"):
        raise UnsupportedModel("GGUF with RoPE scaling is not supported yet")
    n_head = int(_require(md, "llama.attention.head_count"))
    hidden = int(_require(md, "llama.embedding_length"))
    vocab = _value(md, "llama.vocab_size") or len(md["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_require(md, "llama.block_count")),
        "intermediate_size": int(_require(md, "llama.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_value(md, "llama.attention.head_count_kv", n_head)),
        "head_dim": int(_value(md, "llama.attention.key_length", hidden // n_head)),
        # Metadata holds float32; round so 1e-5 is not written as 9.9999997e-06.
        "rms_norm_eps": _f32(_require(md, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_value(md, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_value(md, "llama.context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for role in ("bos", "eos", "pad"):
        token_id = _value(md, f"tokenizer.ggml.{_ROLE_KEYS[role]}")
        if token_id is not None:
            config[f"{role}_token_id"] = int(token_id)
    return config


def hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise UnsupportedModel(f"unexpected GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if base not in _GLOBAL_NAMES:
        raise UnsupportedModel(f"unexpected GGUF tensor {name!r}")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def unpermute(rows: mx.array, n_head: int) -> mx.array:
    # llama.cpp's convert_hf_to_gguf permute() interleaves each head's two
    # rotary halves: reshape(n, 2, d/2, ...).swapaxes(1, 2). Undo it. Row-only,
    # so it applies equally to packed weights, scales and biases.
    shape = rows.shape
    return (
        rows.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def convert_tensor(
    name: str, array: mx.array, config: dict[str, Any]
) -> tuple[str, mx.array] | None:
    """A GGUF tensor (or the ``.scales``/``.biases`` of a quantised one) as the HF name and
    array mlx-lm's model takes, or None for a tensor the model does not take. Transforms
    are row-wise, so a quantised tensor's three parts stay consistent."""
    if ".attn_q." in name:
        array = unpermute(array, config["num_attention_heads"])
    elif ".attn_k." in name:
        array = unpermute(array, config["num_key_value_heads"])
    return hf_name(name), array

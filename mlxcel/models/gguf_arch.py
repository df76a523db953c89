"""GGUF architectures: the HF config mlx-lm builds the model from, and tensor names.

Each served ``general.architecture`` maps onto an mlx-lm model class (``_ARCHS``); its
metadata keys (``{arch}.*``) become the config, and llama.cpp's tensor names become the HF
ones. What llama.cpp's converter (``convert_hf_to_gguf.py``) changed on the way in is undone:

- llama (and Mistral, whose GGUFs say llama): q/k rows permuted for llama.cpp's interleaved
  RoPE; ``unpermute``. Qwen, Gemma and Phi-3 use NeoX RoPE and are stored as trained.
- Gemma 2/3: every RMSNorm weight stored as ``1 + w`` (llama.cpp's norm has no offset,
  mlx-lm's Gemma norm adds 1); we subtract 1 again.
- Llama 3.1+ RoPE scaling: not keys but a ``rope_freqs`` tensor of per-frequency divisors;
  mlx-lm's ``longrope`` (SuScaledRoPE) takes exactly such a list, with no attention scale
  when its original and maximum context agree.
- Phi-3 LongRoPE (128k, 3.5, Phi-4-mini): ``rope_factors_long`` / ``rope_factors_short``
  tensors and a ``rope.scaling.attn_factor`` key become HF's ``longrope`` block with
  ``attention_factor``; which factors run is chosen when the model loads, for the context
  it is served with (``models/longrope.py``), as llama.cpp chooses them.

Transforms are row-wise (or on float-only norm vectors), so a quantised tensor's
``weight``/``scales``/``biases`` stay consistent.
"""

from __future__ import annotations

from typing import Any

from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.gguf_meta import ROLE_KEYS as _ROLE_KEYS
from mlxcel.models.gguf_meta import f32 as _f32
from mlxcel.models.gguf_meta import require as _require
from mlxcel.models.gguf_meta import value as _value
from mlxcel.models.mlx_setup import mx

__all__ = [
    "SERVED_ARCHITECTURES",
    "config_from_metadata",
    "convert_tensor",
    "hf_name",
    "unpermute",
]

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Per model_type, what differs from _LAYER_NAMES.
_LAYER_OVERRIDES: dict[str, dict[str, str]] = {
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "qwen3_moe": {
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
        "ffn_up_exps": "mlp.switch_mlp.up_proj",
        "ffn_down_exps": "mlp.switch_mlp.down_proj",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_LAYER_OVERRIDES["gemma3_text"] = _LAYER_OVERRIDES["gemma2"]
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# general.architecture -> (mlx-lm model_type, HF architectures entry)
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
SERVED_ARCHITECTURES = tuple(_ARCHS)
_GEMMA = {"gemma2", "gemma3_text"}


def config_from_metadata(
    md: dict[str, Any],
    *,
    tied: bool,
    rope_freqs: mx.array | None = None,
    rope_factors: tuple[mx.array | None, mx.array | None] | None = None,
) -> dict[str, Any]:
    """The HF config.json of the model the GGUF metadata ``md`` describes.

    ``tied``: the file has no ``output`` tensor. ``rope_freqs``: its ``rope_freqs.weight``
    (Llama 3.1+), if any. ``rope_factors``: its ``rope_factors_long.weight`` and
    ``rope_factors_short.weight`` (Phi-3 LongRoPE), None when it has neither. Raises
    UnsupportedModel for an architecture or RoPE not served."""
    arch = _value(md, "general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} is not served (served: {', '.join(SERVED_ARCHITECTURES)})"
        )
    model_type, hf_class = _ARCHS[arch]

    def key(name: str, default: Any = None) -> Any:
        return _value(md, f"{arch}.{name}", default)

    def need(name: str) -> Any:
        return _require(md, f"{arch}.{name}")

    n_head = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // n_head))
    n_layer = int(need("block_count"))
    vocab = key("vocab_size") or len(md["tokenizer.ggml.tokens"])
    context = int(key("context_length", 2048))
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": n_layer,
        "intermediate_size": int(key("feed_forward_length", 0)),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(key("attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        # Metadata holds float32; round so 1e-5 is not written as 9.9999997e-06.
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": context,
        "vocab_size": int(vocab),
        "tie_word_embeddings": tied,
        "hidden_act": "gelu_pytorch_tanh" if model_type in _GEMMA else "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    rotary = key("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        if model_type != "phi3":
            raise UnsupportedModel(f"GGUF {arch} with partial RoPE ({rotary} of {head_dim})")
        config["partial_rotary_factor"] = int(rotary) / head_dim
    scaling: dict[str, Any] | None
    if rope_factors is not None:
        if model_type != "phi3":
            raise UnsupportedModel(f"GGUF {arch} with LongRoPE factors (rope_factors_long)")
        scaling = _longrope(md, arch, context, rope_factors, int(rotary or head_dim))
    else:
        scaling = _rope_scaling(md, arch, context, rope_freqs)
    if scaling is not None:
        config["rope_scaling"] = scaling
    config.update(_ARCH_EXTRAS[model_type](md, arch, config))
    for role in ("bos", "eos", "pad"):
        token_id = _value(md, f"tokenizer.ggml.{_ROLE_KEYS[role]}")
        if token_id is not None:
            config[f"{role}_token_id"] = int(token_id)
    return config


def _factor_list(factors: mx.array | None, n: int) -> list[float]:
    if factors is None:  # llama.cpp then rotates with no factors: all 1
        return [1.0] * n
    listed: Any = factors.astype(mx.float32).reshape(-1).tolist()
    if len(listed) != n:
        raise UnsupportedModel(f"GGUF LongRoPE factors: {len(listed)} of them for {n} frequencies")
    return [float(f) for f in listed]


def _longrope(
    md: dict[str, Any],
    arch: str,
    context: int,
    factors: tuple[mx.array | None, mx.array | None],
    rotary: int,
) -> dict[str, Any]:
    kind = _value(md, f"{arch}.rope.scaling.type")
    factor = _value(md, f"{arch}.rope.scaling.factor")
    if kind not in (None, "none", "linear", "longrope") or factor not in (None, 0, 1):
        # llama.cpp would stack that scaling onto the factors; no file we know does.
        raise UnsupportedModel(f"GGUF {arch} with LongRoPE factors and {kind!r} RoPE scaling")
    long, short = factors
    return {
        "type": "longrope",
        "long_factor": _factor_list(long, rotary // 2),
        "short_factor": _factor_list(short, rotary // 2),
        # llama.cpp's n_ctx_orig_yarn: the context above which the long factors run.
        "original_max_position_embeddings": int(
            _value(md, f"{arch}.rope.scaling.original_context_length", context)
        ),
        # llama.cpp multiplies cos and sin by this key (default 1), whichever factors run;
        # the converter wrote sqrt(1 + ln(max / original) / ln(original)) into it.
        "attention_factor": _f32(_value(md, f"{arch}.rope.scaling.attn_factor", 1.0)),
    }


def _rope_scaling(
    md: dict[str, Any], arch: str, context: int, rope_freqs: mx.array | None
) -> dict[str, Any] | None:
    kind = _value(md, f"{arch}.rope.scaling.type")
    factor = _value(md, f"{arch}.rope.scaling.factor")
    if kind is None and _value(md, f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", _value(md, f"{arch}.rope.scale_linear")  # older files
    if kind in (None, "none"):
        if rope_freqs is None:
            return None
        listed: Any = rope_freqs.astype(mx.float32).reshape(-1).tolist()
        divisors = [float(f) for f in listed]
        # SuScaledRoPE divides each frequency by its factor, as llama.cpp does with
        # rope_freqs; equal original and maximum context keep its attention scale at 1.
        return {
            "type": "longrope",
            "long_factor": divisors,
            "short_factor": divisors,
            "original_max_position_embeddings": context,
        }
    if rope_freqs is not None:
        raise UnsupportedModel(f"GGUF {arch} with both rope_freqs and {kind!r} RoPE scaling")
    if kind == "linear":
        return {"type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {
            "type": "yarn",
            "factor": _f32(factor),
            "original_max_position_embeddings": int(
                _require(md, f"{arch}.rope.scaling.original_context_length")
            ),
        }
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            found = _value(md, f"{arch}.rope.scaling.{gguf_key}")
            if found is not None:
                scaling[hf_key] = _f32(found)
        return scaling
    raise UnsupportedModel(
        f"GGUF {arch} RoPE scaling {kind!r} is not served (served: linear, yarn, llama3 factors)"
    )


def _no_extras(md: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    return {}


def _qwen3_moe(md: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    expert_ff = int(_require(md, f"{arch}.expert_feed_forward_length"))
    return {
        "num_experts": int(_require(md, f"{arch}.expert_count")),
        "num_experts_per_tok": int(_require(md, f"{arch}.expert_used_count")),
        "moe_intermediate_size": expert_ff,
        "intermediate_size": config["intermediate_size"] or expert_ff,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # llama.cpp's qwen3moe graph renormalises the chosen experts' weights.
        "norm_topk_prob": True,
    }


def _gemma_scalar(config: dict[str, Any], big_layers: int) -> int:
    # llama.cpp scales queries by 1/sqrt(head_dim), except the 27B models (46 layers for
    # Gemma 2, 62 for Gemma 3), which use hidden_size / heads as HF's query_pre_attn_scalar.
    if config["num_hidden_layers"] == big_layers:
        return int(config["hidden_size"] // config["num_attention_heads"])
    return int(config["head_dim"])


def _gemma2(md: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "attn_logit_softcapping": _f32(_value(md, f"{arch}.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": _f32(_value(md, f"{arch}.final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": _gemma_scalar(config, 46),
        # On the even layers (models/gemma2_layers.py); llama.cpp's default when unkeyed.
        "sliding_window": int(_value(md, f"{arch}.attention.sliding_window", 4096)),
    }


def _gemma3(md: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    if _value(md, f"{arch}.final_logit_softcapping") is not None:
        raise UnsupportedModel("GGUF gemma3 with final logit soft-capping is not served")
    return {
        "query_pre_attn_scalar": _gemma_scalar(config, 62),
        "sliding_window": int(_require(md, f"{arch}.attention.sliding_window")),
        # llama.cpp: five sliding-window layers, then a global one; local RoPE base 10000.
        "sliding_window_pattern": 6,
        "rope_local_base_freq": _f32(_value(md, f"{arch}.rope.freq_base_swa", 10000.0)),
    }


def _phi3(md: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    original = _value(md, f"{arch}.rope.scaling.original_context_length")
    return {"original_max_position_embeddings": int(original or config["max_position_embeddings"])}


_ARCH_EXTRAS = {
    "llama": _no_extras,
    "qwen2": _no_extras,
    "qwen3": _no_extras,
    "qwen3_moe": _qwen3_moe,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
}


def hf_name(name: str, model_type: str = "llama") -> str:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        names = {**_LAYER_NAMES, **_LAYER_OVERRIDES.get(model_type, {})}
        if part not in names:
            raise UnsupportedModel(f"unexpected GGUF tensor {name!r} for {model_type}")
        return f"model.layers.{layer}.{names[part]}.{suffix}"
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
    if name.startswith(("rope_freqs.", "rope_factors_")):
        return None  # config_from_metadata put it into rope_scaling
    model_type = config.get("model_type", "llama")
    if model_type == "llama":
        if ".attn_q." in name:
            array = unpermute(array, config["num_attention_heads"])
        elif ".attn_k." in name:
            array = unpermute(array, config["num_key_value_heads"])
    elif model_type in _GEMMA and name.endswith("norm.weight"):
        array = array.astype(mx.float32) - 1.0
    return hf_name(name, model_type), array

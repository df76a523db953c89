"""Convert a llama-architecture GGUF file into an MLX model folder.

The folder holds ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``, so
``mlx_lm.utils.load(folder)`` and ``transformers.AutoTokenizer`` read it
directly. ``mx.load`` already decodes GGUF: Q4_0/Q4_1/Q8_0 tensors come back
as MLX affine triplets (``x.weight``, ``x.scales``, ``x.biases``, group 32).
What is left is naming, undoing llama.cpp's q/k row permutation, the config,
and rebuilding the tokenizer from the vocabulary in the metadata.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.mlx_setup import mx

__all__ = ["GROUP_SIZE", "build_tokenizer", "config_from_metadata", "convert_gguf"]

# mx.load unpacks every GGUF block format it supports with 32-value groups.
GROUP_SIZE = 32

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

# Pre-tokenizer regexes from llama.cpp (src/llama-vocab.cpp), keyed by
# ``tokenizer.ggml.pre``. None means "GPT-2's regex", which the ByteLevel
# pre-tokenizer applies itself.
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_RES = {"llama-bpe": _LLAMA3_RE, "llama3": _LLAMA3_RE, "qwen2": _QWEN2_RE}
_GPT2_STYLE = {"default", "gpt-2", "gpt2", "smollm", "starcoder"}
# Tokens llama.cpp marks CONTROL (special) and USER_DEFINED (added, not special).
_CONTROL, _USER_DEFINED = 3, 4
# HF role -> GGUF metadata key (llama.cpp spells two of them out).
_ROLE_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "pad": "padding_token_id",
}


def _value(md: dict[str, Any], key: str, default: Any = None) -> Any:
    value = md.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def _f32(value: Any) -> float:
    return float(f"{float(value):.7g}")


def _require(md: dict[str, Any], key: str) -> Any:
    value = _value(md, key)
    if value is None:
        raise UnsupportedModel(f"GGUF metadata lacks {key!r}")
    return value


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


def _hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise UnsupportedModel(f"unexpected GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if base not in _GLOBAL_NAMES:
        raise UnsupportedModel(f"unexpected GGUF tensor {name!r}")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def _unpermute(rows: mx.array, n_head: int) -> mx.array:
    # llama.cpp's convert_hf_to_gguf permute() interleaves each head's two
    # rotary halves: reshape(n, 2, d/2, ...).swapaxes(1, 2). Undo it. Row-only,
    # so it applies equally to packed weights, scales and biases.
    shape = rows.shape
    return (
        rows.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _quant_params(weights: dict[str, mx.array], name: str) -> tuple[int, int]:
    packed, scales = weights[f"{name}.weight"], weights[f"{name}.scales"]
    in_dims = scales.shape[-1] * GROUP_SIZE
    return GROUP_SIZE, packed.shape[-1] * 32 // in_dims


def _convert_weights(
    raw: dict[str, mx.array], config: dict[str, Any], *, keep_quantized: bool
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    weights: dict[str, mx.array] = {}
    for name, array in raw.items():
        hf = _hf_name(name)
        if ".attn_q." in name:
            array = _unpermute(array, config["num_attention_heads"])
        elif ".attn_k." in name:
            array = _unpermute(array, config["num_key_value_heads"])
        weights[hf] = array

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


def _token_types(md: dict[str, Any], n_tokens: int) -> list[int]:
    types = md.get("tokenizer.ggml.token_type")
    if not isinstance(types, mx.array):
        return [1] * n_tokens  # NORMAL: no added or special tokens known
    kinds = types.reshape(-1).tolist()
    assert isinstance(kinds, list)
    return [int(k) for k in kinds]  # type: ignore[arg-type]  # mlx types tolist() loosely


def build_tokenizer(md: dict[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to llama.cpp's BPE vocabulary."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = _value(md, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModel(f"GGUF tokenizer model {kind!r} is not supported (only gpt2 BPE)")
    pre = _value(md, "tokenizer.ggml.pre", "default")
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ")) for m in md.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise UnsupportedModel("GGUF BPE merges are not 'left right' pairs")
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # llama.cpp "smollm": every digit alone, then the GPT-2 regex.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _GPT2_STYLE:
        tok.pre_tokenizer = byte_level
    elif pre in _SPLIT_RES:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_RES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise UnsupportedModel(f"GGUF pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()

    kinds = _token_types(md, len(tokens))
    added = [
        AddedToken(tokens[i], special=(k == _CONTROL), normalized=False)
        for i, k in enumerate(kinds)
        if k in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)

    byte_post = processors.ByteLevel(trim_offsets=False)
    bos_id = _value(md, "tokenizer.ggml.bos_token_id")
    if _value(md, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.Sequence(
            [
                byte_post,
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, int(bos_id))],
                ),
            ]
        )
    else:
        tok.post_processor = byte_post
    return tok


def _tokenizer_config(md: dict[str, Any], context_length: int) -> dict[str, Any]:
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        # The generic class takes tokenizer.json as it is; a model-specific
        # class (LlamaTokenizer) would rebuild its own pipeline around it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_value(md, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_value(md, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    for role, key in _ROLE_KEYS.items():
        token_id = _value(md, f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[f"{role}_token"] = tokens[int(token_id)]
    roles = {config.get(f"{r}_token") for r in ("bos", "eos", "unk", "pad")}
    config["additional_special_tokens"] = [
        tokens[i]
        for i, k in enumerate(_token_types(md, len(tokens)))
        if k == _CONTROL and tokens[i] not in roles
    ]
    template = _value(md, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def _generation_config(md: dict[str, Any]) -> dict[str, Any]:
    eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = _value(md, f"tokenizer.ggml.{key}")
        if token_id is not None and int(token_id) not in eos:
            eos.append(int(token_id))
    config: dict[str, Any] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    for role in ("bos", "pad"):
        token_id = _value(md, f"tokenizer.ggml.{_ROLE_KEYS[role]}")
        if token_id is not None:
            config[f"{role}_token_id"] = int(token_id)
    return config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, dest: Path, *, keep_quantized: bool = False) -> Path:
    """Write an MLX model folder for ``gguf_path`` into ``dest`` (created) and return it.

    Weights are dequantised to float32 (CPU float32 matmuls are the fast path
    here); ``keep_quantized=True`` writes the affine triplets and the
    ``quantization`` config block instead, losslessly and ~5x smaller.
    """
    raw, md = mx.load(str(gguf_path), return_metadata=True)
    if not isinstance(raw, dict) or not isinstance(md, dict):
        raise UnsupportedModel(f"{gguf_path} did not load as a GGUF file")
    config = config_from_metadata(md, tied="output.weight" not in raw)
    weights, quantization = _convert_weights(raw, config, keep_quantized=keep_quantized)
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization

    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(dest / "config.json", config)
    build_tokenizer(md).save(str(dest / "tokenizer.json"))
    _write_json(
        dest / "tokenizer_config.json", _tokenizer_config(md, config["max_position_embeddings"])
    )
    _write_json(dest / "generation_config.json", _generation_config(md))
    return dest

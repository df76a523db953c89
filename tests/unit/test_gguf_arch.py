"""GGUF metadata -> config and tensor names, and the vocabulary edge cases llama.cpp has.

The numbers are checked against llama.cpp itself in test_gguf_oracle.py; these pin the
mapping facts and the refusals, fast and without model files.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.gguf_arch import config_from_metadata, convert_tensor
from mlxcel.models.gguf_tokenizer import add_bos, build_tokenizer, tokenizer_config
from mlxcel.models.mlx_setup import mx


def _md(arch: str, **extra: Any) -> dict[str, Any]:
    md: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.embedding_length": 64,
        f"{arch}.block_count": 2,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.context_length": 4096,
        "tokenizer.ggml.tokens": ["a", "b"],
    }
    md.update({k.replace("ARCH", arch): v for k, v in extra.items()})
    return md


def test_unserved_architecture_is_named_with_the_served_ones() -> None:
    with pytest.raises(UnsupportedModel, match=r"'mamba' is not served \(served: llama, qwen2"):
        config_from_metadata(_md("mamba"), tied=True)


def test_unserved_rope_scaling_is_refused() -> None:
    md = _md("llama", **{"llama.rope.scaling.type": "longrope"})
    with pytest.raises(UnsupportedModel, match="'longrope' is not served"):
        config_from_metadata(md, tied=True)


def test_llama3_rope_freqs_become_exact_longrope_factors() -> None:
    factors = mx.array([1.0, 1.0, 2.5, 32.0], dtype=mx.float32)
    config = config_from_metadata(_md("llama"), tied=False, rope_freqs=factors)
    assert config["rope_scaling"] == {
        "type": "longrope",
        "long_factor": [1.0, 1.0, 2.5, 32.0],
        "short_factor": [1.0, 1.0, 2.5, 32.0],
        "original_max_position_embeddings": 4096,
    }
    from mlx_lm.models.rope_utils import initialize_rope

    rope = initialize_rope(8, 500000.0, False, config["rope_scaling"], 4096)
    # llama.cpp divides each frequency by its factor and scales nothing else.
    base = 500000.0 ** (mx.arange(0, 8, 2, dtype=mx.float32) / 8)
    assert mx.allclose(rope._freqs, base * factors)
    assert rope._scale == 1.0
    assert convert_tensor("rope_freqs.weight", factors, config) is None


def test_linear_and_yarn_scaling_keys() -> None:
    linear = _md("llama", **{"ARCH.rope.scaling.type": "linear", "ARCH.rope.scaling.factor": 4.0})
    assert config_from_metadata(linear, tied=True)["rope_scaling"] == {
        "type": "linear",
        "factor": 4.0,
    }
    yarn = _md(
        "qwen2",
        **{
            "ARCH.rope.scaling.type": "yarn",
            "ARCH.rope.scaling.factor": 4.0,
            "ARCH.rope.scaling.original_context_length": 32768,
        },
    )
    assert config_from_metadata(yarn, tied=True)["rope_scaling"] == {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }


def test_only_llama_rows_are_unpermuted() -> None:
    rows = mx.arange(32 * 2).reshape(32, 2)
    llama = config_from_metadata(_md("llama"), tied=True)
    qwen = config_from_metadata(_md("qwen3", **{"ARCH.attention.key_length": 8}), tied=True)
    name, permuted = convert_tensor("blk.0.attn_q.weight", rows, llama) or ("", rows)
    assert name == "model.layers.0.self_attn.q_proj.weight"
    assert not mx.array_equal(permuted, rows)
    assert convert_tensor("blk.0.attn_q.weight", rows, qwen)[1] is rows  # type: ignore[index]
    assert convert_tensor("blk.1.attn_k_norm.weight", rows, qwen)[0] == (  # type: ignore[index]
        "model.layers.1.self_attn.k_norm.weight"
    )


def test_gemma_norms_lose_the_converters_plus_one() -> None:
    config = config_from_metadata(
        _md("gemma3", **{"ARCH.attention.sliding_window": 512, "ARCH.attention.key_length": 32}),
        tied=True,
    )
    assert config["model_type"] == "gemma3_text"
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (512, 6)
    assert config["query_pre_attn_scalar"] == 32  # head_dim, as llama.cpp scales
    norm = mx.array([1.5, 0.75])
    assert convert_tensor("blk.0.ffn_norm.weight", norm, config)[0] == (  # type: ignore[index]
        "model.layers.0.pre_feedforward_layernorm.weight"
    )
    for name in ("blk.0.post_ffw_norm.weight", "blk.0.attn_q_norm.weight", "output_norm.weight"):
        assert mx.array_equal(convert_tensor(name, norm, config)[1], mx.array([0.5, -0.25]))  # type: ignore[index]
    weight = mx.ones((4, 2))
    assert convert_tensor("blk.0.ffn_up.weight", weight, config)[1] is weight  # type: ignore[index]


def test_gemma2_27b_scales_queries_by_hidden_over_heads() -> None:
    md = _md("gemma2", **{"ARCH.block_count": 46, "ARCH.attention.key_length": 128})
    md["gemma2.embedding_length"], md["gemma2.attention.head_count"] = 4608, 32
    config = config_from_metadata(md, tied=True)
    assert config["query_pre_attn_scalar"] == 144
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)


def test_qwen3moe_experts_and_phi3_fused_projections() -> None:
    moe = config_from_metadata(
        _md(
            "qwen3moe",
            **{
                "ARCH.expert_count": 8,
                "ARCH.expert_used_count": 2,
                "ARCH.expert_feed_forward_length": 32,
            },
        ),
        tied=True,
    )
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["norm_topk_prob"]) == (8, 2, True)
    experts = mx.zeros((8, 32, 64))
    assert convert_tensor("blk.3.ffn_down_exps.weight", experts, moe)[0] == (  # type: ignore[index]
        "model.layers.3.mlp.switch_mlp.down_proj.weight"
    )
    assert convert_tensor("blk.3.ffn_gate_inp.weight", experts, moe)[0] == (  # type: ignore[index]
        "model.layers.3.mlp.gate.weight"
    )
    phi3 = config_from_metadata(_md("phi3"), tied=False)
    assert convert_tensor("blk.0.attn_qkv.weight", experts, phi3)[0] == (  # type: ignore[index]
        "model.layers.0.self_attn.qkv_proj.weight"
    )
    assert convert_tensor("blk.0.ffn_up.weight", experts, phi3)[0] == (  # type: ignore[index]
        "model.layers.0.mlp.gate_up_proj.weight"
    )


# A SentencePiece vocabulary small enough to read: control tokens, byte fallback, pieces.
_SPM_TOKENS = ["<unk>", "<s>", "</s>", "<|user|>"] + [f"<0x{b:02X}>" for b in range(256)]
_SPM_PIECES = ["\u2581", "h", "i", "\u2581h", "\u2581hi", "\n"]


def _spm(**extra: Any) -> dict[str, Any]:
    tokens = _SPM_TOKENS + _SPM_PIECES
    md: dict[str, Any] = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(_SPM_TOKENS) + [-5.0, -6.0, -7.0, -1.0, -0.5, -8.0],
        "tokenizer.ggml.token_type": [2, 3, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    md.update(extra)
    return md


def _pieces(tok: Any, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text, add_special_tokens=False).ids]


def test_sentencepiece_space_prefix_after_special_tokens_and_byte_fallback() -> None:
    tok = build_tokenizer(_spm())
    # llama.cpp puts the space before the text and after every special token.
    assert _pieces(tok, "hi<|user|>hi") == ["\u2581hi", "<|user|>", "\u2581hi"]
    assert _pieces(tok, "hé") == ["\u2581h", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("hi hé").ids) == "hi hé"
    # BOS by default for SentencePiece.
    assert tok.encode("hi").ids[0] == 1
    without_prefix = build_tokenizer(_spm(**{"tokenizer.ggml.add_space_prefix": False}))
    assert _pieces(without_prefix, "hi") == ["h", "i"]


def test_phi3_special_tokens_swallow_following_whitespace_by_model_name() -> None:
    text = "<|user|>\nhi"
    assert _pieces(build_tokenizer(_spm()), text) == ["<|user|>", "\u2581", "\n", "h", "i"]
    phi3 = build_tokenizer(_spm(**{"general.name": "Phi 3 Mini"}))
    assert _pieces(phi3, text) == _pieces(build_tokenizer(_spm()), text)  # "phi 3": no
    phi3 = build_tokenizer(_spm(**{"general.name": "Phi-3-mini-4k-instruct"}))
    assert _pieces(phi3, text) == ["<|user|>", "\u2581hi"]


def test_bos_defaults_follow_llama_cpp() -> None:
    bpe = {"tokenizer.ggml.model": "gpt2"}
    assert add_bos({**bpe, "tokenizer.ggml.pre": "llama-bpe"})
    assert add_bos({**bpe, "tokenizer.ggml.pre": "tekken"})
    assert not add_bos({**bpe, "tokenizer.ggml.pre": "qwen2"})
    assert not add_bos(
        {**bpe, "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": False}
    )
    assert add_bos({"tokenizer.ggml.model": "llama"})
    assert tokenizer_config(_spm(), 4096)["add_bos_token"] is True


def test_unserved_vocabularies_are_named() -> None:
    with pytest.raises(UnsupportedModel, match=r"'t5' is not served"):
        build_tokenizer({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    bpe = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(UnsupportedModel, match=r"'kimi-k2' is not served \(served: .*qwen2"):
        build_tokenizer({**bpe, "tokenizer.ggml.pre": "kimi-k2"})


def test_chat_template_chatml_by_default_and_bos_as_llama_server_adds_it() -> None:
    # No template in the file: llama-server chats in ChatML; BOS where the vocabulary adds it.
    spm = tokenizer_config(_spm(), 4096)["chat_template"]
    assert spm.startswith("{{ bos_token }}") and "<|im_start|>" in spm
    bpe = {**_spm(), "tokenizer.ggml.add_bos_token": False}
    assert tokenizer_config(bpe, 4096)["chat_template"].startswith("{% for message")
    # A template that names bos_token itself is kept as it is (llama-server drops the
    # duplicate BOS it would otherwise add).
    own = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tokenizer_config(_spm(**{"tokenizer.chat_template": own}), 4096)["chat_template"] == own
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with_bos = tokenizer_config(_spm(**{"tokenizer.chat_template": plain}), 4096)
    assert with_bos["chat_template"] == "{{ bos_token }}" + plain

"""GGUF vocabularies: the tokenizer.json, tokenizer_config.json and generation_config.json
that llama.cpp's ``tokenizer.ggml.*`` metadata describes."""

from __future__ import annotations

from typing import Any

from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.gguf_meta import ROLE_KEYS as _ROLE_KEYS
from mlxcel.models.gguf_meta import value as _value
from mlxcel.models.mlx_setup import mx

__all__ = ["build_tokenizer", "generation_config", "tokenizer_config"]

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


def _token_types(md: dict[str, Any], n_tokens: int) -> list[int]:
    types: Any = md.get("tokenizer.ggml.token_type")
    if types is None:
        return [1] * n_tokens  # NORMAL: no added or special tokens known
    if isinstance(types, mx.array):  # metadata as mx.load gives it
        types = types.reshape(-1).tolist()
    return [int(k) for k in types]


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


def tokenizer_config(md: dict[str, Any], context_length: int) -> dict[str, Any]:
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


def generation_config(md: dict[str, Any]) -> dict[str, Any]:
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

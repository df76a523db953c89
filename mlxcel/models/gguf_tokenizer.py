"""GGUF vocabularies: the tokenizer.json, tokenizer_config.json and generation_config.json
that llama.cpp's ``tokenizer.ggml.*`` metadata describes.

Two kinds are served, each rebuilt with the ``tokenizers`` library so that it cuts text as
llama.cpp's ``src/llama-vocab.cpp`` does:

- ``gpt2``: byte-level BPE. ``tokenizer.ggml.pre`` names the pre-tokenizer, a list of regexes
  applied in turn (``_PRE``); the llama3 and tekken ones also look a whole piece up in the
  vocabulary before merging (``ignore_merges``).
- ``llama``: SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3). llama.cpp merges the
  adjacent pair whose joined piece has the highest score; the same merges, ranked by that
  score, give a BPE model. Spaces become U+2581, a space is put before the text and after
  every special token when ``add_space_prefix`` holds (llama.cpp's default), and characters
  outside the vocabulary fall back to ``<0xNN>`` byte tokens.

Tokens llama.cpp marks CONTROL or USER_DEFINED are matched whole in the text before either
model runs (its "special token partition"), as ``tokenizers`` added tokens are.
"""

from __future__ import annotations

from typing import Any

from mlxcel.chat_templates import BUILT_IN, GGUF_DEFAULT
from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.gguf_meta import ROLE_KEYS as _ROLE_KEYS
from mlxcel.models.gguf_meta import floats as _floats
from mlxcel.models.gguf_meta import ints as _ints
from mlxcel.models.gguf_meta import value as _value

__all__ = ["SERVED_PRE_TOKENIZERS", "build_tokenizer", "generation_config", "tokenizer_config"]

# Pre-tokenizer regexes from llama.cpp's llm_tokenizer_bpe, in the spelling of the models'
# own tokenizer.json (llama.cpp rewrites (?i:...) and the tekken/gpt-4o letter classes for
# std::regex; the meaning is the same).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


def _group(names: str, regexes: tuple[str, ...], **flags: bool) -> dict[str, Any]:
    return {name: (regexes, flags) for name in names.split()}


# tokenizer.ggml.pre -> (regexes, flags), as llama_vocab::impl::load names them. Flags:
# ignore_merges (look the whole piece up first), add_bos (llama.cpp's default when the file
# does not say).
_PRE: dict[str, tuple[tuple[str, ...], dict[str, bool]]] = {
    **_group("default", _DEFAULT),
    **_group(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
        (_LLAMA3,),
        ignore_merges=True,
        add_bos=True,
    ),
    **_group("dbrx smaug-bpe", (_LLAMA3,)),
    **_group("qwen2 deepseek-r1-qwen kormo megrez stablelm2 hunyuan", (_QWEN2,)),
    **_group("tekken", (_TEKKEN,), ignore_merges=True, add_bos=True),
    **_group("gpt-2 phi-2 mpt olmo jais trillion exaone4 mellum", (_GPT2,)),
    **_group("starcoder refact command-r smollm codeshell exaone minerva-7b", (r"\p{N}", _GPT2)),
    **_group("gpt-4o llama4 minimax-m2", (_GPT4O,)),
}
SERVED_PRE_TOKENIZERS = tuple(sorted(_PRE))

# llama.cpp token types (llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"


def _token_types(md: dict[str, Any], n_tokens: int) -> list[int]:
    kinds = _ints(md, "tokenizer.ggml.token_type")
    return [_NORMAL] * n_tokens if kinds is None else kinds


def _tokens(md: dict[str, Any]) -> list[str]:
    return [str(t) for t in md["tokenizer.ggml.tokens"]]


def add_bos(md: dict[str, Any]) -> bool:
    """Whether llama.cpp puts BOS before a prompt: the file's flag, else its default for the
    vocabulary (SentencePiece and the llama3/tekken pre-tokenizers: yes)."""
    flag = _value(md, "tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag)
    if _value(md, "tokenizer.ggml.model") == "llama":
        return True
    _, flags = _PRE.get(_value(md, "tokenizer.ggml.pre", "default"), ((), {}))
    return bool(flags.get("add_bos", False))


_PHI3_KEEP_SPACE = {"<unk>", "<s>", "<|endoftext|>"}


def _rstrip_specials(md: dict[str, Any]) -> bool:
    # llama.cpp keys this on the model's name, not its vocabulary: for "phi-3"/"phi3" every
    # special token but <unk>, <s> and <|endoftext|> swallows the whitespace after it
    # (LLAMA_TOKEN_ATTR_RSTRIP), so "<|user|>\nhi" tokenizes as "<|user|>" "▁hi".
    name = str(_value(md, "general.name", "") or "").lower()
    return "phi-3" in name or "phi3" in name


def build_tokenizer(md: dict[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` that gives llama.cpp's token ids for this vocabulary."""
    from tokenizers import AddedToken, processors

    kind = _value(md, "tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level_bpe(md)
    elif kind == "llama":
        tok = _sentencepiece_bpe(md)
    else:
        raise UnsupportedModel(
            f"GGUF tokenizer model {kind!r} is not served (served: gpt2 byte-level BPE, "
            "llama SentencePiece)"
        )

    tokens = _tokens(md)
    rstrip = _rstrip_specials(md)
    added = [
        AddedToken(
            tokens[i],
            special=(k == _CONTROL),
            normalized=False,
            rstrip=rstrip and tokens[i] not in _PHI3_KEEP_SPACE,
        )
        for i, k in enumerate(_token_types(md, len(tokens)))
        if k in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)

    steps: list[Any] = [processors.ByteLevel(trim_offsets=False)] if kind == "gpt2" else []
    bos_id = _value(md, "tokenizer.ggml.bos_token_id")
    if add_bos(md) and bos_id is not None:
        bos = tokens[int(bos_id)]
        steps.append(
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, int(bos_id))],
            )
        )
    if steps:
        tok.post_processor = steps[0] if len(steps) == 1 else processors.Sequence(steps)
    return tok


def _byte_level_bpe(md: dict[str, Any]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = _value(md, "tokenizer.ggml.pre", "default")
    if pre not in _PRE:
        raise UnsupportedModel(
            f"GGUF pre-tokenizer {pre!r} is not served (served: {', '.join(SERVED_PRE_TOKENIZERS)})"
        )
    regexes, flags = _PRE[pre]
    tokens = _tokens(md)
    merges = [tuple(m.split(" ")) for m in md.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise UnsupportedModel("GGUF BPE merges are not 'left right' pairs")
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=flags.get("ignore_merges", False),
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(tokens: list[str], scores: list[float], kinds: list[int]) -> list[tuple[str, str]]:
    # llama.cpp's llm_tokenizer_spm joins the adjacent pair whose joined text is a token with
    # the highest score (ties: leftmost). Every split of such a token into two tokens is a
    # merge, ranked by that score.
    ids = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, str, str]] = []
    for i, token in enumerate(tokens):
        if kinds[i] in (_CONTROL, _BYTE, _UNUSED) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _sentencepiece_bpe(md: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = _tokens(md)
    kinds = _token_types(md, len(tokens))
    scores = _floats(md, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    if _value(md, "tokenizer.ggml.remove_extra_whitespaces", False):
        raise UnsupportedModel("GGUF SentencePiece with remove_extra_whitespaces is not served")
    unk_id = _value(md, "tokenizer.ggml.unknown_token_id", 0)
    vocab = {token: i for i, token in reversed(list(enumerate(tokens)))}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_spm_merges(tokens, scores, kinds),
            unk_token=tokens[int(unk_id)] if unk_id is not None else None,
            fuse_unk=False,
            byte_fallback=True,
        )
    )
    prefix = bool(_value(md, "tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", _SPACE)
    # A normalizer runs on each stretch of text between added tokens, so Prepend puts the
    # space after every special token too, as llama.cpp does (Metaspace would not when the
    # text already starts with a space).
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), escape]) if prefix else escape
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def tokenizer_config(md: dict[str, Any], context_length: int) -> dict[str, Any]:
    tokens = _tokens(md)
    config: dict[str, Any] = {
        # The generic class takes tokenizer.json as it is; a model-specific
        # class (LlamaTokenizer) would rebuild its own pipeline around it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos(md),
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
    # A file without a template is chatted with in ChatML, as llama-server does.
    template = _value(md, "tokenizer.chat_template") or BUILT_IN[GGUF_DEFAULT]
    if config["add_bos_token"] and "bos_token" not in template:
        # llama-server tokenizes the rendered chat with the vocabulary's BOS rule; the
        # server here tokenizes it as the template wrote it (HF's convention), so the
        # template says BOS itself. (One that names bos_token already gets exactly one BOS
        # from llama-server, which drops a duplicate.)
        template = "{{ bos_token }}" + template
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

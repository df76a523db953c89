"""Tiny random-weight GGUF files, one per served architecture, written as llama.cpp's
``convert_hf_to_gguf.py`` writes them (its tensor names and metadata keys), for checking
mlxcel's GGUF conversion against llama.cpp itself (``tools/bench/gguf_oracle.py``).

Deterministic: the same name gives the same bytes (seeded numpy, gguf-py's writer), so the
oracle's recorded answers apply to the file a test regenerates; ``sha256`` says so.

Vocabularies come from the packaged SmolLM2 GGUF: its byte-level BPE as it is (with another
``tokenizer.ggml.pre`` where the family uses one), or respelled as a SentencePiece vocabulary
(byte tokens, scores by merge rank, U+2581 for spaces) for the llama-2/Mistral, Phi-3 and
Gemma families. Float32 tensors, so both sides compute in float32 and differ only by
summation order; except the ``-quants`` models (``QUANT`` sizes, rows of whole 256-wide
K-quant super-blocks), whose weight matrices are stored in every block format mlxcel reads,
one per matrix (``tiny_quants.quantise``), as a Q4_K_M file mixes them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.tiny_quants import quantise

__all__ = ["MODELS", "Model", "sha256", "write_tiny_gguf"]

CONTEXT = 4096


@dataclasses.dataclass(frozen=True)
class Dims:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ff: int = 128
    layers: int = 2
    expert_ff: int = 48


TINY = Dims()
# Rows of 256 (and 512) inputs: whole K-quant super-blocks everywhere.
QUANT = Dims(hidden=256, head_dim=64, ff=512, expert_ff=256)


@functools.cache
def _smollm_vocab() -> dict[str, Any]:
    from gguf import GGUFReader

    from mlxcel.models.default import default_gguf_path

    reader = GGUFReader(str(default_gguf_path()))
    keys = ("tokens", "merges", "token_type", "bos_token_id", "eos_token_id", "unknown_token_id")
    return {k: reader.fields[f"tokenizer.ggml.{k}"].contents() for k in keys}


def _byte_decoder() -> dict[str, int]:
    # GPT-2's printable spelling of the 256 bytes, inverted: the server's own table.
    from mlxcel.actors.token_bytes import _byte_level_decoder

    return _byte_level_decoder()


@functools.cache
def _spm_vocab(gemma: bool) -> dict[str, Any]:
    """SmolLM2's pieces as a SentencePiece vocabulary: (tokens, scores, types, specials)."""
    decode = _byte_decoder()
    if gemma:
        head = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        ids = {"bos": 2, "eos": 1, "unk": 3, "pad": 0}
    else:
        head = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
        ids = {"bos": 1, "eos": 2, "unk": 0}
    tokens = list(head)
    types = [2 if t in ("<unk>",) else 3 for t in head]
    scores = [0.0] * len(head)
    # Gemma keeps runs of newlines and of spaces as user-defined tokens.
    if gemma:
        for run in ("\n", "\n\n", "  ", "   "):
            tokens.append(run)
            types.append(4)
            scores.append(0.0)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores += [0.0] * 256
    seen = set(tokens)
    rank = 0
    for piece in _smollm_vocab()["tokens"]:
        try:
            text = bytes(decode[c] for c in piece).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue  # special tokens, and pieces that end inside a UTF-8 character
        text = text.replace(" ", "\u2581")
        if not text or text in seen:
            continue
        seen.add(text)
        tokens.append(text)
        types.append(1)
        scores.append(-float(rank))
        rank += 1
    # SentencePiece keeps every character of its pieces as a piece of its own (llama.cpp
    # merges symbols that are not tokens, the tokenizers library cannot).
    for char in sorted({c for t, k in zip(tokens, types, strict=True) if k == 1 for c in t} - seen):
        tokens.append(char)
        types.append(1)
        scores.append(-float(rank))
        rank += 1
    return {"tokens": tokens, "scores": scores, "types": types, "ids": ids}


def _add_vocab(w: Any, kind: str, pre: str | None) -> int:
    """Write the tokenizer.ggml.* keys; the vocabulary size."""
    if kind == "bpe":
        v = _smollm_vocab()
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_string("tokenizer.ggml.pre", pre or "default")
        w.add_array("tokenizer.ggml.tokens", v["tokens"])
        w.add_array("tokenizer.ggml.token_type", v["token_type"])
        w.add_array("tokenizer.ggml.merges", v["merges"])
        w.add_uint32("tokenizer.ggml.bos_token_id", v["bos_token_id"])
        w.add_uint32("tokenizer.ggml.eos_token_id", v["eos_token_id"])
        w.add_uint32("tokenizer.ggml.unknown_token_id", v["unknown_token_id"])
        return len(v["tokens"])
    v = _spm_vocab(kind == "gemma")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", v["tokens"])
    w.add_array("tokenizer.ggml.scores", v["scores"])
    w.add_array("tokenizer.ggml.token_type", v["types"])
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if role in v["ids"]:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", v["ids"][role])
    if kind == "gemma":
        w.add_bool("tokenizer.ggml.add_bos_token", True)
        w.add_bool("tokenizer.ggml.add_space_prefix", False)
    return len(v["tokens"])


class _Tensors:
    """Draws each tensor from the seeded generator and writes it: float32, or quantised to
    the GGML type ``types`` names for it (the same draws either way)."""

    def __init__(self, writer: Any, seed: int, types: Mapping[str, str]) -> None:
        self.w = writer
        self.rng = np.random.default_rng(seed)
        self.types = types
        self.written: set[str] = set()

    def _add(self, name: str, data: np.ndarray) -> None:
        self.written.add(name)
        data = data.astype(np.float32)
        kind = self.types.get(name)
        if kind is None:
            self.w.add_tensor(name, data)
            return
        from gguf.constants import GGMLQuantizationType

        qtype = GGMLQuantizationType[kind]
        self.w.add_tensor(name, quantise(data, qtype), raw_dtype=qtype)

    def matrix(self, name: str, rows: int, cols: int, gain: float = 1.0) -> None:
        self._add(name, self.rng.standard_normal((rows, cols)) * (gain / np.sqrt(cols)))

    def stack(self, name: str, n: int, rows: int, cols: int) -> None:
        self._add(name, self.rng.standard_normal((n, rows, cols)) / np.sqrt(cols))

    def vector(self, name: str, n: int, mean: float = 1.0, spread: float = 0.1) -> None:
        self._add(name, mean + spread * self.rng.standard_normal(n))


def _common_keys(w: Any, arch: str, d: Dims) -> None:
    w.add_string("general.name", f"tiny-{arch}")
    w.add_uint32(f"{arch}.context_length", CONTEXT)
    w.add_uint32(f"{arch}.embedding_length", d.hidden)
    w.add_uint32(f"{arch}.block_count", d.layers)
    w.add_uint32(f"{arch}.feed_forward_length", d.ff)
    w.add_uint32(f"{arch}.attention.head_count", d.heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", d.kv_heads)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if d.head_dim != d.hidden // d.heads:
        w.add_uint32(f"{arch}.attention.key_length", d.head_dim)
        w.add_uint32(f"{arch}.attention.value_length", d.head_dim)


def _attention(t: _Tensors, p: str, d: Dims, bias: bool = False) -> None:
    t.matrix(f"{p}.attn_q.weight", d.heads * d.head_dim, d.hidden)
    t.matrix(f"{p}.attn_k.weight", d.kv_heads * d.head_dim, d.hidden)
    t.matrix(f"{p}.attn_v.weight", d.kv_heads * d.head_dim, d.hidden)
    t.matrix(f"{p}.attn_output.weight", d.hidden, d.heads * d.head_dim)
    if bias:
        for part, n in (("q", d.heads), ("k", d.kv_heads), ("v", d.kv_heads)):
            t.vector(f"{p}.attn_{part}.bias", n * d.head_dim, mean=0.0, spread=0.5)


def _mlp(t: _Tensors, p: str, d: Dims) -> None:
    t.matrix(f"{p}.ffn_gate.weight", d.ff, d.hidden)
    t.matrix(f"{p}.ffn_up.weight", d.ff, d.hidden)
    t.matrix(f"{p}.ffn_down.weight", d.hidden, d.ff)


def _embeddings(
    t: _Tensors,
    vocab: int,
    d: Dims,
    *,
    tied: bool,
    out_gain: float = 4.0,
    norm_mean: float = 1.0,
) -> None:
    # Tied: small embeddings, or the residual stream is the input token's own row and greedy
    # repeats it with certainty.
    t.matrix("token_embd.weight", vocab, d.hidden, gain=1.0 if tied else np.sqrt(d.hidden))
    t.vector("output_norm.weight", d.hidden, mean=norm_mean)
    if not tied:
        # Sharp logits (std ~out_gain): greedy picks stay clear of ties.
        t.matrix("output.weight", vocab, d.hidden, gain=out_gain)


def _llama3_rope_factors(base: float, head_dim: int) -> np.ndarray:
    # What convert_hf_to_gguf writes as rope_freqs for rope_scaling {"rope_type": "llama3",
    # "factor": 32, "low_freq_factor": 1, "high_freq_factor": 4, original 8192} (Llama 3.2).
    factor, low, high, old = 32.0, 1.0, 4.0, 8192
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _llama(
    w: Any, t: _Tensors, *, vocab_kind: str, pre: str | None, rope: str | None, d: Dims = TINY
) -> None:
    arch = "llama"
    _common_keys(w, arch, d)
    base = 500000.0
    w.add_float32(f"{arch}.rope.freq_base", base)
    w.add_uint32(f"{arch}.rope.dimension_count", d.head_dim)
    if rope == "linear":
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", 4.0)
    vocab = _add_vocab(w, vocab_kind, pre)
    w.add_uint32(f"{arch}.vocab_size", vocab)
    _embeddings(t, vocab, d, tied=False)
    if rope == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(base, d.head_dim))
    for i in range(d.layers):
        p = f"blk.{i}"
        t.vector(f"{p}.attn_norm.weight", d.hidden)
        _attention(t, p, d)
        t.vector(f"{p}.ffn_norm.weight", d.hidden)
        _mlp(t, p, d)


def _qwen(
    w: Any, t: _Tensors, *, arch: str, rope: str | None = None, d: Dims | None = None
) -> None:
    if d is None:
        d = TINY if arch == "qwen2" else dataclasses.replace(TINY, head_dim=32)
    _common_keys(w, arch, d)
    w.add_float32(f"{arch}.rope.freq_base", 1000000.0)
    if rope == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", 4.0)
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", 1024)
    if arch == "qwen3moe":
        w.add_uint32(f"{arch}.expert_count", 4)
        w.add_uint32(f"{arch}.expert_used_count", 2)
        w.add_uint32(f"{arch}.expert_feed_forward_length", d.expert_ff)
    vocab = _add_vocab(w, "bpe", "qwen2")
    _embeddings(t, vocab, d, tied=False)
    for i in range(d.layers):
        p = f"blk.{i}"
        t.vector(f"{p}.attn_norm.weight", d.hidden)
        _attention(t, p, d, bias=arch == "qwen2")
        if arch != "qwen2":
            t.vector(f"{p}.attn_q_norm.weight", d.head_dim)
            t.vector(f"{p}.attn_k_norm.weight", d.head_dim)
        t.vector(f"{p}.ffn_norm.weight", d.hidden)
        if arch == "qwen3moe":
            t.matrix(f"{p}.ffn_gate_inp.weight", 4, d.hidden, gain=3.0)
            t.stack(f"{p}.ffn_gate_exps.weight", 4, d.expert_ff, d.hidden)
            t.stack(f"{p}.ffn_up_exps.weight", 4, d.expert_ff, d.hidden)
            t.stack(f"{p}.ffn_down_exps.weight", 4, d.hidden, d.expert_ff)
        else:
            _mlp(t, p, d)


def _gemma(w: Any, t: _Tensors, *, arch: str, window: int = 4096) -> None:
    d = dataclasses.replace(TINY, head_dim=32, layers=6 if arch == "gemma3" else TINY.layers)
    _common_keys(w, arch, d)
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", 50.0)
        w.add_float32(f"{arch}.final_logit_softcapping", 30.0)
        w.add_uint32(f"{arch}.attention.sliding_window", window)
    else:
        w.add_float32(f"{arch}.rope.freq_base", 1000000.0)
        # Small, so the fixed prompt reaches past it on the five sliding layers of six.
        w.add_uint32(f"{arch}.attention.sliding_window", 8)
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", 8.0)
    vocab = _add_vocab(w, "gemma", None)
    # Gemma ties its output to the embeddings (the converter stores norms as 1 + weight).
    # Gemma 2's final norm is large, so its logits reach where the soft-cap bends them.
    _embeddings(t, vocab, d, tied=True, norm_mean=8.0 if arch == "gemma2" else 1.0)
    for i in range(d.layers):
        p = f"blk.{i}"
        t.vector(f"{p}.attn_norm.weight", d.hidden)
        _attention(t, p, d)
        if arch == "gemma3":
            t.vector(f"{p}.attn_q_norm.weight", d.head_dim)
            t.vector(f"{p}.attn_k_norm.weight", d.head_dim)
        t.vector(f"{p}.post_attention_norm.weight", d.hidden)
        t.vector(f"{p}.ffn_norm.weight", d.hidden)
        _mlp(t, p, d)
        t.vector(f"{p}.post_ffw_norm.weight", d.hidden)


# LongRoPE: the original context the tiny Phi-3 trained at. Below the oracle's 512-token
# context (long factors run) and equal to the 256 of the "-short" record (short factors run).
LONGROPE_ORIGINAL = 256


def _phi3(w: Any, t: _Tensors, *, longrope: bool = False) -> None:
    arch, d = "phi3", TINY
    _common_keys(w, arch, d)
    w.add_uint32(f"{arch}.rope.dimension_count", d.head_dim)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    if longrope:
        # As convert_hf_to_gguf writes Phi-3 128k: the original context, the attention
        # factor sqrt(1 + ln(max / original) / ln(original)), and the two factor tensors.
        # Factors far apart (long up to 40x, short up to 3x), so the set that runs shows.
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", LONGROPE_ORIGINAL)
        scale = CONTEXT / LONGROPE_ORIGINAL
        w.add_float32(
            f"{arch}.rope.scaling.attn_factor",
            float(np.sqrt(1 + np.log(scale) / np.log(LONGROPE_ORIGINAL))),
        )
        pairs = d.head_dim // 2
        w.add_tensor("rope_factors_long.weight", np.geomspace(1.0, 40.0, pairs, dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.linspace(1.0, 3.0, pairs, dtype=np.float32))
    vocab = _add_vocab(w, "spm", None)
    _embeddings(t, vocab, d, tied=False)
    for i in range(d.layers):
        p = f"blk.{i}"
        t.vector(f"{p}.attn_norm.weight", d.hidden)
        t.matrix(f"{p}.attn_qkv.weight", (d.heads + 2 * d.kv_heads) * d.head_dim, d.hidden)
        t.matrix(f"{p}.attn_output.weight", d.hidden, d.heads * d.head_dim)
        t.vector(f"{p}.ffn_norm.weight", d.hidden)
        t.matrix(f"{p}.ffn_up.weight", 2 * d.ff, d.hidden)
        t.matrix(f"{p}.ffn_down.weight", d.hidden, d.ff)


# Every block format mlxcel reads, one weight matrix each (two for Q4_K and Q6_K), in a
# Q4_K_M-like file: Q4_K embeddings, Q6_K output.
_LLAMA_QUANTS = {
    "token_embd.weight": "Q4_K",
    "output.weight": "Q6_K",
    "blk.0.attn_q.weight": "Q4_0",
    "blk.0.attn_k.weight": "Q4_1",
    "blk.0.attn_v.weight": "Q5_0",
    "blk.0.attn_output.weight": "Q5_1",
    "blk.0.ffn_gate.weight": "Q8_0",
    "blk.0.ffn_up.weight": "Q2_K",
    "blk.0.ffn_down.weight": "Q3_K",
    "blk.1.attn_q.weight": "Q4_K",
    "blk.1.attn_k.weight": "Q5_K",
    "blk.1.attn_v.weight": "IQ4_NL",
    "blk.1.attn_output.weight": "IQ4_XS",
    "blk.1.ffn_gate.weight": "Q6_K",
    "blk.1.ffn_up.weight": "Q5_K",
    "blk.1.ffn_down.weight": "Q4_K",
}
# Q4_K_M's choices (Q6_K for attn_v, ffn_down and output), then other types on layer 1's
# experts; the router and norms stay F32 as llama-quantize keeps them.
_QWEN3MOE_QUANTS = {
    "token_embd.weight": "Q4_K",
    "output.weight": "Q6_K",
    **{f"blk.{i}.attn_{m}.weight": "Q4_K" for i in (0, 1) for m in ("q", "k", "output")},
    **{f"blk.{i}.attn_v.weight": "Q6_K" for i in (0, 1)},
    "blk.0.ffn_gate_exps.weight": "Q4_K",
    "blk.0.ffn_up_exps.weight": "Q4_K",
    "blk.0.ffn_down_exps.weight": "Q6_K",
    "blk.1.ffn_gate_exps.weight": "Q5_K",
    "blk.1.ffn_up_exps.weight": "IQ4_XS",
    "blk.1.ffn_down_exps.weight": "Q8_0",
}


@dataclasses.dataclass(frozen=True)
class Model:
    arch: str  # general.architecture
    build: Callable[[Any, _Tensors], None]  # writes the keys and tensors
    types: Mapping[str, str] = dataclasses.field(default_factory=dict)  # else F32
    file_type: int = 0  # general.file_type (llama_ftype): ALL_F32
    ctx: int = 512  # the context per sequence both sides serve it with (llama-server's -c)


MODELS: dict[str, Model] = {
    "llama3": Model(
        "llama", functools.partial(_llama, vocab_kind="bpe", pre="llama-bpe", rope="llama3")
    ),
    "llama3-quants": Model(
        "llama",
        functools.partial(_llama, vocab_kind="bpe", pre="llama-bpe", rope="llama3", d=QUANT),
        _LLAMA_QUANTS,
        file_type=15,  # MOSTLY_Q4_K_M
    ),
    "llama-linear": Model(
        "llama", functools.partial(_llama, vocab_kind="bpe", pre="smaug-bpe", rope="linear")
    ),
    "mistral": Model("llama", functools.partial(_llama, vocab_kind="spm", pre=None, rope=None)),
    "mistral-tekken": Model(
        "llama", functools.partial(_llama, vocab_kind="bpe", pre="tekken", rope=None)
    ),
    "qwen2": Model("qwen2", functools.partial(_qwen, arch="qwen2")),
    "qwen2-yarn": Model("qwen2", functools.partial(_qwen, arch="qwen2", rope="yarn")),
    "qwen3": Model("qwen3", functools.partial(_qwen, arch="qwen3")),
    "qwen3moe": Model("qwen3moe", functools.partial(_qwen, arch="qwen3moe")),
    "qwen3moe-quants": Model(
        "qwen3moe",
        functools.partial(_qwen, arch="qwen3moe", d=QUANT),
        _QWEN3MOE_QUANTS,
        file_type=15,  # MOSTLY_Q4_K_M
    ),
    "gemma2": Model("gemma2", functools.partial(_gemma, arch="gemma2")),
    # A window of 8, so the fixed prompt reaches past it on the sliding layer (layer 0 of 2).
    "gemma2-window": Model("gemma2", functools.partial(_gemma, arch="gemma2", window=8)),
    "gemma3": Model("gemma3", functools.partial(_gemma, arch="gemma3")),
    "phi3": Model("phi3", _phi3),
    "phi3-longrope": Model("phi3", functools.partial(_phi3, longrope=True)),
    "phi3-longrope-short": Model(
        "phi3", functools.partial(_phi3, longrope=True), ctx=LONGROPE_ORIGINAL
    ),
}


def write_tiny_gguf(name: str, path: Path, split_max_tensors: int = 0) -> Path:
    """Write the tiny GGUF ``name`` (a key of MODELS) to ``path``; the path. With
    ``split_max_tensors``, as a split GGUF of parts holding at most that many tensors each,
    named as llama.cpp names them (``STEM-00001-of-0000N.gguf``); the first part's path."""
    from gguf import GGUFWriter

    model = MODELS[name]
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), model.arch, split_max_tensors=split_max_tensors)
    seed = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    tensors = _Tensors(writer, seed, model.types)
    model.build(writer, tensors)
    missing = set(model.types) - tensors.written
    assert not missing, f"{name}: no such tensors {sorted(missing)}"
    writer.add_uint32("general.file_type", model.file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        first = sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))
        assert first, f"{name}: no parts were written"
        return first[0]
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()

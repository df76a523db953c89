#!/usr/bin/env python
"""Benchmark models of the sizes people serve: random weights in real shapes, as GGUF files
that llama.cpp and mlxcel both read (issue 37).

    .venv/bin/python tools/bench/sized_models.py 1b [--quant Q4_0]   # build (once); print path
    .venv/bin/python tools/bench/sized_models.py 1b --mlx 4          # an MLX folder (4-bit, g64)
    .venv/bin/python tools/bench/sized_models.py --list

Throughput does not depend on the weights' values, so a checkpoint with random weights in the
shape of Llama-3.2-1B, Qwen2.5-3B or Llama-3.1-8B is an honest benchmark of that size. Each is
written in float16 with llama.cpp's own GGUF library (the ``gguf`` package, which its converter
uses) and quantised with ``llama-quantize`` from the same build as the benchmark's
``llama-server`` (``tools/bench/llama_server.py``), ``--pure`` so every matrix has the type asked
for (llama.cpp would otherwise make the output matrix Q6_K, a K-quant that mlxcel does not keep
quantised yet: issue 38). Both servers therefore read the same bytes.

What differs from the real checkpoints, and why it does not change a throughput figure:
- every shape is written as ``general.architecture = llama`` (Qwen2.5's q/k/v biases, 1.4 M
  numbers in 3B, are left out; GGUF llama files of Llama 3.x carry a ``rope_freqs`` tensor,
  left out: RoPE costs the same with either frequencies);
- the vocabulary is the default model's (SmolLM2's byte-level BPE, its chat template), padded
  with never-produced filler tokens up to the real vocabulary size, so the embedding and output
  matrices have their real shapes;
- the context length written is 8192 (the real ones are 32k-128k): the benchmark's prompts and
  answers are short, and both servers size their caches from their own flags.

Files are cached under ``$MLXCEL_CACHE_DIR/bench/models`` (default ``~/.cache/mlxcel``), never
in git. The float16 file is deleted once its quantised copies exist (8B: 16 GB).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Q4_K_M: llama-quantize's mix (Q4_K, with Q6_K for the output and half of attn_v/ffn_down),
# the type most GGUF files users have are in (issue 38).
QUANTS = ("Q4_0", "Q8_0", "Q4_1", "Q4_K_M")
CONTEXT = 8192


@dataclass(frozen=True)
class Shape:
    label: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    eps: float = 1e-5

    def matrices(self) -> list[tuple[str, tuple[int, ...]]]:
        """GGUF tensor names and numpy shapes ([out, in] for matrices), in llama.cpp's order."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [
                (b + "attn_norm.weight", (self.hidden,)),
                (b + "attn_q.weight", (q, self.hidden)),
                (b + "attn_k.weight", (kv, self.hidden)),
                (b + "attn_v.weight", (kv, self.hidden)),
                (b + "attn_output.weight", (self.hidden, q)),
                (b + "ffn_norm.weight", (self.hidden,)),
                (b + "ffn_gate.weight", (self.ffn, self.hidden)),
                (b + "ffn_up.weight", (self.ffn, self.hidden)),
                (b + "ffn_down.weight", (self.hidden, self.ffn)),
            ]
        out.append(("output_norm.weight", (self.hidden,)))
        if not self.tied:
            out.append(("output.weight", (self.vocab, self.hidden)))
        return out

    def parameters(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.matrices())


SHAPES = {
    "1b": Shape("Llama-3.2-1B", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0),
    "3b": Shape("Qwen2.5-3B", 2048, 36, 16, 2, 128, 11008, 151936, True, 1000000.0, 1e-6),
    "8b": Shape("Llama-3.1-8B", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0),
}


def cache_dir() -> Path:
    root = Path(os.environ.get("MLXCEL_CACHE_DIR", Path.home() / ".cache" / "mlxcel"))
    return root / "bench" / "models"


def path_for(size: str, quant: str) -> Path:
    return cache_dir() / f"random-{SHAPES[size].label.lower()}-{quant}.gguf"


def log(msg: str) -> None:
    print(f"[sized_models] {msg}", file=sys.stderr, flush=True)


def _vocabulary(vocab: int) -> dict[str, object]:
    """The default model's tokenizer metadata, its token list padded to ``vocab``."""
    import gguf

    from mlxcel.models.default import default_gguf_path

    reader = gguf.GGUFReader(str(default_gguf_path()))

    def field(key: str) -> object:
        f = reader.fields[key]
        return f.contents()

    tokens = list(field("tokenizer.ggml.tokens"))  # type: ignore[call-overload]
    types = list(field("tokenizer.ggml.token_type"))  # type: ignore[call-overload]
    if vocab < len(tokens):
        raise ValueError(f"vocabulary {vocab} is smaller than the default model's {len(tokens)}")
    pad = vocab - len(tokens)
    tokens += [f"<|filler_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.NORMAL)] * pad
    return {
        "tokens": tokens,
        "types": types,
        "merges": list(field("tokenizer.ggml.merges")),  # type: ignore[call-overload]
        "pre": field("tokenizer.ggml.pre"),
        "bos": int(field("tokenizer.ggml.bos_token_id")),  # type: ignore[call-overload]
        "eos": int(field("tokenizer.ggml.eos_token_id")),  # type: ignore[call-overload]
        "template": field("tokenizer.chat_template"),
    }


def write_f16(size: str, dest: Path, seed: int = 0) -> None:
    """The float16 GGUF of ``size``: random N(0, 0.02) matrices, unit norms. Streamed, one
    tensor in memory at a time."""
    import gguf

    shape = SHAPES[size]
    voc = _vocabulary(shape.vocab)
    tmp = dest.with_name(dest.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"random-{shape.label} (mlxcel benchmark shape)")
    w.add_block_count(shape.layers)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(str(voc["pre"]))
    w.add_token_list(voc["tokens"])  # type: ignore[arg-type]
    w.add_token_types(voc["types"])  # type: ignore[arg-type]
    w.add_token_merges(voc["merges"])  # type: ignore[arg-type]
    w.add_bos_token_id(int(voc["bos"]))  # type: ignore[call-overload]
    w.add_eos_token_id(int(voc["eos"]))  # type: ignore[call-overload]
    w.add_add_bos_token(False)
    w.add_chat_template(str(voc["template"]))
    tensors = shape.matrices()
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims in tensors:
        if len(dims) == 1:
            w.write_tensor_data(np.ones(dims, np.float32))
        else:
            w.write_tensor_data((rng.standard_normal(dims, np.float32) * 0.02).astype(np.float16))
    w.close()
    tmp.rename(dest)


def build(size: str, quant: str) -> Path:
    """The cached ``quant`` GGUF of ``size``, made now if missing."""
    if size not in SHAPES:
        raise ValueError(f"size must be one of {', '.join(SHAPES)}")
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}")
    out = path_for(size, quant)
    if out.is_file():
        return out
    import llama_server  # tools/bench/llama_server.py, beside this script

    quantize = llama_server.find_or_build_tool("llama-quantize")
    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = path_for(size, "F16")
    t0 = time.monotonic()
    source, flags = f16, ["--pure"]  # every matrix of the type asked
    if quant == "Q4_K_M":
        flags = []  # the mix is the point
        if not f16.is_file() and path_for(size, "Q8_0").is_file():
            # Random weights: only the layout matters, so requantising Q8_0 is as good.
            source, flags = path_for(size, "Q8_0"), ["--allow-requantize"]
    if not source.is_file():
        log(f"writing {f16} ({SHAPES[size].parameters() / 1e9:.2f} B parameters, float16)")
        write_f16(size, f16)
    log(f"quantising {source.name} to {quant} with {quantize} {' '.join(flags)}")
    tmp = out.with_name(out.name + ".tmp")
    done = subprocess.run(
        [str(quantize), *flags, str(source), str(tmp), quant, "2"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize exited {done.returncode}: {done.stderr[-2000:]}")
    tmp.rename(out)
    if all(path_for(size, q).is_file() for q in ("Q4_0", "Q8_0")):
        f16.unlink()  # both benchmark types made: the float16 source is not needed again
    log(f"{out} ({out.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - t0:.0f}s")
    return out


def mlx_folder(size: str, bits: int) -> Path:
    """The cached MLX-format folder of ``size`` as mlx-lm's converter quantises hub models
    (``bits`` 4 or 8, group size 64, its default), made now if missing: what ``-m FOLDER``
    users bring. Made from the Q8_0 file: mlxcel's conversion of it (an MLX folder, 8-bit
    groups of 32), dequantised to bfloat16 and quantised again, both by ``mlx_lm.convert``.
    Random weights, so the rounding on the way changes no figure."""
    if bits not in (4, 8):
        raise ValueError("bits must be 4 or 8")
    out = cache_dir() / f"random-{SHAPES[size].label.lower()}-mlx-{bits}bit"
    if (out / "config.json").is_file():
        return out
    import tempfile

    from mlxcel.models.resolve import resolve_model  # first: it sets mlx up for the CPU

    from mlx_lm import convert  # isort: skip

    converted = resolve_model(str(build(size, "Q8_0"))).path
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        f16 = Path(tmp) / "f16"
        log(f"dequantising {converted} to bfloat16")
        # bfloat16, as Llama 3.2's published weights: the hub's MLX copies of it keep
        # bfloat16 scales and biases, and so does this one.
        convert(str(converted), str(f16), dequantize=True, dtype="bfloat16")
        staged = Path(tmp) / "out"
        log(f"quantising to {bits} bits, group size 64")
        convert(
            str(f16), str(staged), quantize=True, q_bits=bits, q_group_size=64, dtype="bfloat16"
        )
        staged.rename(out)
    log(f"{out} in {time.monotonic() - t0:.0f}s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("size", nargs="?", choices=sorted(SHAPES))
    ap.add_argument("--quant", default="Q4_0", choices=QUANTS)
    ap.add_argument(
        "--mlx",
        type=int,
        choices=(4, 8),
        default=None,
        metavar="BITS",
        help="build (once) and print an MLX-format folder instead: BITS 4 or 8, group size 64",
    )
    ap.add_argument("--list", action="store_true", help="the shapes and their parameter counts")
    a = ap.parse_args()
    if a.list or a.size is None:
        for key, s in SHAPES.items():
            print(
                f"{key}: {s.label} shape, {s.parameters() / 1e9:.2f} B parameters, "
                f"{s.layers} layers, hidden {s.hidden}, heads {s.heads}/{s.kv_heads}, "
                f"ffn {s.ffn}, vocab {s.vocab}, {'tied' if s.tied else 'untied'} embeddings"
            )
        return 0
    print(mlx_folder(a.size, a.mlx) if a.mlx else build(a.size, a.quant))
    return 0


if __name__ == "__main__":
    sys.exit(main())

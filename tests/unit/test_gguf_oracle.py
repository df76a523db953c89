"""Each served GGUF architecture against llama.cpp, on a tiny random-weight file.

``tests/data/gguf_oracle.json`` holds what llama-server answered for the tiny GGUFs of
``tests/support/tiny_gguf.py`` (recorded by ``tools/bench/gguf_oracle.py``; the suite has no
llama.cpp). Here the same files go through mlxcel's conversion and loader and must give:

- the same token ids for a multilingual text, and for the prompt with BOS as llama.cpp adds it;
- the same greedy token at each of 16 steps (the prompt, then llama.cpp's own continuation
  fed back), unless llama.cpp's two best differ by under ``NEAR_TIE``: then either will do;
- each of llama.cpp's top-10 log-probabilities within ``LOGPROB_BOUND`` (``GEMMA_BOUND`` for
  Gemma). Both sides compute in float32 (F32 weights, llama.cpp's KV cache float32 too);
  what is left is summation order, and llama.cpp's float16 table for tanh-GELU.

Each file is loaded for the context llama-server served it with (``ctx``, 512 unless
recorded): the two ``phi3-longrope`` records sit either side of its original context, so the
long factors run for one and the short for the other, as llama.cpp picks them.

The ``-quants`` models store their weights in every block format gguf_read reads (one format
per matrix, experts too); they have their own bound, ``QUANT_BOUND``, explained there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxcel.models.loader import LoadedModel, load_model
from mlxcel.models.mlx_setup import mx
from mlxcel.models.resolve import resolve_model
from mlxcel.native import set_int8_activations
from tests.support.tiny_gguf import sha256, write_tiny_gguf
from tests.support.tiny_quants import quantise

RECORD = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "gguf_oracle.json").read_text("utf-8")
)
# Measured worst cases: 1.4e-4 (float32 summation order); Gemma 3.1e-3 (gemma2-window; 1.9e-3
# the others: llama.cpp's GELU runs through a float16 table). For scale: gemma2-window with its
# window one token off moves by 1.7-2.0, with no window at all by 23; phi3-longrope with the
# other set of factors by more than 1 (test_longrope.py).
LOGPROB_BOUND = 5e-4
GEMMA_BOUND = 4e-3
# Quantised weights: measured worst 0.20 (llama3-quants; qwen3moe-quants 0.17), none of it
# a misread block. llama.cpp multiplies Q4_x/Q5_x/Q8_0/IQ4_NL weights with activations
# rounded to q8_0/q8_1 and K-quant/IQ4_XS weights with q8_K, where we compute in float32 on
# the decoded weights; and we requantise Q3_K/Q2_K (and Q6_K where the native kernels do not
# run: on them its blocks are read as stored, exactly) to 8 bits and round Q5_K/IQ4_XS (and
# Q4_K off the native kernels: on them its blocks are read as stored too) group scales and
# biases (products of two stored numbers) to float16. Measured apart, on
# single-format variants against llama.cpp on the same weights decoded to F32 by gguf-py
# (its reference decoding, so its side rounds nothing): Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL within 1e-4,
# Q4_K/Q5_K/IQ4_XS 2e-2 (float16 scales), Q6_K/Q3_K/Q2_K 8e-2 (8-bit requantisation); the
# rest is llama.cpp's activation rounding. A misread layout moves them by units: two IQ4_XS
# sub-block scales swapped in one matrix, or Q5_K's fifth bit lost in one sub-block of
# eight, gave 3.0 and 3.4.
QUANT_BOUND = 0.25


@pytest.fixture(autouse=True)
def _float32_activations() -> Iterator[None]:
    # Our CPU kernels' int8 activations (from 12 rows, on AVX512-VNNI) would round the
    # prompt's activations as llama.cpp does, but not alike: the comparison is for float32.
    set_int8_activations("off")
    yield
    set_int8_activations(None)  # the process default


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-oracle")


def _load(name: str, work: Path) -> LoadedModel:
    gguf = write_tiny_gguf(name, work / f"{name}.gguf")
    assert sha256(gguf) == RECORD["models"][name]["sha256"], (
        f"tiny GGUF {name!r} is not the file llama.cpp answered for: "
        "rerun tools/bench/gguf_oracle.py and commit tests/data/gguf_oracle.json"
    )
    # The context llama-server ran with (records made before it was kept: 512): LongRoPE's
    # factors are chosen for it.
    ctx = RECORD["models"][name].get("ctx", 512)
    return load_model(resolve_model(str(gguf), work / "cache"), ctx_size=ctx)


def _step_logprobs(model: Any, prompt: list[int], fed: list[int]) -> list[mx.array]:
    """Next-token log-probabilities after the prompt and after each fed token, decoded as the
    server does: one prefill into a prompt cache, then one token at a time."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = []
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    for token in [None, *fed[:-1]]:
        if token is not None:
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
        logits = logits.astype(mx.float32)
        out.append(logits - mx.logsumexp(logits))
    return out


@pytest.mark.parametrize("name", sorted(RECORD["models"]))
def test_gguf_matches_llama_cpp(name: str, converted: Path) -> None:
    want = RECORD["models"][name]
    loaded = _load(name, converted)
    tok = loaded.tokenizer
    assert tok.encode(RECORD["text"], add_special_tokens=False) == want["tokenize"]
    assert tok.encode(RECORD["prompt_text"]) == want["prompt"]

    steps = _step_logprobs(loaded.model, want["prompt"], want["greedy"])
    if name.endswith("-quants"):
        bound = QUANT_BOUND
    else:
        bound = GEMMA_BOUND if name.startswith("gemma") else LOGPROB_BOUND
    worst = 0.0
    for i, (ours, top, chosen) in enumerate(zip(steps, want["top"], want["greedy"], strict=True)):
        pick = int(mx.argmax(ours).item())
        if top is None:  # llama-server gave no probabilities for this step
            assert pick == chosen, f"step {i}: greedy {pick}, llama.cpp {chosen}"
            continue
        ids = [t for t, _ in top]
        theirs = mx.array([lp for _, lp in top])
        diff = mx.abs(ours[mx.array(ids)] - theirs).max().item()
        worst = max(worst, diff)
        assert diff <= bound, f"step {i}: log-probabilities differ by {diff:.2e}"
        # A near-tie: llama.cpp's runner-up within twice the bound of its best.
        tied = {t for t, lp in top if top[0][1] - lp < 2 * bound}
        assert pick == chosen or (chosen in tied and pick in tied), (
            f"step {i}: greedy {pick}, llama.cpp {chosen}"
        )
    print(f"{name}: max |logprob difference| {worst:.2e}")


# Bits per weight of each format the tiny quantiser writes -> its largest relative RMS error
# on normal weights (measured: 0.33, 0.16, 0.08, 0.04, 0.019, 0.005); a block laid out wrong
# decodes to other weights' values, an error near 1.4.
_QUANT_ERROR = {2: 0.4, 3: 0.2, 4: 0.1, 5: 0.05, 6: 0.025, 8: 0.01}
_FORMAT_BITS = {
    "Q2_K": 2, "Q3_K": 3, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "IQ4_NL": 4, "IQ4_XS": 4,
    "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8,
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(_FORMAT_BITS))
def test_tiny_quantiser_writes_blocks_that_decode_to_the_weights(kind: str) -> None:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[kind]
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 512)) / 16).astype(np.float32)
    x[1, :256] = 0.0  # an all-zero super-block
    x[2] = np.abs(x[2])  # no negative weights
    blocks = quantise(x, qtype)
    assert blocks.dtype == np.uint8
    assert (quantise(x, qtype) == blocks).all()
    got = dequantize(blocks, qtype).reshape(x.shape)
    assert (got[1, :256] == 0.0).all()
    rel = np.sqrt(((got - x) ** 2).mean() / (x**2).mean())
    assert rel <= _QUANT_ERROR[_FORMAT_BITS[kind]]

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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxcel.models.loader import LoadedModel, load_model
from mlxcel.models.mlx_setup import mx
from mlxcel.models.resolve import resolve_model
from tests.support.tiny_gguf import sha256, write_tiny_gguf

RECORD = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "gguf_oracle.json").read_text("utf-8")
)
# Measured worst cases: 1.4e-4 (float32 summation order); Gemma 1.9e-3 (llama.cpp's GELU
# runs through a float16 table).
LOGPROB_BOUND = 5e-4
GEMMA_BOUND = 3e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-oracle")


def _load(name: str, work: Path) -> LoadedModel:
    gguf = write_tiny_gguf(name, work / f"{name}.gguf")
    assert sha256(gguf) == RECORD["models"][name]["sha256"], (
        f"tiny GGUF {name!r} is not the file llama.cpp answered for: "
        "rerun tools/bench/gguf_oracle.py and commit tests/data/gguf_oracle.json"
    )
    return load_model(resolve_model(str(gguf), work / "cache"))


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

"""A converted GGUF's Q4_K and Q6_K matrices loaded as the file stores them
(models/gguf_blocks.py), on the tiny Q4_K_M-like file of tests/support/tiny_gguf.py (Q6_K output
and one ffn_gate; Q4_K embeddings, one attn_q (rows unpermuted as blocks) and one ffn_down)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx.utils import tree_flatten

from mlxcel.models import gguf_blocks
from mlxcel.models.loader import LoadedModel, load_model, native_enabled
from mlxcel.models.mlx_setup import mx
from mlxcel.models.resolve import ResolvedModel, resolve_model
from mlxcel.native import kquants, set_int8_activations
from mlxcel.native.layers import NativeKQuantEmbedding, NativeKQuantLinear
from tests.support.tiny_gguf import write_tiny_gguf

needs_native = pytest.mark.skipif(not native_enabled(), reason="native kernels not used here")

# Layer -> the format its blocks are kept in.
BLOCK_LAYERS = {
    "lm_head": "q6_k",
    "model.layers.1.mlp.gate_proj": "q6_k",
    "model.embed_tokens": "q4_k",
    "model.layers.1.self_attn.q_proj": "q4_k",
    "model.layers.1.mlp.down_proj": "q4_k",
}
# The affine copy's bits a weight (its codes, then a float16 scale and bias per 32), and the
# blocks'.
AFFINE_BITS = {"q4_k": 4, "q6_k": 8}
BLOCK_BITS = {"q4_k": 144 * 8 / 256, "q6_k": 210 * 8 / 256}


@pytest.fixture(scope="module")
def resolved(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    work = tmp_path_factory.mktemp("gguf-blocks")
    gguf = write_tiny_gguf("llama3-quants", work / "llama3-quants.gguf")
    return resolve_model(str(gguf), work / "cache")


def _logprobs(loaded: LoadedModel) -> mx.array:
    set_int8_activations("off")  # float32 on both sides (int8 would round the prompt's rows)
    try:
        prompt = mx.array([loaded.tokenizer.encode("The capital of France is")])
        logits = loaded.model(prompt)[0].astype(mx.float32)
        out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(out)
        return out
    finally:
        set_int8_activations(None)


def _weight_bytes(loaded: LoadedModel) -> int:
    return sum(int(v.nbytes) for _, v in tree_flatten(loaded.model.parameters()))


def test_the_folder_keeps_the_blocks_beside_an_affine_copy(resolved: ResolvedModel) -> None:
    from mlx_lm.utils import load

    blocks = mx.load(str(resolved.path / gguf_blocks.BLOCKS_FILE))
    assert sorted(blocks) == sorted(f"{n}.{f}" for n, f in BLOCK_LAYERS.items())
    # The folder is still what mlx-lm loads on its own (any device): the affine copy.
    model, _ = load(str(resolved.path), lazy=True)
    modules = dict(model.named_modules())
    assert all(modules[n].bits == AFFINE_BITS[f] for n, f in BLOCK_LAYERS.items())


@needs_native
def test_native_layers_hold_the_blocks_and_agree_with_the_affine_copy(
    resolved: ResolvedModel, tmp_path: Path
) -> None:
    native = load_model(resolved)
    modules = dict(native.model.named_modules())
    for name, fmt in BLOCK_LAYERS.items():
        layer = modules[name]
        kind = NativeKQuantEmbedding if name == "model.embed_tokens" else NativeKQuantLinear
        assert isinstance(layer, kind)
        assert layer.fmt == fmt
        size = kquants.FORMATS[fmt].block_bytes
        assert layer["weight"].nbytes == layer.output_dims * layer.input_dims // 256 * size
    # The reference: float32 everywhere (native=False), the block layers with the weights
    # gguf-py decodes the blocks to (kquants.dequantize, bit for bit: test_native_kquants.py).
    plain = load_model(resolved, native=False)
    assert native.n_params == plain.n_params
    blocks = mx.load(str(resolved.path / gguf_blocks.BLOCKS_FILE))
    reference = dict(plain.model.named_modules())
    affine = _logprobs(plain)
    for name, fmt in BLOCK_LAYERS.items():
        reference[name].weight = kquants.dequantize(blocks[f"{name}.{fmt}"], fmt)
    # The blocks take 4.5 (Q4_K) and 6.56 (Q6_K) bits a weight where the affine copies take 5
    # and 9 (their codes and two float16 per 32): that much less held, everything else as
    # before.
    saved = sum(
        modules[n].input_dims * modules[n].output_dims * (AFFINE_BITS[f] + 1 - BLOCK_BITS[f])
        for n, f in BLOCK_LAYERS.items()
    )
    without = load_model(_without_blocks(resolved, tmp_path))
    assert _weight_bytes(without) - _weight_bytes(native) == saved // 8
    # Float32 summation order apart, the file's own weights: the oracle tests' F32 bound
    # (test_gguf_oracle.py). The affine copy (Q6_K requantised to 8 bits) is measurably
    # further off (~0.1 here).
    exact = _logprobs(plain)
    diff = mx.abs(_logprobs(native) - exact).max().item()
    assert diff < 5e-4, diff
    assert mx.abs(affine - exact).max().item() > 20 * diff


def _without_blocks(resolved: ResolvedModel, tmp_path: Path) -> ResolvedModel:
    """A copy of the folder as converters before the blocks wrote it."""
    import shutil

    folder = tmp_path / "old"
    shutil.copytree(resolved.path, folder, ignore=shutil.ignore_patterns(gguf_blocks.BLOCKS_FILE))
    return ResolvedModel(path=folder, model_id=resolved.model_id, source="folder")


@needs_native
def test_a_folder_without_blocks_loads_its_affine_copy(
    resolved: ResolvedModel, tmp_path: Path
) -> None:
    loaded = load_model(_without_blocks(resolved, tmp_path))
    modules = dict(loaded.model.named_modules())
    assert not any(
        isinstance(modules[n], NativeKQuantLinear | NativeKQuantEmbedding) for n in BLOCK_LAYERS
    )
    assert all(modules[n].bits == AFFINE_BITS[f] for n, f in BLOCK_LAYERS.items())


@needs_native
def test_kquant_blocks_off_loads_the_affine_copy(
    resolved: ResolvedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The operator's choice of speed over memory (MLXCEL_KQUANT_BLOCKS=0): the same folder's
    # affine copy, on the native affine kernels.
    monkeypatch.setenv("MLXCEL_KQUANT_BLOCKS", "0")
    loaded = load_model(resolved)
    modules = dict(loaded.model.named_modules())
    assert not any(
        isinstance(modules[n], NativeKQuantLinear | NativeKQuantEmbedding) for n in BLOCK_LAYERS
    )
    assert all(modules[n].bits == AFFINE_BITS[f] for n, f in BLOCK_LAYERS.items())

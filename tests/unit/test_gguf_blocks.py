"""A converted GGUF's Q6_K matrices loaded as the file stores them (models/gguf_blocks.py), on
the tiny Q4_K_M-like file of tests/support/tiny_gguf.py (Q6_K output and one ffn_gate)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx.utils import tree_flatten

from mlxcel.models import gguf_blocks
from mlxcel.models.loader import LoadedModel, load_model, native_enabled
from mlxcel.models.mlx_setup import mx
from mlxcel.models.resolve import ResolvedModel, resolve_model
from mlxcel.native import q6k, set_int8_activations
from mlxcel.native.layers import NativeQ6kLinear
from tests.support.tiny_gguf import write_tiny_gguf

needs_native = pytest.mark.skipif(not native_enabled(), reason="native kernels not used here")

Q6K_LAYERS = ("lm_head", "model.layers.1.mlp.gate_proj")


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


def test_the_folder_keeps_the_blocks_beside_an_8_bit_copy(resolved: ResolvedModel) -> None:
    from mlx_lm.utils import load

    blocks = mx.load(str(resolved.path / gguf_blocks.BLOCKS_FILE))
    assert sorted(blocks) == sorted(f"{n}.q6_k" for n in Q6K_LAYERS)
    # The folder is still what mlx-lm loads on its own (any device): the 8-bit copy.
    model, _ = load(str(resolved.path), lazy=True)
    modules = dict(model.named_modules())
    assert all(modules[n].bits == 8 for n in Q6K_LAYERS)


@needs_native
def test_native_layers_hold_the_blocks_and_agree_with_the_8_bit_copy(
    resolved: ResolvedModel, tmp_path: Path
) -> None:
    native = load_model(resolved)
    modules = dict(native.model.named_modules())
    for name in Q6K_LAYERS:
        layer = modules[name]
        assert isinstance(layer, NativeQ6kLinear)
        assert layer["weight"].nbytes == layer.output_dims * layer.input_dims // 256 * 210
    # The reference: float32 everywhere (native=False), the Q6_K layers with the weights
    # gguf-py decodes the blocks to (q6k.dequantize, bit for bit: test_native_q6k.py).
    plain = load_model(resolved, native=False)
    assert native.n_params == plain.n_params
    blocks = mx.load(str(resolved.path / gguf_blocks.BLOCKS_FILE))
    reference = dict(plain.model.named_modules())
    eight_bit = _logprobs(plain)
    for name in Q6K_LAYERS:
        reference[name].weight = q6k.dequantize(blocks[f"{name}.q6_k"])
    # The tiny model's Q6_K matrices are 6.56 bits a weight, not 9 (8 bits and two float16
    # per 32): that much less held, while everything else is as before.
    held = sum(modules[n].input_dims * modules[n].output_dims for n in Q6K_LAYERS)
    without = load_model(_without_blocks(resolved, tmp_path))
    assert _weight_bytes(without) - _weight_bytes(native) == held * (9 - 210 * 8 / 256) // 8
    # Float32 summation order apart, the file's own weights: the oracle tests' F32 bound
    # (test_gguf_oracle.py). The 8-bit copy is measurably further off (~0.1 here).
    exact = _logprobs(plain)
    diff = mx.abs(_logprobs(native) - exact).max().item()
    assert diff < 5e-4, diff
    assert mx.abs(eight_bit - exact).max().item() > 20 * diff


def _without_blocks(resolved: ResolvedModel, tmp_path: Path) -> ResolvedModel:
    """A copy of the folder as converters before the blocks wrote it."""
    import shutil

    folder = tmp_path / "old"
    shutil.copytree(resolved.path, folder, ignore=shutil.ignore_patterns(gguf_blocks.BLOCKS_FILE))
    return ResolvedModel(path=folder, model_id=resolved.model_id, source="folder")


@needs_native
def test_a_folder_without_blocks_loads_its_8_bit_copy(
    resolved: ResolvedModel, tmp_path: Path
) -> None:
    loaded = load_model(_without_blocks(resolved, tmp_path))
    modules = dict(loaded.model.named_modules())
    assert not any(isinstance(modules[n], NativeQ6kLinear) for n in Q6K_LAYERS)
    assert all(modules[n].bits == 8 for n in Q6K_LAYERS)

"""GGUF -> MLX conversion of the packaged SmolLM2-135M-Instruct, checked end to end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxcel.models.default import default_gguf_path
from mlxcel.models.gguf import convert_gguf
from mlxcel.models.gguf_arch import unpermute as _unpermute
from mlxcel.models.loader import LoadedModel, load_model
from mlxcel.models.mlx_setup import mx
from mlxcel.models.resolve import ResolvedModel, resolve_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("mlxcel-cache")
        mp.setenv("MLXCEL_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def resolved(cache_dir: Path) -> ResolvedModel:
    return resolve_model(None)


@pytest.fixture(scope="module")
def smol(resolved: ResolvedModel) -> LoadedModel:
    # The dequantised float32 path (the native kernels' own checks are in
    # test_native_kernels.py; they compare against this path).
    return load_model(resolved, native=False)


@pytest.fixture(scope="module")
def gguf_vocab() -> list[str]:
    _, metadata = mx.load(str(default_gguf_path()), return_metadata=True)
    tokens = metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list)
    return tokens


def _greedy(model: Any, wrapper: Any, max_tokens: int = 20) -> str:
    from mlx_lm import generate

    prompt = wrapper.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return str(generate(model, wrapper, prompt, max_tokens=max_tokens, verbose=False))


def test_config_comes_from_gguf_metadata(resolved: ResolvedModel) -> None:
    config = json.loads((resolved.path / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }
    assert {k: config[k] for k in expected} == expected
    generation = json.loads((resolved.path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_loaded_model_facts(smol: LoadedModel) -> None:
    assert smol.model_id == "SmolLM2-135M-Instruct"
    assert smol.eos_token_ids == frozenset({2})
    assert smol.context_length == 8192
    assert smol.vocab_size == 49152
    assert 130_000_000 < smol.n_params < 140_000_000
    assert not smol.quantized
    from mlx.utils import tree_flatten

    dtypes = {v.dtype for _, v in tree_flatten(smol.model.parameters())}
    assert dtypes == {mx.float32}


def test_known_token_ids_match_gguf_vocab(smol: LoadedModel, gguf_vocab: list[str]) -> None:
    tok = smol.tokenizer
    assert tok.encode("Hello world", add_special_tokens=False) == [
        gguf_vocab.index("Hello"),
        gguf_vocab.index("Ġworld"),
    ]
    # llama.cpp's "smollm" pre-tokenizer splits every digit on its own.
    assert tok.encode("2024", add_special_tokens=False) == [gguf_vocab.index(d) for d in "2024"]
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False) == [
        1,
        gguf_vocab.index("user"),
        2,
    ]
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert len(tok) == 49152


@pytest.mark.parametrize(
    "text",
    [
        "In 2024, 3.14159 apples cost $12.50!",
        "Café naïve résumé — Zürich, 東京, Ελληνικά",
        "emoji 🙂🚀👍🏽 and ZWJ 👩‍💻",
        "def f(x):\n    return x ** 2\n\n\tprint('hi')  # done\r\n",
        "  leading and trailing spaces  ",
    ],
)
def test_tokenizer_round_trips(smol: LoadedModel, text: str) -> None:
    ids = smol.tokenizer.encode(text, add_special_tokens=False)
    assert smol.tokenizer.decode(ids) == text


def test_no_bos_added(smol: LoadedModel) -> None:
    # SmolLM2's GGUF says add_bos_token = false; the chat template adds markers.
    assert smol.tokenizer.encode("hi") == smol.tokenizer.encode("hi", add_special_tokens=False)


def test_chat_template_renders_chatml(smol: LoadedModel) -> None:
    assert smol.chat_template is not None
    rendered = smol.tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False
    )
    assert rendered.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rendered.startswith("<|im_start|>system\n")


def test_greedy_answer_names_paris(smol: LoadedModel) -> None:
    assert "Paris" in _greedy(smol.model, smol.tokenizer_wrapper)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    from mlx_lm.gguf import permute_weights

    rows = mx.arange(9 * 64 * 3).reshape(9 * 64, 3)
    assert mx.array_equal(_unpermute(permute_weights(rows, 9), 9), rows)


def test_float32_conversion_matches_quantized(
    tmp_path: Path, resolved: ResolvedModel, smol: LoadedModel
) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    folder = convert_gguf(default_gguf_path(), tmp_path / "f32")
    model, wrapper = load(str(folder))
    # convert_gguf's float32 output holds exactly the numbers load_model gets
    # by dequantising the cached quantised checkpoint, so the Paris check on
    # ``smol`` covers this folder too.
    theirs = dict(tree_flatten(model.parameters()))
    ours = dict(tree_flatten(smol.model.parameters()))
    assert theirs.keys() == ours.keys()
    assert all(theirs[k].dtype == mx.float32 and mx.array_equal(theirs[k], ours[k]) for k in ours)

    quantized = load_model(resolved, keep_quantized=True)
    assert quantized.quantized
    # Short prompt: quantised CPU kernels are slow.
    prompt = mx.array([wrapper.encode("The capital of France is")])
    top_f32 = mx.argmax(model(prompt)[0, -1]).item()
    top_q = mx.argmax(quantized.model(prompt)[0, -1]).item()
    assert top_f32 == top_q

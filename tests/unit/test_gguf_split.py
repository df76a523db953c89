"""Split GGUF files (``NAME-00001-of-0000N.gguf``, llama.cpp's ``llama-gguf-split`` and gguf-py's
writer): served from their first part as the single file they were split from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlxcel.models import gguf_split
from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.gguf_read import read_gguf
from mlxcel.models.resolve import resolve_model
from tests.support.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny quantised Llama 3 as one file, and split into parts of at most 4 tensors."""
    root = tmp_path_factory.mktemp("split")
    whole = write_tiny_gguf("llama3-quants", root / "whole" / "tiny.gguf")
    first = write_tiny_gguf("llama3-quants", root / "split" / "tiny.gguf", split_max_tensors=4)
    return whole, first


def test_the_parts_read_as_the_file_they_were_split_from(files: tuple[Path, Path]) -> None:
    whole, first = files
    parts = gguf_split.parts(first)
    assert len(parts) > 2 and first.name == f"tiny-00001-of-{len(parts):05d}.gguf"
    one, split = read_gguf(whole), read_gguf(first)
    assert split.metadata == one.metadata  # the first part's, without its split.* keys
    assert not any(k.startswith("split.") for k in split.metadata)
    assert split.types == one.types
    assert sorted(split.tensors) == sorted(one.tensors)
    for name, array in one.tensors.items():
        assert np.array_equal(np.array(split.tensors[name]), np.array(array)), name


def test_a_split_gguf_is_served_under_its_name(files: tuple[Path, Path], tmp_path: Path) -> None:
    _, first = files
    resolved = resolve_model(str(first), cache_dir=tmp_path)
    assert resolved.model_id == "tiny" and resolved.source == "gguf"
    # Converted from what read_gguf gave (the whole file's arrays, as the test above shows).
    assert (resolved.path / "model.safetensors").is_file()
    assert (resolved.path / "tokenizer.json").is_file()


def test_a_missing_part_is_named(files: tuple[Path, Path], tmp_path: Path) -> None:
    _, first = files
    parts = gguf_split.parts(first)
    for part in parts[:-1]:  # every part but the last, beside each other
        (tmp_path / part.name).symlink_to(part)
    with pytest.raises(UnsupportedModel, match=f"lacks {parts[-1].name}: every part"):
        resolve_model(str(tmp_path / first.name), cache_dir=tmp_path / "cache")


def test_parts_that_do_not_belong_together_are_refused(
    files: tuple[Path, Path], tmp_path: Path
) -> None:
    whole, first = files
    parts = gguf_split.parts(first)
    for part in parts:
        (tmp_path / part.name).symlink_to(part)
    (tmp_path / parts[1].name).unlink()
    (tmp_path / parts[1].name).symlink_to(whole)  # a whole file posing as part 2
    with pytest.raises(UnsupportedModel, match=r"part 2 of \d+ is no part of a split GGUF"):
        read_gguf(tmp_path / first.name)


def test_part_names() -> None:
    assert gguf_split.base_name("big-Q4_K_M-00001-of-00003.gguf") == "big-Q4_K_M"
    assert gguf_split.base_name("big-Q4_K_M.gguf") == "big-Q4_K_M"
    assert gguf_split.part_names("m-00002-of-00003.GGUF") == [
        "m-00001-of-00003.GGUF",
        "m-00002-of-00003.GGUF",
        "m-00003-of-00003.GGUF",
    ]
    assert gguf_split.part_names("m.gguf") == ["m.gguf"]

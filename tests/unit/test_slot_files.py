"""Slot save files: a round trip is exact, and whatever is not a file this server wrote for this
model is refused with a reason (never unpickled, never built into objects)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlxcel.http import slot_files
from mlxcel.runtime.messages import SlotState


def state(n: int = 3, layers: int = 2) -> SlotState:
    rng = np.random.default_rng(0)
    kv = [rng.random((1, 2, n, 4), dtype=np.float32) for _ in range(2 * layers)]
    return SlotState(tuple(range(n)), tuple(kv[0::2]), tuple(kv[1::2]))


def test_round_trip_is_exact(tmp_path: Path) -> None:
    saved = state()
    n = slot_files.write(tmp_path / "a.bin", saved, "model (float32)")
    back, size = slot_files.read(tmp_path / "a.bin", "model (float32)")
    assert n == size == (tmp_path / "a.bin").stat().st_size
    assert back.tokens == saved.tokens
    for a, b in zip(saved.keys + saved.values, back.keys + back.values, strict=True):
        assert np.array_equal(a, b) and a.dtype == b.dtype
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]  # no temporary file left


def header(**fields: object) -> bytes:
    head = json.dumps({"format": "mlxcel-slot", "version": 1, "model": "m", **fields}).encode()
    return slot_files.MAGIC + len(head).to_bytes(8, "little") + head


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "not a slot save file"),
        (b"GGUF....", "not a slot save file"),
        (slot_files.MAGIC + b"\xff" * 8, "header is damaged"),
        (header(version=2, tokens=0, arrays=[]), "unsupported slot file version"),
        (header(model="other", tokens=0, arrays=[]), "saved with model"),
        (header(tokens=1, arrays=[{"shape": [1], "dtype": "|O"}]), "not KV state"),
        (header(tokens=4, arrays=[]) + b"\0" * 4, "size does not match"),
    ],
)
def test_foreign_or_damaged_files_are_refused(tmp_path: Path, content: bytes, reason: str) -> None:
    (tmp_path / "x.bin").write_bytes(content)
    with pytest.raises(slot_files.SlotFileError, match=reason):
        slot_files.read(tmp_path / "x.bin", "m")


def test_a_cut_file_is_refused(tmp_path: Path) -> None:
    slot_files.write(tmp_path / "a.bin", state(), "m")
    data = (tmp_path / "a.bin").read_bytes()
    (tmp_path / "a.bin").write_bytes(data[:-5])
    with pytest.raises(slot_files.SlotFileError, match="size does not match"):
        slot_files.read(tmp_path / "a.bin", "m")


def test_a_missing_file_does_not_name_the_server_folder(tmp_path: Path) -> None:
    with pytest.raises(slot_files.SlotFileError) as error:
        slot_files.read(tmp_path / "gone.bin", "m")
    assert str(tmp_path) not in str(error.value) and "gone.bin" in str(error.value)


@pytest.mark.parametrize(
    "name", ["../x", "a/b", "a\\b", "", ".", "..", " x", "x ", "x.", "a\nb", "a\ufeffb", 7]
)
def test_only_plain_file_names_are_valid(name: object) -> None:
    assert not slot_files.valid_filename(name)


def test_a_plain_name_is_valid() -> None:
    assert slot_files.valid_filename("slot-1.bin")

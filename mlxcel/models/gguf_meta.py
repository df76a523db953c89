"""What the GGUF modules share: reading metadata values as plain Python."""

from __future__ import annotations

from typing import Any

from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.mlx_setup import mx

__all__ = ["ROLE_KEYS", "f32", "floats", "ints", "require", "value"]

# HF role -> GGUF metadata key (llama.cpp spells two of them out).
ROLE_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "pad": "padding_token_id",
}


def value(md: dict[str, Any], key: str, default: Any = None) -> Any:
    value = md.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def f32(value: Any) -> float:
    return float(f"{float(value):.7g}")


def require(md: dict[str, Any], key: str) -> Any:
    found = value(md, key)
    if found is None:
        raise UnsupportedModel(f"GGUF metadata lacks {key!r}")
    return found


def _items(md: dict[str, Any], key: str) -> list[Any] | None:
    found = md.get(key)
    if found is None:
        return None
    items: Any = found
    if isinstance(found, mx.array):  # metadata as mx.load gives it
        items = found.reshape(-1).tolist()
    elif hasattr(found, "tolist"):  # a numpy array
        items = found.tolist()
    return list(items)


def ints(md: dict[str, Any], key: str) -> list[int] | None:
    """An integer array (``tokenizer.ggml.token_type``) as a list, or None when absent."""
    items = _items(md, key)
    return None if items is None else [int(v) for v in items]


def floats(md: dict[str, Any], key: str) -> list[float] | None:
    """A float array (``tokenizer.ggml.scores``) as a list, or None when absent."""
    items = _items(md, key)
    return None if items is None else [float(v) for v in items]

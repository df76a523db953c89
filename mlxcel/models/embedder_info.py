"""What a loaded embedding or reranking model tells the rest of the server (no mlx objects).

A light module: the embedder actor and the HTTP routes read these without importing mlx.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import attrs

EmbedderKind = Literal["encoder", "decoder", "classifier"]


@attrs.frozen(kw_only=True)
class EmbedderInfo:
    """Facts about a loaded embedder or cross-encoder for the Trio side (no mlx objects)."""

    model_id: str
    path: Path | None
    kind: EmbedderKind
    # Vector width (embedders); cross-encoders report their hidden size.
    dim: int
    vocab_size: int
    # Longest input in tokens; longer texts are truncated, longer token-id inputs refused.
    max_length: int
    pooling: str
    # The sentence-transformers layout ends with a Normalize module.
    normalize: bool = False
    n_params: int = 0
    # The transformers tokenizer (thread-safe encode/decode), for routes that tokenise.
    tokenizer: Any = attrs.field(default=None, repr=False, eq=False)

    @property
    def is_reranker(self) -> bool:
        return self.kind == "classifier"


@attrs.frozen
class Encoded:
    """One tokenised item: ids, and segment ids for sentence pairs."""

    ids: tuple[int, ...]
    types: tuple[int, ...] | None = None

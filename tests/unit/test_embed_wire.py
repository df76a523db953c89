"""Input parsing, normalisation and rank order of the embeddings / rerank routes (no model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlxcel.http.embeddings import normalize, parse_inputs, rank
from mlxcel.models.embedder_info import EmbedderInfo
from mlxcel.runtime.errors import InvalidRequest

INFO = EmbedderInfo(
    model_id="m",
    path=Path("/m"),
    kind="encoder",
    dim=4,
    vocab_size=100,
    max_length=8,
    pooling="mean",
)


def test_every_input_shape_is_accepted() -> None:
    assert parse_inputs("a", INFO) == ("a",)
    assert parse_inputs(["a", "b"], INFO) == ("a", "b")
    assert parse_inputs([1, 2, 3], INFO) == ((1, 2, 3),)
    assert parse_inputs([[1, 2], [3]], INFO) == ((1, 2), (3,))
    assert parse_inputs(["a", [5]], INFO) == ("a", (5,))
    # The typed text parts of the contract's multimodal shape.
    assert parse_inputs([{"type": "text", "text": "a"}, "b"], INFO) == ("a", "b")
    # llama-server's object forms: one input each, alone or in a list.
    assert parse_inputs({"prompt_string": "a"}, INFO) == ("a",)
    parts = [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]
    assert parse_inputs({"content": parts}, INFO) == ("a b",)
    assert parse_inputs(["x", {"prompt_string": "y"}, {"content": parts}], INFO) == (
        "x",
        "y",
        "a b",
    )


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (None, '"input" or "content" must be provided'),
        ([], "must not be empty"),
        ("", "empty string"),
        (["a", ""], "'input[1]' must not be an empty string"),
        ([100], "outside the vocabulary"),
        ([[1], [-1]], "outside the vocabulary"),
        ([[]], "empty token list"),
        ([1] * 9, "at most 8"),
        ({"text": "a"}, "must be a string"),
        ([True], "must be a string or a list of token ids"),
        ([{"type": "image_url", "image_url": {"url": "x"}}], "image input is not supported"),
        ([{"type": "text"}], "{type: text, text}"),
        ([{"type": "text", "text": ""}], "empty string"),
        ({"content": "a"}, "'input[0].content' must be a list of content parts"),
        ({"content": [{"type": "input_audio", "input_audio": {}}]}, "{type: text, text}"),
        ([1] * 9, "too large to process"),
    ],
)
def test_bad_inputs_are_400_naming_the_field(value: object, needle: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_inputs(value, INFO)
    assert needle in info.value.message
    assert info.value.status == 400 and info.value.param == "input"


def test_normalisation_modes_follow_llama_server() -> None:
    v = np.array([[3.0, -4.0, 0.0, 0.0]], dtype=np.float32)
    np.testing.assert_allclose(normalize(v, -1), v)
    np.testing.assert_allclose(normalize(v, 2), [[0.6, -0.8, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(normalize(v, 1), [[3 / 7, -4 / 7, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(normalize(v, 0), [[32760 * 3 / 4, -32760, 0, 0]], rtol=1e-6)
    p3 = (27 + 64) ** (1 / 3)
    np.testing.assert_allclose(normalize(v, 3), [[3 / p3, -4 / p3, 0, 0]], rtol=1e-6)
    zero = np.zeros((1, 4), dtype=np.float32)
    assert np.isfinite(normalize(zero, 2)).all()


def test_rank_sorts_by_score_then_lower_index_then_cuts() -> None:
    assert rank([0.1, 0.9, 0.5, 0.9]) == [1, 3, 2, 0]
    assert rank([0.5, 0.5, 0.5], top_n=2) == [0, 1]
    assert rank([0.2, 0.3], top_n=5) == [1, 0]

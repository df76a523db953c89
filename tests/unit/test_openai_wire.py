"""Length fields of the OpenAI routes: -1 is llama.cpp's "no limit", other negatives a 400."""

from __future__ import annotations

import pytest

from mlxcel.http.openai_wire import chat_request, completion_request
from mlxcel.runtime.errors import InvalidRequest

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n_predict"])
def test_minus_one_is_no_limit_and_other_negatives_are_named(field: str) -> None:
    _, gen = chat_request({"messages": MESSAGES, field: -1})
    assert gen.max_tokens is None
    _, gen = chat_request({"messages": MESSAGES, field: 7})
    assert gen.max_tokens == 7
    with pytest.raises(InvalidRequest) as error:
        chat_request({"messages": MESSAGES, field: -3})
    assert error.value.param == field


def test_legacy_completions_read_the_same_way() -> None:
    _, gen = completion_request({"prompt": "a", "max_tokens": -1})
    assert gen.max_tokens is None
    with pytest.raises(InvalidRequest) as error:
        completion_request({"prompt": "a", "n_predict": -9})
    assert error.value.param == "n_predict"


def test_a_nested_extra_body_reads_as_top_level_fields() -> None:
    _, gen = chat_request({"messages": MESSAGES, "extra_body": {"top_k": 5, "seed": 3}, "seed": 4})
    assert gen.sampling.top_k == 5 and gen.sampling.seed == 4  # the top level wins
    _, gen = completion_request({"prompt": "a", "extra_body": {"max_tokens": 6}})
    assert gen.max_tokens == 6
    with pytest.raises(InvalidRequest) as error:
        chat_request({"messages": MESSAGES, "extra_body": [1]})
    assert error.value.param == "extra_body"
    # Unknown fields inside it are named like any other.
    with pytest.raises(InvalidRequest, match="no_such_field"):
        chat_request({"messages": MESSAGES, "extra_body": {"no_such_field": 1}})

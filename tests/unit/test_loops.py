"""The n-gram loop breaker: a pattern of min..max tokens said min_count times in a row."""

from __future__ import annotations

import pytest

from mlxcel.actors.loops import LoopDetector
from mlxcel.http.openai_wire import chat_request
from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import LoopLimit


def first_loop(tokens: list[int], limit: LoopLimit) -> int | None:
    """The index of the token at which the detector fires, None when it never does."""
    d = LoopDetector(limit)
    return next((i for i, t in enumerate(tokens) if d.feed(t)), None)


def test_a_repeated_pattern_fires_on_its_last_repeat() -> None:
    limit = LoopLimit(min_size=1, max_size=4, min_count=3)
    assert first_loop([9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 7], limit) == 9
    assert first_loop([5, 5, 5], limit) == 2
    # Two repeats are not enough, and a pattern broken in the middle starts again.
    assert first_loop([1, 2, 1, 2, 8, 1, 2, 1, 2], limit) is None


def test_pattern_sizes_outside_the_range_do_not_fire() -> None:
    # A 5-token pattern with at most 4 looked for; a 1-token run with at least 2.
    assert first_loop([1, 2, 3, 4, 5] * 4, LoopLimit(1, 4, 3)) is None
    assert first_loop([7] * 10, LoopLimit(2, 4, 3)) == 5  # (7, 7) three times
    assert first_loop([7, 8] * 3, LoopLimit(3, 4, 3)) is None


MESSAGES = [{"role": "user", "content": "hi"}]


def test_fields_map_onto_the_request_and_are_checked() -> None:
    _, gen = chat_request({"messages": MESSAGES, "max_pattern_size": 8, "min_count": 3})
    assert gen.loop_limit == LoopLimit(min_size=1, max_size=8, min_count=3)
    _, gen = chat_request({"messages": MESSAGES})
    assert gen.loop_limit is None
    for extra, param in (
        ({"max_pattern_size": 8}, "min_count"),
        ({"max_pattern_size": 8, "min_count": 1}, "min_count"),
        ({"max_pattern_size": -1}, "max_pattern_size"),
        ({"max_pattern_size": 4, "min_pattern_size": 5, "min_count": 2}, "min_pattern_size"),
        ({"min_count": 3}, "min_count"),
    ):
        with pytest.raises(InvalidRequest) as error:
            chat_request({"messages": MESSAGES, **extra})
        assert error.value.param == param, extra

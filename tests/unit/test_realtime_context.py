"""Truncation of a realtime conversation: the budget, the sticky cut and the wire forms."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mlxcel.actors.realtime.config import ProtocolError, SessionConfig
from mlxcel.http.realtime_openai import OpenAIRealtime
from mlxcel.http.realtime_voicechat import VoiceChat, truncation_wire
from mlxcel.runtime.truncation import Truncation, budget, first_kept


def tokens_from(sizes: list[int], calls: list[int]) -> Callable[[int], int]:
    """The conversation's tokens from item k on, for items of these sizes (logs each call)."""

    def f(k: int) -> int:
        calls.append(k)
        return sum(sizes[k:])

    return f


def test_under_the_budget_nothing_moves() -> None:
    sizes = [30] * 10
    calls: list[int] = []
    assert first_kept(10, 0, tokens_from(sizes, calls), limit=300, ratio=0.5) == 0
    assert calls == [0]  # one count per turn while it fits


def test_over_the_budget_the_cut_drops_to_the_retention_ratio_and_then_stays() -> None:
    sizes = [30] * 11  # 330 tokens, budget 300
    cut = first_kept(11, 0, tokens_from(sizes, []), limit=300, ratio=0.5)
    assert sum(sizes[cut:]) <= 150 and sum(sizes[cut - 1 :]) > 150
    assert cut == 6
    # The next turns add items: the cut stays until the budget is exceeded again.
    for extra in range(1, 6):
        grown = sizes + [30] * extra
        assert first_kept(len(grown), cut, tokens_from(grown, []), limit=300, ratio=0.5) == cut
    grown = sizes + [30] * 6  # 11 items from the cut on: 330 > 300
    assert first_kept(len(grown), cut, tokens_from(grown, []), limit=300, ratio=0.5) > cut


def test_auto_cuts_just_enough() -> None:
    sizes = [10, 50, 50, 50, 50]
    assert first_kept(5, 0, tokens_from(sizes, []), limit=200, ratio=1.0) == 1


def test_the_newest_item_is_always_kept() -> None:
    sizes = [10, 10, 500]
    assert first_kept(3, 0, tokens_from(sizes, []), limit=100, ratio=0.8) == 2
    assert first_kept(3, 2, tokens_from(sizes, []), limit=100, ratio=0.8) == 2
    assert first_kept(0, 0, tokens_from([], []), limit=100, ratio=0.8) == 0


def test_budget_leaves_room_for_instructions_and_the_answer() -> None:
    auto = Truncation()
    assert budget(auto, context=8192, instructions=40, max_output=256) == 8192 - 40 - 256
    assert budget(auto, context=8192, instructions=40, max_output=None) == 8192 - 40 - 2048
    capped = Truncation(retention_ratio=0.8, post_instructions=500)
    assert budget(capped, context=8192, instructions=40, max_output=256) == 500
    assert budget(capped, context=300, instructions=40, max_output=4096) == 300 - 40 - 150


def test_session_update_reads_and_echoes_truncation() -> None:
    d = OpenAIRealtime()
    cfg = d.initial_config("m")
    assert cfg.truncation == Truncation()
    assert d.session_updated("s", cfg)[0]["session"]["truncation"] == "auto"
    ratio = {"type": "retention_ratio", "retention_ratio": 0.8}
    d.apply_update(
        cfg, {"truncation": {**ratio, "token_limits": {"post_instructions": 900}}}, first=False
    )
    assert cfg.truncation == Truncation(0.8, 900)
    assert truncation_wire(cfg.truncation) == {**ratio, "token_limits": {"post_instructions": 900}}
    d.apply_update(cfg, {"truncation": "disabled"}, first=False)
    assert cfg.truncation is None
    assert d.session_updated("s", cfg)[0]["session"]["truncation"] == "disabled"


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ("sometimes", "session.truncation"),
        ({"type": "retention_ratio"}, "session.truncation.retention_ratio"),
        ({"type": "retention_ratio", "retention_ratio": 1.5}, "session.truncation.retention_ratio"),
        (
            {
                "type": "retention_ratio",
                "retention_ratio": 0.5,
                "token_limits": {"post_instructions": 0},
            },
            "session.truncation.token_limits.post_instructions",
        ),
        (
            {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"pre": 5}},
            "session.truncation.token_limits.pre",
        ),
    ],
)
def test_bad_truncation_is_an_error_naming_the_field(value: object, param: str) -> None:
    cfg = SessionConfig(model="m")
    with pytest.raises(ProtocolError) as caught:
        OpenAIRealtime().apply_update(cfg, {"truncation": value}, first=False)
    assert caught.value.param == param


def test_voicechat_takes_the_same_truncation_field() -> None:
    d = VoiceChat(22_050)
    cfg = d.initial_config("m")
    d.apply_update(
        cfg, {"truncation": {"type": "retention_ratio", "retention_ratio": 0.7}}, first=True
    )
    assert cfg.truncation == Truncation(0.7, None)
    assert d.session_updated("s", cfg)[0]["session"]["truncation"]["retention_ratio"] == 0.7

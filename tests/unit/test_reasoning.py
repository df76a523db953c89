"""Thinking split from the answer in every chunking, and the thinking-budget decision."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

from mlxcel.actors.reasoning import (
    ReasoningDelta,
    ReasoningFormat,
    ReasoningSplitter,
    ThinkingBudget,
    detect_reasoning,
    split_complete,
)
from mlxcel.actors.toolcalls import TextDelta

Piece = ReasoningDelta | TextDelta


def merged(events: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for ev in events:
        if out and type(out[-1]) is type(ev):
            out[-1] = type(ev)(out[-1].text + ev.text)
        else:
            out.append(ev)
    return out


def run(chunks: list[str], *, starts_open: bool = False) -> list[Piece]:
    sp = ReasoningSplitter(starts_open=starts_open)
    events: list[Piece] = []
    for c in chunks:
        events += sp.feed(c)
    return merged(events + sp.finish())


def chunkings(text: str) -> Iterator[list[str]]:
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(99)
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


CASES = [
    # Qwen3 / SmolLM3: thinking first, newlines around the markers
    (
        "<think>\nThe user asks for the capital of France.\n\nThat is Paris.\n</think>\n\n"
        "The capital of France is **Paris**.",
        False,
        "The user asks for the capital of France.\n\nThat is Paris.",
        "The capital of France is **Paris**.",
    ),
    # DeepSeek-R1-0528: the template opened <think>, only </think> appears
    (
        "Okay, 17 * 3 = 51. Check: 51 / 3 = 17.\n</think>\n\n17 × 3 = **51**.",
        True,
        "Okay, 17 * 3 = 51. Check: 51 / 3 = 17.",
        "17 × 3 = **51**.",
    ),
    # primed open, but the model repeats the opening marker anyway
    (
        "<think>\nHmm < 3 and a </thin air.\n</think>\nDone.",
        True,
        "Hmm < 3 and a </thin air.",
        "Done.",
    ),
    # no reasoning at all: content passes through exactly, angle brackets included
    ("a < b, <thing> and <thin ice>\n", False, None, "a < b, <thing> and <thin ice>\n"),
    # cut off by max_tokens inside thinking: it stays reasoning, even a partial end marker
    (
        "<think>\nLet me count the r's: s-t-r-a-w</th",
        False,
        "Let me count the r's: s-t-r-a-w</th",
        "",
    ),
    ("Still thinking\n", True, "Still thinking", ""),
    # thinking that ends at once (Qwen3 with thinking switched off in the output)
    ("<think>\n\n</think>\n\nHi!", False, "", "Hi!"),
]


@pytest.mark.parametrize(("text", "starts_open", "reasoning", "content"), CASES)
def test_split_is_the_same_in_every_chunking(
    text: str, starts_open: bool, reasoning: str | None, content: str
) -> None:
    assert split_complete(text, starts_open=starts_open) == (reasoning, content)
    whole = run([text], starts_open=starts_open)
    for chunks in chunkings(text):
        assert run(chunks, starts_open=starts_open) == whole, chunks


def test_reasoning_streams_while_thinking() -> None:
    sp = ReasoningSplitter()
    assert sp.feed("<think>\n") == []
    assert sp.in_reasoning
    assert sp.feed("First") == [ReasoningDelta("First")]
    assert sp.feed(" step.\n") == [ReasoningDelta(" step.")]  # the newline waits
    assert sp.feed("Second.") == [ReasoningDelta("\nSecond.")]
    assert sp.feed("</th") == []
    assert sp.feed("ink>\n\nAnswer") == [TextDelta("Answer")]
    assert not sp.in_reasoning
    assert sp.finish() == []


def test_format_detection_and_primed_prompts() -> None:
    qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>"
    assert detect_reasoning(qwen3) == ReasoningFormat()
    assert detect_reasoning("{{ '<|im_start|>assistant\n' }}") is None
    r1 = "{% set content = content.split('</think>')[-1] %}{{'<｜Assistant｜>' + content}}"
    assert detect_reasoning(r1) == ReasoningFormat()
    assert detect_reasoning(None) is None
    fmt = ReasoningFormat()
    assert fmt.opened_by("<｜User｜>2+2?<｜Assistant｜><think>\n")
    assert not fmt.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not fmt.opened_by("<|im_start|>assistant\n")


def drive(budget: ThinkingBudget, states: list[bool]) -> list[int]:
    """Positions at which the budget asks for thinking to be closed."""
    return [i for i, s in enumerate(states) if budget.observe(s)]


def test_budget_caps_reasoning_tokens() -> None:
    # token 0 opens <think>, then reasoning tokens; the third reasoning token hits the cap
    assert drive(ThinkingBudget(3), [True, True, True, True, True]) == [3]
    assert drive(ThinkingBudget(-1), [True] * 50) == []
    assert drive(ThinkingBudget(0), [False, True, True]) == [1]  # close right at <think>


def test_budget_asks_once_then_again_if_thinking_reopens() -> None:
    b = ThinkingBudget(2)
    states = [True, True, True, True, False, False, True, True]
    assert drive(b, states) == [2, 6]
    assert b.used == 4  # the token after the request still counts: it was thinking


def test_budget_for_primed_open_prompts() -> None:
    assert ThinkingBudget(0, starts_open=True).exhausted  # close it in the prompt
    assert drive(ThinkingBudget(2, starts_open=True), [True, True, True]) == [1]
    with pytest.raises(ValueError, match="thinking budget"):
        ThinkingBudget(-2)

"""Incremental detokenisation and stop strings, on the real SmolLM2 tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from mlxcel.actors.detok import IncrementalDetokenizer, StopMatcher

TEXTS = [
    "Hello, world! 12345 numbers split into digits.",
    "Ünïcödé façade — naïve café 🎉🚀 and 中文字符 mixed.",
    "def f(x):\n    return x ** 2  # code\n\n\ttabs",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_reassemble_the_text_and_never_split_a_character(
    smollm_tokenizer: Any, text: str
) -> None:
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm_tokenizer)
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_emoji_made_of_several_byte_tokens_arrives_whole(smollm_tokenizer: Any) -> None:
    ids = smollm_tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character spread over several tokens"
    detok = IncrementalDetokenizer(smollm_tokenizer)
    deltas = [detok.add(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🎉"


def test_stop_string_split_across_deltas_is_cut() -> None:
    m = StopMatcher(["</end>"])
    out = []
    for piece in ["Hello </", "en", "d> never shown"]:
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "Hello "
    assert hit == "</end>"


def test_partial_stop_prefix_that_does_not_complete_is_released() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", None)
    assert m.feed("OCK") == ("STOCK", None)
    assert m.flush() == ""


def test_earliest_of_several_stop_strings_wins() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", "lo w")


def test_held_text_is_flushed_at_the_end() -> None:
    m = StopMatcher(["xyz"])
    assert m.feed("abx") == ("ab", None)
    assert m.flush() == "x"


def test_special_tokens_are_hidden_except_the_parsers_markers(smollm_tokenizer: Any) -> None:
    from mlxcel.actors.streamer import hidden_special_tokens

    hidden = hidden_special_tokens(smollm_tokenizer)
    assert hidden is not None and 1 in hidden  # <|im_start|> is not a marker: hidden
    ids = [1, *smollm_tokenizer.encode("Hello", add_special_tokens=False)]
    detok = IncrementalDetokenizer(smollm_tokenizer, hidden=hidden)
    assert "".join(detok.add(t) for t in ids) + detok.flush() == "Hello"
    keep_im_start = IncrementalDetokenizer(smollm_tokenizer, hidden=hidden - {1})
    assert "".join(keep_im_start.add(t) for t in ids) + keep_im_start.flush() == "<|im_start|>Hello"


def test_every_tool_format_marker_stays_visible_when_it_is_a_special_token() -> None:
    # GLM-4.5, DeepSeek V3.1 and Kimi K2 make their call markers special tokens: hidden like
    # other special tokens, no call of theirs could ever be parsed.
    from tokenizers import AddedToken

    from mlxcel.actors.streamer import hidden_special_tokens

    markers = [
        "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
        "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>",
    ]  # fmt: skip

    class Vocab:
        added_tokens_decoder = {
            i: AddedToken(t, special=True) for i, t in enumerate([*markers, "<|im_end|>"])
        }

    assert hidden_special_tokens(Vocab()) == {len(markers)}


def test_harmony_framing_stays_visible_only_in_a_harmony_vocabulary() -> None:
    """gpt-oss's channels are read from its framing tokens; another vocabulary's <|end|> (or
    <|start|>) is still hidden."""
    from tokenizers import AddedToken

    from mlxcel.actors.streamer import hidden_special_tokens
    from mlxcel.actors.toolcalls.harmony import TOKENS

    class Harmony:
        added_tokens_decoder = {
            i: AddedToken(t, special=True) for i, t in enumerate([*TOKENS, "<|endoftext|>"])
        }

    class Other:
        added_tokens_decoder = {0: AddedToken("<|end|>", special=True)}

    assert hidden_special_tokens(Harmony()) == {len(TOKENS)}
    assert hidden_special_tokens(Other()) == {0}

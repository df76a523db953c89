"""gpt-oss's harmony output: the channel splitter and the call parser behind it, in every
chunking; detection; the forced-call grammar; how history reaches the template."""

from __future__ import annotations

from typing import Any

import llguidance.hf
import pytest
from llguidance import LLMatcher, LLTokenizer

from mlxcel.actors import grammars
from mlxcel.actors.harmony import harmony_history
from mlxcel.actors.reasoning import HarmonyFormat, ReasoningDelta, detect_reasoning
from mlxcel.actors.toolcalls import TextDelta, ToolCall, ToolFormat, collect, detect, make_parser
from mlxcel.runtime.messages import ForcedToolCall
from tests.support.templates import GPT_OSS_TOOLS

CALL = '{"city": "Oslo", "days": 2}'
# (model output, reasoning, content, calls as (name, arguments))
OUTPUTS: list[tuple[str, str | None, str | None, list[tuple[str, str]]]] = [
    (  # think, then answer
        "<|channel|>analysis<|message|>The user greets.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>",
        "The user greets.",
        "Hello! How can I help?",
        [],
    ),
    (  # think, then call (the model's spelling; <|call|> is an end-of-generation token, so
        # the text usually stops before it)
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{CALL}",
        "Need the weather.",
        None,
        [("get_weather", CALL)],
    ),
    (  # the template's spelling, continuing the prompt's <|start|>assistant, with <|call|>
        f" to=functions.get_weather<|channel|>commentary json<|message|>{CALL}<|call|>",
        None,
        None,
        [("get_weather", CALL)],
    ),
    (  # a preamble to the user, then a call
        "<|channel|>commentary<|message|>Checking the forecast.<|end|><|start|>assistant"
        f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{CALL}"
        "<|call|>",
        None,
        "Checking the forecast.",
        [("get_weather", CALL)],
    ),
    (  # two analysis messages, an answer ended by <|end|>
        "<|channel|>analysis<|message|>One. <|end|><|start|>assistant<|channel|>analysis"
        "<|message|>Two.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|end|>",
        "One. Two.",
        "Done.",
        [],
    ),
    ("No harmony at all.", None, "No harmony at all.", []),
    (  # arguments that are not JSON: the call's text is content, its framing is not
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>oops<|call|>",
        None,
        "oops",
        [],
    ),
]


def _run(chunks: list[str]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    splitter = HarmonyFormat().splitter()
    parser = make_parser(ToolFormat.GPT_OSS, new_id=lambda: "call_1")
    pieces = [p for c in chunks for p in splitter.feed(c)] + splitter.finish()
    reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))
    events = [e for p in pieces if isinstance(p, TextDelta) for e in parser.feed(p.text)]
    content, calls = collect(events + parser.finish())
    return (
        (reasoning if splitter.saw_reasoning else None),
        content,
        [(c.name, c.arguments) for c in calls],
    )


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), OUTPUTS)
def test_every_split_point_gives_the_same_channels(
    text: str, reasoning: str | None, content: str | None, calls: list[tuple[str, str]]
) -> None:
    whole = _run([text])
    got_content = whole[1] if whole[1] or not calls else None
    assert (whole[0], got_content, whole[2]) == (reasoning, content, calls)
    for i in range(len(text) + 1):
        assert _run([text[:i], text[i:]]) == whole, i
    assert _run(list(text)) == whole
    for part in (whole[0] or "", whole[1] or ""):
        assert "<|" not in part


def test_without_call_parsing_a_call_message_is_content_without_its_framing() -> None:
    """``tool_choice: none`` (or no tools): a call the model writes anyway is shown as its
    arguments, never as harmony markup."""
    text = (
        "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>commentary "
        f"to=functions.get_weather <|constrain|>json<|message|>{CALL}<|call|>"
    )
    for chunks in ([text], list(text)):
        splitter = HarmonyFormat().splitter(calls=False)
        pieces = [p for c in chunks for p in splitter.feed(c)] + splitter.finish()
        assert "".join(p.text for p in pieces if isinstance(p, TextDelta)) == CALL
        assert "".join(p.text for p in pieces if isinstance(p, ReasoningDelta)) == "Hm."


def test_a_call_cut_by_the_budget_keeps_its_arguments_so_far() -> None:
    parser = make_parser(ToolFormat.GPT_OSS, new_id=lambda: "call_1")
    head = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    events = parser.feed(head + '{"city": "Os') + parser.finish(cut=True)
    content, calls = collect(events)
    assert content is None
    assert calls == [ToolCall("call_1", "get_weather", '{"city": "Os')]


def test_harmony_is_detected_from_the_template_and_the_vocabulary() -> None:
    assert detect(GPT_OSS_TOOLS, None) is ToolFormat.GPT_OSS
    assert detect(None, {"<|channel|>": 200005, "<|call|>": 200012}) is ToolFormat.GPT_OSS
    assert isinstance(detect_reasoning(GPT_OSS_TOOLS), HarmonyFormat)
    # A harmony prompt never leaves analysis open: the model opens its channel itself.
    assert not HarmonyFormat().opened_by("<|start|>user<|message|>hi<|end|><|start|>assistant")


@pytest.fixture(scope="module")
def ll(smollm_tokenizer: Any) -> LLTokenizer:
    return llguidance.hf.from_tokenizer(smollm_tokenizer, n_vocab=49152, eos_token=2)


TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
HEAD = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"


def _accepts(ll: LLTokenizer, tok: Any, grammar: str, text: str) -> bool:
    matcher = LLMatcher(ll, grammar, log_level=0)
    ok = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
    return bool(ok) and matcher.is_accepting()


def test_the_forced_call_grammar_writes_one_harmony_call_after_optional_thinking(
    ll: LLTokenizer, smollm_tokenizer: Any
) -> None:
    forced = ForcedToolCall(names=("get_weather", "now"))
    g = grammars.grammar_for(forced, tools=TOOLS, tool_format=ToolFormat.GPT_OSS, special={})
    call = f"{HEAD}{CALL}<|call|>"
    thought = "<|channel|>analysis<|message|>Weather in Oslo.<|end|><|start|>assistant"
    assert _accepts(ll, smollm_tokenizer, g, call)
    assert _accepts(ll, smollm_tokenizer, g, thought + call)
    # One call only (the template renders a turn's first call), arguments by the schema.
    assert not _accepts(ll, smollm_tokenizer, g, call + "<|start|>assistant" + call)
    assert not _accepts(ll, smollm_tokenizer, g, f'{HEAD}{{"city": "Oslo"}}<|call|>')
    assert not _accepts(ll, smollm_tokenizer, g, "<|channel|>final<|message|>Hi<|return|>")
    # Thinking turned off (a budget of 0): the call comes first.
    quiet = grammars.grammar_for(
        forced, tools=TOOLS, tool_format=ToolFormat.GPT_OSS, special={}, think=False
    )
    assert _accepts(ll, smollm_tokenizer, quiet, call)
    assert not _accepts(ll, smollm_tokenizer, quiet, thought + call)


def test_the_grammar_matches_harmony_special_tokens_as_tokens() -> None:
    special = {"<|channel|>": 200005, "<|message|>": 200008, "<|end|>": 200007}
    forced = ForcedToolCall(names=("now",))
    lark = grammars.tool_call_lark(forced, TOOLS, ToolFormat.GPT_OSS, special)
    assert "<[200005]>" in lark and "<[200008]>" in lark and "<[200007]>" in lark
    assert '"<|call|>"' in lark  # not special in this vocabulary: its text
    # ... and llguidance takes it, the analysis bounded then.
    assert grammars.grammar_for(
        forced, tools=TOOLS, tool_format=ToolFormat.GPT_OSS, special=special
    )


def test_history_reasoning_reaches_the_template_as_thinking() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "reasoning_content": "plan", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": "said", "reasoning_content": "why", "tool_calls": [call]},
    ]
    out = harmony_history(messages)
    assert out[1]["thinking"] == "plan" and "reasoning_content" not in out[1]
    # The template refuses content and thinking on one call turn: the content stays.
    assert "thinking" not in out[3] and out[3]["content"] == "said"
    assert out[0] == messages[0] and out[2] == messages[2]

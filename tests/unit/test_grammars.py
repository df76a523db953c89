"""Grammar builders per tool-call format, the wire helpers, and the per-row guide.

Each forced-call grammar must accept what the model family really writes (and what our parser
reads back as calls), and refuse a wrong tool name or a second call when only one is allowed.
Matching runs on llguidance with the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance.hf
import pytest
from llguidance import LLMatcher, LLTokenizer

from mlxcel.actors import grammars
from mlxcel.actors.toolcalls import ToolFormat, parse_complete
from mlxcel.http import structured_wire
from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import ForcedToolCall, JsonObjectFormat, JsonSchemaFormat

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city", "days"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]
BOTH = ForcedToolCall(names=("get_weather", "now"))
ONE = ForcedToolCall(names=("get_weather", "now"), parallel=False)

# What each family writes for two calls (the first alone for the single-call cases).
TWO_CALLS = {
    ToolFormat.HERMES: (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        "</tool_call>",
        '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    ),
    ToolFormat.LLAMA3_JSON: (
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        '; {"name": "now", "parameters": {}}',
    ),
    ToolFormat.PYTHONIC: ('[get_weather(city="Paris", days=3)', ", now()]"),
}


@pytest.fixture(scope="module")
def ll(smollm_tokenizer: Any) -> LLTokenizer:
    return llguidance.hf.from_tokenizer(smollm_tokenizer, n_vocab=49152, eos_token=2)


def _accepts(ll: LLTokenizer, tok: Any, grammar: str, text: str) -> bool:
    matcher = LLMatcher(ll, grammar, log_level=0)
    ok = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
    return bool(ok) and matcher.is_accepting()


def _grammar(forced: ForcedToolCall, fmt: ToolFormat, special: Any = None) -> str:
    return grammars.grammar_for(forced, tools=TOOLS, tool_format=fmt, special=special or {})


@pytest.mark.parametrize("fmt", list(TWO_CALLS))
def test_forced_call_grammar_accepts_the_family_syntax(
    fmt: ToolFormat, ll: LLTokenizer, smollm_tokenizer: Any
) -> None:
    first, second = TWO_CALLS[fmt]
    closing = "]" if fmt is ToolFormat.PYTHONIC else ""
    single, double = first + closing, first + second
    assert _accepts(ll, smollm_tokenizer, _grammar(BOTH, fmt), double)
    assert _accepts(ll, smollm_tokenizer, _grammar(ONE, fmt), single)
    assert not _accepts(ll, smollm_tokenizer, _grammar(ONE, fmt), double)
    # ... and what the grammar lets through is what the parser reads as calls.
    content, calls = parse_complete(fmt, double)
    assert content is None and [c.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}


def test_mistral_grammar_accepts_a_call_array(ll: LLTokenizer, smollm_tokenizer: Any) -> None:
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}]'
    assert _accepts(ll, smollm_tokenizer, _grammar(ONE, ToolFormat.MISTRAL), text)
    two = text[:-1] + ', {"name": "now", "arguments": {}}]'
    assert _accepts(ll, smollm_tokenizer, _grammar(BOTH, ToolFormat.MISTRAL), two)
    assert not _accepts(ll, smollm_tokenizer, _grammar(ONE, ToolFormat.MISTRAL), two)


def test_arguments_follow_the_tool_schema(ll: LLTokenizer, smollm_tokenizer: Any) -> None:
    g = _grammar(ONE, ToolFormat.HERMES)
    for bad in (
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # days is required
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}',
        '{"name": "get_time", "arguments": {}}',  # not a forced name
    ):
        assert not _accepts(ll, smollm_tokenizer, g, f"<tool_call>\n{bad}\n</tool_call>")


def test_special_token_markers_are_matched_as_tokens() -> None:
    lark = grammars.tool_call_lark(ONE, TOOLS, ToolFormat.HERMES, {"<tool_call>": 151657})
    assert lark.startswith("start: call\ncall: <[151657]>") and '"</tool_call>"' in lark
    lark = grammars.tool_call_lark(ONE, TOOLS, ToolFormat.MISTRAL, {"[TOOL_CALLS]": 5})
    assert lark.startswith("start: <[5]> calls")


def test_json_formats_compile_and_bad_schemas_are_named() -> None:
    kw: dict[str, Any] = {"tools": None, "tool_format": None, "special": {}}
    assert grammars.grammar_for(JsonObjectFormat(), **kw)
    assert grammars.grammar_for(JsonSchemaFormat(schema_json=json.dumps(WEATHER)), **kw)
    for bad in ('{"type": "objekt"}', "[1]", "{"):
        with pytest.raises(InvalidRequest) as info:
            grammars.grammar_for(JsonSchemaFormat(schema_json=bad), **kw)
        assert info.value.param == "response_format"
    with pytest.raises(InvalidRequest) as info:
        grammars.grammar_for(
            ForcedToolCall(names=("nope",)), tools=TOOLS, tool_format=ToolFormat.HERMES, special={}
        )
    assert info.value.param == "tool_choice"


def test_wire_tool_choice_and_combination() -> None:
    names = ["get_weather", "now"]
    assert structured_wire.tool_choice(None, names, parallel=None) == (True, None)
    assert structured_wire.tool_choice("none", names, parallel=None) == (False, None)
    assert structured_wire.tool_choice("required", names, parallel=False) == (True, ONE)
    named = {"type": "function", "function": {"name": "now"}}
    parse, forced = structured_wire.tool_choice(named, names, parallel=True)
    assert parse and forced == ForcedToolCall(names=("now",), parallel=False)
    with pytest.raises(InvalidRequest):
        structured_wire.combine(JsonObjectFormat(), BOTH)
    assert structured_wire.combine(None, BOTH) is BOTH


def test_budget_aliases_and_server_default() -> None:
    budget = structured_wire.thinking_budget
    assert budget({}, -1) is None and budget({}, 7) == 7
    assert budget({"thinking_budget": 0}, -1) == 0
    assert budget({"reasoning_budget_tokens": 12, "thinking_budget": 3}, -1) == 12
    assert budget({"thinking_token_budget": -1}, 5) is None
    for bad in (-2, 1.5, True, "3"):
        with pytest.raises(InvalidRequest) as info:
            budget({"thinking_budget_tokens": bad}, -1)
        assert info.value.param == "thinking_budget_tokens"


GENERIC_CALL = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}'
NOW = '{"name": "now", "arguments": {}}'
GENERIC_LIST = '{"tool_calls": [' + NOW + ", " + NOW + "]}"
GENERIC_REPLY = '{"response": "It is sunny."}'


@pytest.mark.parametrize(
    ("parallel", "required", "accepted", "refused"),
    [
        (False, True, [GENERIC_CALL], [GENERIC_LIST, GENERIC_REPLY]),
        (True, True, [GENERIC_LIST], [GENERIC_CALL, GENERIC_REPLY]),
        (False, False, [GENERIC_CALL, GENERIC_REPLY], [GENERIC_LIST]),
    ],
)
def test_generic_grammar_allows_calls_and_a_reply_only_as_asked(
    parallel: bool,
    required: bool,
    accepted: list[str],
    refused: list[str],
    ll: LLTokenizer,
    smollm_tokenizer: Any,
) -> None:
    names = ["get_weather", "now"]
    g = grammars.generic_tool_grammar(TOOLS, names, parallel=parallel, required=required)
    for text in accepted:
        assert _accepts(ll, smollm_tokenizer, g, text), text
    for text in refused:
        assert not _accepts(ll, smollm_tokenizer, g, text), text
    # Arguments follow the tool's schema: "days" is required and an integer.
    bad = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}}'
    assert not _accepts(ll, smollm_tokenizer, g, bad)


# Formats whose calls sit in sections of special tokens, or whose arguments are tagged raw
# values: what each family writes for two calls, the way its chat template writes them back.
TAGGED_CALLS = {
    ToolFormat.QWEN3_CODER: (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
        "",
    ),
    ToolFormat.GLM45: (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "\n<tool_call>now\n</tool_call>",
        "",
    ),
    ToolFormat.DEEPSEEK_V31: (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", '
        '"days": 3}<｜tool▁call▁end｜>',
        "<｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
    ),
    ToolFormat.DEEPSEEK_V3: (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>',
        "\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
    ),
    ToolFormat.KIMI_K2: (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>',
        "<|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    ),
}


@pytest.mark.parametrize("fmt", list(TAGGED_CALLS))
def test_forced_call_grammar_accepts_the_tagged_family_syntax(
    fmt: ToolFormat, ll: LLTokenizer, smollm_tokenizer: Any
) -> None:
    first, second, end = TAGGED_CALLS[fmt]
    single, double = first + end, first + second + end
    assert _accepts(ll, smollm_tokenizer, _grammar(BOTH, fmt), double)
    assert _accepts(ll, smollm_tokenizer, _grammar(BOTH, fmt), single)
    assert _accepts(ll, smollm_tokenizer, _grammar(ONE, fmt), single)
    assert not _accepts(ll, smollm_tokenizer, _grammar(ONE, fmt), double)
    # ... and what the grammar lets through is what the parser reads as calls, typed by the
    # schema even where the arguments were raw text.
    content, calls = parse_complete(fmt, double, tools=TOOLS)
    assert content is None and [c.name for c in calls] == ["get_weather", "now"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris", "days": 3}, {}]


# Each family's call with one thing wrong: a required argument missing, a mistyped one, a name
# not forced, an argument the schema does not list, an enum value it does not allow.
TAGGED_BAD = {
    ToolFormat.QWEN3_CODER: [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=wind>\n3\n</parameter>\n</function>\n"
        "</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=units>\nK\n</parameter>\n</function>\n"
        "</tool_call>",
    ],
    ToolFormat.GLM45: [
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>three</arg_value>\n</tool_call>",
        "<tool_call>get_time\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units</arg_key>\n"
        "<arg_value>K</arg_value>\n</tool_call>",
    ],
    ToolFormat.DEEPSEEK_V31: [
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", '
        '"days": "3"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
    ],
    ToolFormat.DEEPSEEK_V3: [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n"
        "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", '
        '"days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',  # V3.1's syntax
    ],
    ToolFormat.KIMI_K2: [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>get_weather:0"  # no functions. prefix
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
    ],
}


@pytest.mark.parametrize(("fmt", "bad"), [(f, b) for f, bs in TAGGED_BAD.items() for b in bs])
def test_tagged_arguments_follow_the_tool_schema(
    fmt: ToolFormat, bad: str, ll: LLTokenizer, smollm_tokenizer: Any
) -> None:
    assert not _accepts(ll, smollm_tokenizer, _grammar(BOTH, fmt), bad)


def test_raw_text_values_are_bounded_and_cannot_hold_their_closing_tag(
    ll: LLTokenizer, smollm_tokenizer: Any
) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "write",
                "parameters": {
                    "type": "object",
                    "properties": {"text": {"type": "string", "maxLength": 12}},
                    "required": ["text"],
                },
            },
        }
    ]
    forced = ForcedToolCall(names=("write",), parallel=False)
    for fmt, head, tail in (
        (ToolFormat.QWEN3_CODER, "<tool_call>\n<function=write>\n<parameter=text>\n",
         "\n</parameter>\n</function>\n</tool_call>"),
        (ToolFormat.GLM45, "<tool_call>write\n<arg_key>text</arg_key>\n<arg_value>",
         "</arg_value>\n</tool_call>"),
    ):  # fmt: skip
        g = grammars.grammar_for(forced, tools=tools, tool_format=fmt, special={})
        close = tail.split("\n")[1] if fmt is ToolFormat.QWEN3_CODER else "</arg_value>"
        assert _accepts(ll, smollm_tokenizer, g, head + "a <b>\n{c}" + tail)
        assert not _accepts(ll, smollm_tokenizer, g, head + "thirteen char" + tail)
        assert not _accepts(ll, smollm_tokenizer, g, head + close + tail)
        # What it accepts, the parser reads back as the same text.
        _, calls = parse_complete(fmt, head + "a <b>\n{c}" + tail, tools=tools)
        assert json.loads(calls[0].arguments) == {"text": "a <b>\n{c}"}


def test_tagged_format_markers_are_matched_as_special_tokens() -> None:
    special = {"<tool_call>": 7, "</tool_call>": 8, "<arg_key>": 9, "</arg_key>": 10,
               "<arg_value>": 11, "</arg_value>": 12}  # fmt: skip
    lark = grammars.tool_call_lark(ONE, TOOLS, ToolFormat.GLM45, special)
    assert "<[7]>" in lark and "<[12]>" in lark and '"</arg_value>"' not in lark
    grammars.grammar_for(ONE, tools=TOOLS, tool_format=ToolFormat.GLM45, special=special)


def test_a_special_closing_token_still_keeps_its_text_out_of_the_value(
    ll: LLTokenizer, smollm_tokenizer: Any
) -> None:
    # GLM's </arg_value> is a special token; SmolLM2's <|im_start|> (id 1) stands in for it.
    tools = [
        {
            "type": "function",
            "function": {
                "name": "w",
                "parameters": {
                    "type": "object",
                    "properties": {"t": {"type": "string"}},
                    "required": ["t"],
                },
            },
        }
    ]
    forced = ForcedToolCall(names=("w",), parallel=False)
    g = grammars.grammar_for(
        forced, tools=tools, tool_format=ToolFormat.GLM45, special={"</arg_value>": 1}
    )  # fmt: skip

    def accepts(value: str) -> bool:
        matcher = LLMatcher(ll, g, log_level=0)
        enc = smollm_tokenizer.encode
        head = enc("<tool_call>w\n<arg_key>t</arg_key>\n<arg_value>" + value)
        ok = matcher.consume_tokens([*head, 1, *enc("\n</tool_call>")])
        return bool(ok) and matcher.is_accepting()

    assert accepts("a <b> c")
    assert not accepts("a</arg_value>b")  # the parser would end the value there


def _calls(fmt: ToolFormat, n: int) -> str:
    """``n`` calls in ``fmt``: get_weather, then ``now`` repeated."""
    if fmt is ToolFormat.MISTRAL:
        one = '{"name": "now", "arguments": {}}'
        return "[TOOL_CALLS][" + ", ".join([one] * n) + "]"
    if fmt is ToolFormat.PYTHONIC:
        return "[" + ", ".join(["now()"] * n) + "]"
    if fmt in TWO_CALLS:
        first, second = TWO_CALLS[fmt]
        return first + second * (n - 1)
    first, second, end = TAGGED_CALLS[fmt]
    return first + second * (n - 1) + end


@pytest.mark.parametrize("fmt", [*TWO_CALLS, ToolFormat.MISTRAL, *TAGGED_CALLS])
def test_parallel_forced_calls_are_capped(
    fmt: ToolFormat, ll: LLTokenizer, smollm_tokenizer: Any
) -> None:
    """A forced answer holds at most MAX_PARALLEL_CALLS calls, so a model that repeats calls
    ends there instead of at max_tokens."""
    cap = grammars.MAX_PARALLEL_CALLS
    assert _accepts(ll, smollm_tokenizer, _grammar(BOTH, fmt), _calls(fmt, cap))
    assert not _accepts(ll, smollm_tokenizer, _grammar(BOTH, fmt), _calls(fmt, cap + 1))


def test_parallel_generic_calls_are_capped(ll: LLTokenizer, smollm_tokenizer: Any) -> None:
    g = grammars.generic_tool_grammar(TOOLS, ["now"], parallel=True, required=True)
    one = '{"name": "now", "arguments": {}}'
    cap = grammars.MAX_PARALLEL_CALLS
    for n, ok in ((cap, True), (cap + 1, False)):
        text = '{"tool_calls": [' + ", ".join([one] * n) + "]}"
        assert _accepts(ll, smollm_tokenizer, g, text) is ok

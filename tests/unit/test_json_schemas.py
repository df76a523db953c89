"""Schemas mean what they mean on llama-server (issue 40): an object that lists its properties
is closed unless it says otherwise, integers are bounded (16 digits), and a keyword we cannot
compile is a 400 naming it. Checked on llguidance matchers with the real SmolLM2 tokenizer, for
response formats and for each tool-call format's arguments."""

from __future__ import annotations

import json
from typing import Any

import llguidance.hf
import pytest
from llguidance import LLMatcher, LLTokenizer

from mlxcel.actors import grammars
from mlxcel.actors.json_schemas import INTEGER_BOUND, close_schema
from mlxcel.actors.toolcalls import ToolFormat
from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import ForcedToolCall, JsonSchemaFormat

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
NO_TOOLS: dict[str, Any] = {"tools": None, "tool_format": None, "special": {}}


@pytest.fixture(scope="module")
def ll(smollm_tokenizer: Any) -> LLTokenizer:
    return llguidance.hf.from_tokenizer(smollm_tokenizer, n_vocab=49152, eos_token=2)


def accepts(ll: LLTokenizer, tok: Any, grammar: str, text: str) -> bool:
    matcher = LLMatcher(ll, grammar, log_level=0)
    ok = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
    return bool(ok) and matcher.is_accepting()


def schema_grammar(schema: Any) -> str:
    return grammars.grammar_for(JsonSchemaFormat(schema_json=json.dumps(schema)), **NO_TOOLS)


def test_listed_properties_close_an_object(ll: LLTokenizer, smollm_tokenizer: Any) -> None:
    g = schema_grammar(CITY)
    assert accepts(ll, smollm_tokenizer, g, '{"city": "Oslo"}')
    # What the 135M model wrote when the object was open (issue 40).
    assert not accepts(ll, smollm_tokenizer, g, '{"city": "Oslo", "type": "string"}')


def test_an_object_that_says_so_stays_open(ll: LLTokenizer, smollm_tokenizer: Any) -> None:
    extra = '{"city": "Oslo", "zip": "0150"}'
    open_city = {**CITY, "additionalProperties": True}
    assert accepts(ll, smollm_tokenizer, schema_grammar(open_city), extra)
    typed = {**CITY, "additionalProperties": {"type": "string"}}
    assert accepts(ll, smollm_tokenizer, schema_grammar(typed), extra)
    assert not accepts(ll, smollm_tokenizer, schema_grammar(typed), '{"city": "Oslo", "n": 1}')
    # No properties listed: any object, as llama.cpp's `object` rule.
    assert accepts(ll, smollm_tokenizer, schema_grammar({"type": "object"}), extra)


def test_nested_objects_are_closed(ll: LLTokenizer, smollm_tokenizer: Any) -> None:
    schema = {
        "type": "object",
        "properties": {
            "people": {"type": "array", "items": {"$ref": "#/$defs/person"}},
            "home": {"anyOf": [CITY, {"type": "null"}]},
        },
        "required": ["people", "home"],
        "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string"}}}},
    }
    g = schema_grammar(schema)
    good = '{"people": [{"name": "Ann"}], "home": {"city": "Oslo"}}'
    assert accepts(ll, smollm_tokenizer, g, good)
    for bad in (
        '{"people": [{"name": "Ann", "age": 3}], "home": null}',
        '{"people": [], "home": {"city": "Oslo", "x": 1}}',
        '{"people": [], "home": null, "extra": 1}',
    ):
        assert not accepts(ll, smollm_tokenizer, g, bad), bad


def test_integers_are_bounded(ll: LLTokenizer, smollm_tokenizer: Any) -> None:
    g = schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}})
    assert accepts(ll, smollm_tokenizer, g, '{"n": 9007199254740991}')
    assert accepts(ll, smollm_tokenizer, g, '{"n": -9007199254740991}')
    assert not accepts(ll, smollm_tokenizer, g, '{"n": 9007199254740992}')
    assert not accepts(ll, smollm_tokenizer, g, '{"n": 11111111111111111}')
    # A bound the schema gives is kept.
    g = schema_grammar({"type": "integer", "minimum": 0})
    assert not accepts(ll, smollm_tokenizer, g, "-1")
    assert not accepts(ll, smollm_tokenizer, g, "10000000000000000")


def test_what_closing_leaves_alone() -> None:
    # allOf members each list part of the keys; closing one would forbid the others'.
    parts = {"allOf": [CITY, {"type": "object", "properties": {"zip": {"type": "string"}}}]}
    assert close_schema(parts) == parts
    # A required key the object does not list: closing would refuse every instance.
    loose = {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}
    assert close_schema(loose) == loose
    # The caller's schema is not changed; values that are data, not schemas, are not read.
    data = {**CITY, "default": {"properties": {}}, "enum": [{"city": "Oslo"}]}
    closed = close_schema(data)
    assert closed["additionalProperties"] is False and "additionalProperties" not in data
    assert closed["default"] == {"properties": {}}
    assert close_schema({"type": ["integer", "null"]})["maximum"] == INTEGER_BOUND
    assert "maximum" not in close_schema({"type": ["integer", "number"]})


# A call of tool `w` with `args` as each format spells it (pythonic calls take keywords, so
# there is no arguments object to close).
SPELLED = {
    ToolFormat.HERMES: '<tool_call>\n{{"name": "w", "arguments": {args}}}\n</tool_call>',
    ToolFormat.LLAMA3_JSON: '{{"name": "w", "parameters": {args}}}',
    ToolFormat.MISTRAL: '[TOOL_CALLS][{{"name": "w", "arguments": {args}}}]',
    ToolFormat.GENERIC: '{{"tool_call": {{"name": "w", "arguments": {args}}}}}',
}


@pytest.mark.parametrize("fmt", list(SPELLED))
def test_tool_arguments_are_closed_in_every_format(
    ll: LLTokenizer, smollm_tokenizer: Any, fmt: ToolFormat
) -> None:
    tools: list[Any] = [{"type": "function", "function": {"name": "w", "parameters": CITY}}]
    forced = ForcedToolCall(names=("w",), parallel=False)
    g = grammars.grammar_for(forced, tools=tools, tool_format=fmt, special={})
    assert accepts(ll, smollm_tokenizer, g, SPELLED[fmt].format(args='{"city": "Oslo"}'))
    extra = SPELLED[fmt].format(args='{"city": "Oslo", "type": "string"}')
    assert not accepts(ll, smollm_tokenizer, g, extra)


def test_a_keyword_we_cannot_compile_is_named() -> None:
    for keyword, schema in (
        ("uniqueItems", {"type": "array", "uniqueItems": True}),
        ("not", {"not": {"type": "string"}}),
        ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^a"}}),
    ):
        with pytest.raises(InvalidRequest) as info:
            schema_grammar(schema)
        assert keyword in str(info.value) and info.value.param == "response_format"

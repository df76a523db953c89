"""Constraints -> llguidance grammars (pure text; no mlx, no matcher state).

A ``Constraint`` from a request becomes one llguidance grammar string, which the model runner
turns into a per-sequence matcher. JSON formats use llguidance's JSON-schema compiler, on the
schema as llama.cpp reads it (``json_schemas.close_schema``: objects closed, integers
bounded); a forced tool call becomes a Lark grammar in the template's tool-call wire format (see
``mlxcel.actors.toolcalls``) with each call's arguments constrained by that tool's
``parameters`` schema through ``%json``. A marker that is a single special token in the
tokenizer is matched as that token (``<[id]>``), since the model emits the token, not its
spelling; otherwise it is plain text.

Compiling happens off the compute thread (the tokenizer actor, and the HTTP boundary for early
400s); llguidance validates without a tokenizer, which is cheap.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, assert_never

from llguidance import LLMatcher

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # only in the type stub

from mlxcel.actors import section_grammars
from mlxcel.actors.json_schemas import close_schema
from mlxcel.actors.section_grammars import MAX_PARALLEL_CALLS, MORE_CALLS
from mlxcel.actors.toolcalls.events import ToolFormat
from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import (
    Constraint,
    ForcedToolCall,
    JsonObjectFormat,
    JsonSchemaFormat,
    LarkGrammar,
)

# Compact separators like json.dumps' defaults: what templates show models, and no unbounded
# whitespace runs for a weak model to wander into.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_ANY_OBJECT = {"type": "object"}
_NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}


class GrammarError(InvalidRequest):
    """A schema or grammar llguidance refuses."""


def _check(grammar: str, param: str) -> str:
    error = LLMatcher.validate_grammar(grammar, None)
    if error:
        raise GrammarError(f"Invalid {param}: {error}", param=param)
    return grammar


def schema_grammar(schema_json: str, *, param: str = "response_format") -> str:
    """The grammar for JSON matching ``schema_json``; GrammarError (400) when it is invalid."""
    try:
        schema = json.loads(schema_json)
    except ValueError as error:
        raise GrammarError(
            f"Invalid {param}: the schema is not JSON ({error})", param=param
        ) from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"Invalid {param}: a JSON schema must be an object", param=param)
    try:
        grammar = LLMatcher.grammar_from_json_schema(
            json.dumps(close_schema(schema)), overrides=JSON_OPTIONS
        )
    except ValueError as error:
        raise GrammarError(f"Invalid {param}: {error}", param=param) from None
    return _check(grammar, param)


def gbnf_grammar(text: str, *, param: str = "grammar") -> LarkGrammar:
    """llama.cpp's GBNF (or Lark already) as a checked LarkGrammar; GrammarError names param."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(text)
    except Exception as error:  # the converter raises its own error types for bad GBNF
        raise GrammarError(f"Invalid {param}: {error}", param=param) from None
    _check(LLMatcher.grammar_from_lark(lark), param)
    return LarkGrammar(lark=lark)


def _lit(text: str) -> str:
    return json.dumps(text)


def _marker(text: str, special: Mapping[str, int]) -> str:
    """A format marker: its special token when the tokenizer has one, else its text."""
    token = special.get(text)
    return f"<[{token}]>" if token is not None else _lit(text)


def tool_name(tool: Mapping[str, Any]) -> str:
    """A tool's name, in OpenAI's ``{"function": {...}}`` nesting or flat."""
    fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
    return str(fn.get("name")) if isinstance(fn, Mapping) else ""


def _tool_index(tools: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[tuple[str, Any]]:
    by_name: dict[str, Any] = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters", fn.get("input_schema"))
            by_name[fn["name"]] = params if isinstance(params, Mapping) and params else _NO_ARGS
    missing = [n for n in names if n not in by_name]
    if missing:
        raise InvalidRequest(
            f"tool_choice names an unknown tool: {missing[0]}", param="tool_choice"
        )
    return [(n, by_name[n]) for n in names]


def _json_rule(schema: Mapping[str, Any]) -> str:
    return "%json " + json.dumps({**close_schema(schema), "x-guidance": JSON_OPTIONS})


def _call_object(name: str, params: Any, args_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _calls_schema(calls: list[tuple[str, Any]], args_key: str) -> dict[str, Any]:
    options = [_call_object(n, p, args_key) for n, p in calls]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _pythonic_call(name: str, params: Mapping[str, Any]) -> str:
    """``name(a=<json>, b=<json>)`` over the required parameters in schema order; optional ones
    are left out (the parser reads JSON spellings of true/false/null as Python's)."""
    props = params.get("properties") or {}
    required = [k for k in params.get("required", []) if k in props]
    parts = [f"{_lit(f'{k}=')} {_json_rule(props[k])}" for k in required]
    sep = f" {_lit(', ')} "
    body = sep.join(parts)
    return f"{_lit(name + '(')} {body} {_lit(')')}" if body else _lit(name + "()")


def tool_call_lark(
    forced: ForcedToolCall,
    tools: Sequence[Mapping[str, Any]],
    fmt: ToolFormat,
    special: Mapping[str, int],
    *,
    think: bool = True,
) -> str:
    """The Lark grammar for one call (or, with ``parallel``, one or more) in ``fmt``; ``think``:
    a format that reasons in the output itself (gpt-oss) may do so before the call."""
    calls = _tool_index(tools, forced.names)
    many = forced.parallel

    def marker(text: str) -> str:
        return _marker(text, special)

    match fmt:
        case ToolFormat.HERMES:
            body = _json_rule(_calls_schema(calls, "arguments"))
            one = f'{_marker("<tool_call>", special)} "\\n" call_json "\\n" ' + _marker(
                "</tool_call>", special
            )
            rules = [f"call: {one}", f"call_json: {body}"]
            start = f'call ("\\n" call){MORE_CALLS}' if many else "call"
        case ToolFormat.LLAMA3_JSON:
            rules = [f"call: {_json_rule(_calls_schema(calls, 'parameters'))}"]
            start = f'call ("; " call){MORE_CALLS}' if many else "call"
        case ToolFormat.MISTRAL:
            item = _calls_schema(calls, "arguments")
            array = {"type": "array", "items": item, "minItems": 1}
            array["maxItems"] = MAX_PARALLEL_CALLS if many else 1
            rules = [f"calls: {_json_rule(array)}"]
            start = f"{_marker('[TOOL_CALLS]', special)} calls"
        case ToolFormat.PYTHONIC:
            alts = " | ".join(_pythonic_call(n, p) for n, p in calls)
            rules = [f"call: {alts}"]
            start = f'"[" call (", " call){MORE_CALLS} "]"' if many else '"[" call "]"'
        case ToolFormat.QWEN3_CODER:
            return section_grammars.qwen3_coder(calls, many, marker, JSON_OPTIONS)
        case ToolFormat.GLM45:
            return section_grammars.glm45(calls, many, marker, special, JSON_OPTIONS)
        case ToolFormat.DEEPSEEK_V31:
            return section_grammars.deepseek_v31(calls, many, marker, JSON_OPTIONS)
        case ToolFormat.DEEPSEEK_V3:
            return section_grammars.deepseek_v3(calls, many, marker, JSON_OPTIONS)
        case ToolFormat.KIMI_K2:
            return section_grammars.kimi_k2(calls, many, marker, JSON_OPTIONS)
        case ToolFormat.GPT_OSS:
            return section_grammars.gpt_oss(calls, marker, special, JSON_OPTIONS, think=think)
        case ToolFormat.GENERIC:
            raise AssertionError("the generic format has its own grammar")
        case _:
            assert_never(fmt)
    return "\n".join([f"start: {start}", *rules]) + "\n"


def generic_tool_grammar(
    tools: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    *,
    parallel: bool,
    required: bool,
    response_schema: Mapping[str, Any] | None = None,
) -> str:
    """The generic format's answer (see ``mlxcel.actors.toolcalls.generic``): a call of one of
    ``names`` (a list of calls with ``parallel``), or with ``required`` false a ``response``
    that is a string or matches ``response_schema``."""
    calls = _calls_schema(_tool_index(tools, names), "arguments")
    key, value = (
        (
            "tool_calls",
            {"type": "array", "items": calls, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS},
        )
        if parallel
        else ("tool_call", calls)
    )
    schema: dict[str, Any] = _object({key: value})
    if not required:
        reply = _object({"response": response_schema or {"type": "string"}})
        schema = {"anyOf": [schema, reply]}
    return schema_grammar(json.dumps(schema), param="tools")


def _object(props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def grammar_for(
    constraint: Constraint,
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_format: ToolFormat | None,
    special: Mapping[str, int],
    think: bool = True,
) -> str:
    """The llguidance grammar for a request's constraint; InvalidRequest names the field.
    ``think`` false: the request turned thinking off (a thinking budget of 0)."""
    match constraint:
        case JsonSchemaFormat(schema_json=schema):
            return schema_grammar(schema)
        case JsonObjectFormat():
            return schema_grammar(json.dumps(_ANY_OBJECT))
        case ForcedToolCall():
            if not tools:
                raise InvalidRequest("tool_choice needs tools", param="tool_choice")
            if tool_format is None:
                raise InvalidRequest(
                    "Tool calls are turned off on this server (--tool-format none).",
                    param="tool_choice",
                )
            if tool_format is ToolFormat.GENERIC:
                return generic_tool_grammar(
                    tools, constraint.names, parallel=constraint.parallel, required=True
                )
            lark = tool_call_lark(constraint, tools, tool_format, special, think=think)
            return _check(LLMatcher.grammar_from_lark(lark), "tools")
        case LarkGrammar(lark=lark):
            return _check(LLMatcher.grammar_from_lark(lark), "grammar")
    raise AssertionError(constraint)


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """Single special (added) tokens by their text: the markers a grammar matches as tokens."""
    added = getattr(tokenizer, "get_added_vocab", None)
    return dict(added()) if callable(added) else {}

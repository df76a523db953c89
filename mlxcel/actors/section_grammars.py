"""Forced-call Lark grammars for the formats of ``toolcalls.xml_args``, ``toolcalls.sections``
and ``toolcalls.harmony`` (Qwen3-Coder, GLM-4.5, DeepSeek V3.1, Kimi K2, gpt-oss); ``grammars``
picks one.

The JSON formats constrain a call's arguments with ``%json`` on the tool's schema. The XML
formats write each argument as its own tagged value, so each parameter gets its own rule: a
value the parser reads as text (a string, or untyped) is raw text bounded by the schema's
``maxLength`` that cannot contain the closing tag (the parser ends a value at the first one),
or one of an ``enum``'s strings; any other type is ``%json`` on that parameter's schema, which
the parser then decodes. Properties come in schema order, the required ones mandatory and the
others optional, as the model's template writes them back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from mlxcel.actors.json_schemas import close_schema
from mlxcel.actors.toolcalls import harmony
from mlxcel.actors.toolcalls.xml_args import glm45_value, qwen3_coder_text, qwen3_coder_value

# The most calls one forced answer may hold (parallel calls allowed): without a bound a model
# can write calls until max_tokens (small and random-weight ones do). Documented in
# docs/reference/http-api.md.
MAX_PARALLEL_CALLS = 16
# The grammar's repetition of the calls after the first.
MORE_CALLS = f"{{0,{MAX_PARALLEL_CALLS - 1}}}"
# gpt-oss thinks (its analysis channel) before it calls; a forced call lets it, up to this many
# characters (about 1,000 tokens), then the call must follow. Documented in
# docs/reference/http-api.md.
MAX_ANALYSIS_CHARS = 4000

Marker = Callable[[str], str]  # a format marker as a grammar item (its special token or text)


def _lit(text: str) -> str:
    return json.dumps(text)


def json_rule(schema: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    return "%json " + json.dumps({**close_schema(schema), "x-guidance": dict(options)})


def _type_of(spec: Mapping[str, Any]) -> str | None:
    kind = spec.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind.strip().lower() if isinstance(kind, str) else None


def _raw_text(close: str, special_close: bool, spec: Mapping[str, Any]) -> str:
    """A terminal for raw text up to and including ``close`` (``maxLength`` bounds the text).

    Written as one terminal that contains ``close`` exactly once, at its end: llguidance's
    lexer is greedy, so a separate closing literal after a free-text terminal would be eaten
    by the text. A closing special token cannot occur inside text, so it simply follows."""
    lo = spec.get("minLength", 0)
    hi = spec.get("maxLength")
    lo = lo if isinstance(lo, int) and lo >= 0 else 0
    count = f"{{{lo},{hi}}}" if isinstance(hi, int) and hi >= lo else f"{{{lo},}}"
    # The tag's text may not occur inside the value at all: the parser reads detokenised text,
    # where a special token and its spelling look the same, and ends a value at the first one
    # (Qwen's close is "\n</parameter>": the bare tag counts too).
    tag = _regex(close.strip())
    if special_close:
        return f"/(?s:.){count}/ & ~/(?s:.)*{tag}(?s:.)*/"
    return f"/(?s:.){count}{_regex(close)}/ & ~/(?s:.)*{tag}(?s:.)+/"


def _regex(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/``."""
    return "".join("\\n" if c == "\n" else "\\/" if c == "/" else re.escape(c) for c in text)


class _Rules:
    """Named rules and terminals, numbered so every parameter has its own."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._n = 0

    def add(self, body: str, *, terminal: bool = False) -> str:
        self._n += 1
        name = f"T{self._n}" if terminal else f"r{self._n}"
        self.lines.append(f"{name}: {body}")
        return name


def _props(params: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], bool]]:
    props = params.get("properties")
    if not isinstance(props, Mapping):
        return []
    required = params.get("required")
    need = set(required) if isinstance(required, list) else set()
    return [(k, v if isinstance(v, Mapping) else {}, k in need) for k, v in props.items()]


def _enum_text(spec: Mapping[str, Any], reads: Callable[[str, str | None], object]) -> str | None:
    """Alternatives for a string ``enum``/``const`` written raw, when the parser reads each
    back as that same string; None otherwise."""
    values = spec.get("enum", [spec["const"]] if "const" in spec else None)
    if not isinstance(values, list) or not values:
        return None
    if not all(isinstance(v, str) and reads(v, _type_of(spec)) == v for v in values):
        return None
    return " | ".join(_lit(v) for v in values)


def _value(
    rules: _Rules,
    spec: Mapping[str, Any],
    *,
    as_text: bool,
    close: str,
    close_item: str,
    special_close: bool,
    reads: Callable[[str, str | None], object],
    options: Mapping[str, Any],
) -> str:
    """The items for one value followed by its closing tag."""
    if as_text:
        choices = _enum_text(spec, reads)
        if choices is not None:
            return f"({choices}) {close_item}"
        text = rules.add(_raw_text(close, special_close, spec), terminal=True)
        return f"{text} {close_item}" if special_close else text
    return f"{rules.add(json_rule(spec, options))} {close_item}"


def qwen3_coder(
    calls: list[tuple[str, Any]],
    parallel: bool,
    marker: Marker,
    options: Mapping[str, Any],
) -> str:
    """``<tool_call>\\n<function=NAME>\\n(<parameter=K>\\nV\\n</parameter>\\n)*</function>
    \\n</tool_call>``, as Qwen3-Coder's template writes a call."""
    rules = _Rules()
    alts = []
    for name, params in calls:
        items = [_lit(f"<function={name}>" + "\n")]
        for key, spec, required in _props(params):
            value = _value(
                rules,
                spec,
                as_text=qwen3_coder_text(_type_of(spec)),
                close="\n</parameter>",
                close_item=_lit("\n</parameter>"),
                special_close=False,
                reads=qwen3_coder_value,
                options=options,
            )
            opener = _lit(f"<parameter={key}>\n")
            param = rules.add(f'{opener} {value} "\\n"')
            items.append(param if required else f"{param}?")
        items.append(_lit("</function>"))
        alts.append(rules.add(" ".join(items)))
    one = f'{marker("<tool_call>")} "\\n" ({" | ".join(alts)}) "\\n" {marker("</tool_call>")}'
    return _assemble(rules, one, '"\\n"', parallel)


def glm45(
    calls: list[tuple[str, Any]],
    parallel: bool,
    marker: Marker,
    special: Mapping[str, int],
    options: Mapping[str, Any],
) -> str:
    """``<tool_call>NAME\\n(<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n)*</tool_call>``,
    as GLM-4.5's template writes a call (its tags are special tokens in GLM's vocabulary)."""
    rules = _Rules()
    special_close = "</arg_value>" in special
    alts = []
    for name, params in calls:
        items = [_lit(f"{name}\n")]
        for key, spec, required in _props(params):
            value = _value(
                rules,
                spec,
                as_text=_type_of(spec) == "string" or _enum_text(spec, glm45_value) is not None,
                close="</arg_value>",
                close_item=marker("</arg_value>"),
                special_close=special_close,
                reads=glm45_value,
                options=options,
            )
            head = f'{marker("<arg_key>")} {_lit(key)} {marker("</arg_key>")} "\\n"'
            arg = rules.add(f'{head} {marker("<arg_value>")} {value} "\\n"')
            items.append(arg if required else f"{arg}?")
        alts.append(rules.add(" ".join(items)))
    one = f"{marker('<tool_call>')} ({' | '.join(alts)}) {marker('</tool_call>')}"
    return _assemble(rules, one, '"\\n"', parallel)


def deepseek_v31(
    calls: list[tuple[str, Any]],
    parallel: bool,
    marker: Marker,
    options: Mapping[str, Any],
) -> str:
    """``<｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>)+
    <｜tool▁calls▁end｜>``."""
    rules = _Rules()
    alts = [
        rules.add(f"{_lit(name)} {marker('<｜tool▁sep｜>')} {rules.add(json_rule(p, options))}")
        for name, p in calls
    ]
    call = f"{marker('<｜tool▁call▁begin｜>')} ({' | '.join(alts)}) {marker('<｜tool▁call▁end｜>')}"
    return _section(
        rules, call, parallel, marker("<｜tool▁calls▁begin｜>"), marker("<｜tool▁calls▁end｜>")
    )


def deepseek_v3(
    calls: list[tuple[str, Any]],
    parallel: bool,
    marker: Marker,
    options: Mapping[str, Any],
) -> str:
    """``<｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{json}
    \\n```<｜tool▁call▁end｜>)+<｜tool▁calls▁end｜>``, the calls apart by a newline as the V3-0324
    and R1 templates write them."""
    rules = _Rules()
    sep = marker("<｜tool▁sep｜>")
    fence, close = _lit("\n```json\n"), _lit("\n```")
    alts = [
        rules.add(f"{_lit('function')} {sep} {_lit(name)} {fence} "
                  f"{rules.add(json_rule(p, options))} {close}")
        for name, p in calls
    ]  # fmt: skip
    call = f"{marker('<｜tool▁call▁begin｜>')} ({' | '.join(alts)}) {marker('<｜tool▁call▁end｜>')}"
    return _section(
        rules,
        call,
        parallel,
        marker("<｜tool▁calls▁begin｜>"),
        marker("<｜tool▁calls▁end｜>"),
        between=_lit("\n"),
    )


def kimi_k2(
    calls: list[tuple[str, Any]],
    parallel: bool,
    marker: Marker,
    options: Mapping[str, Any],
) -> str:
    """``<|tool_calls_section_begin|>(<|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{json}<|tool_call_end|>)+<|tool_calls_section_end|>``."""
    rules = _Rules()
    sep = marker("<|tool_call_argument_begin|>")
    alts = [
        rules.add(f"{_lit(f'functions.{name}:')} /[0-9]{{1,4}}/ {sep} "
                  f"{rules.add(json_rule(p, options))}")
        for name, p in calls
    ]  # fmt: skip
    call = f"{marker('<|tool_call_begin|>')} ({' | '.join(alts)}) {marker('<|tool_call_end|>')}"
    return _section(
        rules,
        call,
        parallel,
        marker("<|tool_calls_section_begin|>"),
        marker("<|tool_calls_section_end|>"),
    )


def gpt_oss(
    calls: list[tuple[str, Any]],
    marker: Marker,
    special: Mapping[str, int],
    options: Mapping[str, Any],
    *,
    think: bool = True,
) -> str:
    """An optional ``<|channel|>analysis<|message|>...<|end|><|start|>assistant`` (with
    ``think``: the request did not turn thinking off), then
    ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}<|call|>``.

    One call, parallel or not: harmony writes a call per message and gpt-oss's template renders
    only an assistant turn's first call back into the prompt."""
    rules = _Rules()
    end = harmony.END
    # Bounded where <|end|> is a token of its own (gpt-oss's vocabulary); a bound on text that
    # must also end in <|end|>'s spelling is past what llguidance's lexer can check.
    bound = {"maxLength": MAX_ANALYSIS_CHARS} if end in special else {}
    text = rules.add(_raw_text(end, end in special, bound), terminal=True)
    closed = f"{text} {marker(end)}" if end in special else text
    analysis = (
        f"{marker(harmony.CHANNEL)} {_lit('analysis')} {marker(harmony.MESSAGE)} {closed} "
        f"{marker(harmony.START)} {_lit('assistant')}"
    )
    head = f"{_lit('json')} {marker(harmony.MESSAGE)}"
    alts = [
        rules.add(f"{_lit(f'commentary to=functions.{name} ')} {marker(harmony.CONSTRAIN)} "
                  f"{head} {rules.add(json_rule(p, options))}")
        for name, p in calls
    ]  # fmt: skip
    call = f"{marker(harmony.CHANNEL)} ({' | '.join(alts)}) {marker(harmony.CALL)}"
    start = "start: analysis? call" if think else "start: call"
    return "\n".join([start, f"analysis: {analysis}", f"call: {call}", *rules.lines]) + "\n"


def _section(
    rules: _Rules, call: str, parallel: bool, begin: str, end: str, between: str = ""
) -> str:
    if not parallel:
        body = "call"
    elif between:
        body = f"call ({between} call){MORE_CALLS}"
    else:
        body = f"call{{1,{MAX_PARALLEL_CALLS}}}"
    return "\n".join([f"start: {begin} {body} {end}", f"call: {call}", *rules.lines]) + "\n"


def _assemble(rules: _Rules, one: str, between: str, parallel: bool) -> str:
    start = f"call ({between} call){MORE_CALLS}" if parallel else "call"
    return "\n".join([f"start: {start}", f"call: {one}", *rules.lines]) + "\n"

"""Structured output, forced tool calls and the thinking budget on the wire -> request fields.

Shared by every family that offers them: each converts its own spelling into a ``Constraint``
and a ``thinking_budget`` with these helpers, so validation (400 naming the field, before any
work) is the same everywhere. A JSON schema is compiled by llguidance here, on the request's
task, so a schema it refuses never reaches the scheduler.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from mlxcel.actors.grammars import gbnf_grammar, schema_grammar
from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import (
    Constraint,
    ForcedToolCall,
    JsonObjectFormat,
    JsonSchemaFormat,
)

# llama-server's spellings of the per-request budget, first wins.
BUDGET_FIELDS = (
    "thinking_budget_tokens",
    "reasoning_budget_tokens",
    "thinking_token_budget",
    "thinking_budget",
)


def response_format(value: Any, *, param: str = "response_format") -> Constraint | None:
    """OpenAI chat `response_format`: text (None), json_object, json_schema{name,schema,strict}."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        # llama-server's extension: a `schema` beside json_object constrains to that schema.
        if value.get("schema") is None:
            return JsonObjectFormat()
        return _schema_format(value["schema"], f"{param}.schema", param, strict=False)
    if kind != "json_schema":
        raise InvalidRequest(
            f"{param}.type must be 'text', 'json_object' or 'json_schema'", param=param
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{param}.json_schema must be an object", param=param)
    name, strict, schema = spec.get("name"), spec.get("strict"), spec.get("schema")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest(f"{param}.json_schema.name must be a string", param=param)
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{param}.json_schema.strict must be a boolean", param=param)
    if schema is None:
        schema = {}  # OpenAI's default: any JSON value
    return _schema_format(schema, f"{param}.json_schema.schema", param, strict=bool(strict))


def _schema_format(schema: Any, where: str, param: str, *, strict: bool) -> JsonSchemaFormat:
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} must be an object", param=param)
    schema_json = json.dumps(schema)
    schema_grammar(schema_json, param=param)  # 400 now rather than a failed sequence later
    return JsonSchemaFormat(schema_json=schema_json, strict=strict)


def tool_choice(
    choice: Any, names: Sequence[str], *, parallel: bool | None
) -> tuple[bool, ForcedToolCall | None]:
    """OpenAI `tool_choice` -> (parse calls out of the output, the forced call or None)."""
    if choice is None or choice == "auto":
        return True, None
    if choice == "none":
        return False, None
    if choice == "required":
        return True, ForcedToolCall(names=tuple(names), parallel=parallel is not False)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
    ):
        raise InvalidRequest(
            "tool_choice must be 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if fn["name"] not in names:
        raise InvalidRequest(
            f"tool_choice names a tool that is not in tools: {fn['name']!r}", param="tool_choice"
        )
    # A named choice is one call of that tool (OpenAI's behaviour).
    return True, ForcedToolCall(names=(fn["name"],), parallel=False)


def combine(fmt: Constraint | None, forced: ForcedToolCall | None) -> Constraint | None:
    """One constraint per request: a forced call already fixes the output's shape."""
    if fmt is not None and forced is not None:
        raise InvalidRequest(
            "response_format json_schema/json_object cannot be combined with a forced "
            "tool_choice ('required' or a named function)",
            param="response_format",
        )
    return fmt if fmt is not None else forced


def thinking_budget(values: dict[str, Any], default: int) -> int | None:
    """The first budget spelling present (else the server's --reasoning-budget): -1 unlimited
    (None), 0 no thinking, N at most N reasoning tokens."""
    chosen, field = default, "--reasoning-budget"
    for name in BUDGET_FIELDS:
        v = values.get(name)
        if v is not None:
            chosen, field = v, name
            break
    if isinstance(chosen, bool) or not isinstance(chosen, int) or chosen < -1:
        raise InvalidRequest(
            f"{field} must be an integer: -1 (unlimited), 0 (no thinking) or a token count",
            param=field,
        )
    return None if chosen == -1 else chosen


def chat_constraint(fmt: Constraint | None, json_schema: Any, grammar: Any) -> Constraint | None:
    """Chat's `response_format` beside llama-server's top-level `json_schema` / `grammar`:
    one of them at most."""
    native = native_constraint(json_schema, grammar)
    if native is not None and fmt is not None:
        which = "grammar" if grammar is not None else "json_schema"
        raise InvalidRequest(f"{which} cannot be combined with response_format", param=which)
    return native if native is not None else fmt


def native_constraint(json_schema: Any, grammar: Any) -> Constraint | None:
    """llama-server's native `json_schema` (a schema object) or `grammar` (GBNF or Lark)."""
    if json_schema is not None and grammar is not None:
        raise InvalidRequest("json_schema and grammar cannot be combined", param="grammar")
    if json_schema is not None:
        if not isinstance(json_schema, dict):
            raise InvalidRequest("json_schema must be a JSON schema object", param="json_schema")
        schema_json = json.dumps(json_schema)
        schema_grammar(schema_json, param="json_schema")
        return JsonSchemaFormat(schema_json=schema_json)
    if grammar is None or grammar == "":
        return None
    if not isinstance(grammar, str):
        raise InvalidRequest("grammar must be a string (GBNF)", param="grammar")
    return gbnf_grammar(grammar)

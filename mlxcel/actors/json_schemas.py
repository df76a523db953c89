"""JSON schemas as llama.cpp compiles them, before llguidance sees them.

JSON Schema leaves an object open unless ``additionalProperties`` closes it, and llguidance
follows the letter of that: a tool's ``{"properties": {"city": ...}}`` then lets a small model
go on after ``"city"`` with keys the schema never named (``"type"``, ``"properties"``, ...)
until ``max_tokens``, so a forced call never ends. llama.cpp's grammar generator (and OpenAI's
strict mode, which requires it) treats an object that lists ``properties`` without
``additionalProperties`` as closed, and spells an integer in at most 16 digits:
``close_schema`` does the same to a copy, so a schema means here what it means on
llama-server, and a model cannot run on in a key list or a digit string. An object with no
``properties`` (``{"type": "object"}``) stays any object, as there. (llama.cpp also bounds a
number's fraction to 16 digits; llguidance's compiler has no such setting, so that one is not
bounded here.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# llama.cpp's `integral-part` spells at most 16 digits. llguidance reads bounds as float64, in
# which 10**16 - 1 rounds up to 10**16, so the bound is the largest integer a float64 (and so
# most JSON parsers) holds exactly: 2**53 - 1, also 16 digits.
INTEGER_BOUND = 2**53 - 1

# Keywords whose value is one subschema, or a list or a name -> subschema map of them.
_ONE = (
    "additionalProperties",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _types(schema: Mapping[str, Any]) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def close_schema(schema: Any, *, closable: bool = True) -> Any:
    """A copy of ``schema`` with objects that list ``properties`` closed and integers bounded
    by +-INTEGER_BOUND, where the schema does not say otherwise; anything not a schema as is.

    Left open: an object whose ``required`` names a key it does not list (closing it would
    refuse every instance), and the members of an ``allOf``, each of which lists only part of
    the keys (llguidance intersects them, so closing one would forbid the others' keys)."""
    if isinstance(schema, list):  # `items` as a list (drafts before 2020-12)
        return [close_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out and isinstance(out[key], (Mapping, list)):
            out[key] = close_schema(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_schema(s, closable=key != "allOf") for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: close_schema(s) for name, s in out[key].items()}
    types = _types(out)
    props = out.get("properties")
    required = out.get("required")
    if (
        closable
        and isinstance(props, Mapping)
        and (not types or "object" in types)
        and "additionalProperties" not in out
        and "unevaluatedProperties" not in out
        and not (isinstance(required, list) and any(k not in props for k in required))
    ):
        out["additionalProperties"] = False
    if "integer" in types and "number" not in types:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -INTEGER_BOUND
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = INTEGER_BOUND
    return out

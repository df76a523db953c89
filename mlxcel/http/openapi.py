"""`GET /openapi.json`: an OpenAPI 3.1 document of the HTTP routes, built from the app itself.

Nothing here is written by hand twice. The paths and methods come from the app's URL map; a
route's request body is the wire model its handler validates with (the attrs class that
``codec.structure`` builds, with every field's type from its annotation, and unknown keys
refused as the converter refuses them), or the key set a hand-checked handler enforces, or the
form fields an upload route accepts. ``BODIES`` says which, per endpoint; a test checks that
every route with a body has an entry, so a new route cannot be left out silently.

Why not a library: the maintained generators take pydantic, marshmallow or msgspec models;
ours are attrs classes structured by cattrs, whose field types here are a handful of
primitives, optionals, lists, dicts and nested attrs classes (a few dozen lines below).

The document serves fuzzers (schemathesis: `tests/e2e/test_fuzz.py`, `tools/fuzz_openapi.py`)
and client generators. Fields typed ``Any`` are checked by hand in the handlers (messages,
content parts, tools): ``openapi_shapes.py`` gives the common shapes their checks accept, so
that a fuzzer builds valid requests too; other fields typed ``Any`` are left open.
"""

from __future__ import annotations

import json
import types
import typing
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import attrs
from quart import Blueprint, Quart, Response, current_app

from mlxcel.http import audio, control, conversations, models, ops, streams
from mlxcel.http.anthropic_wire import MessagesBody
from mlxcel.http.audio_wire import SpeechBody
from mlxcel.http.completion import InfillBody, NativeCompletionBody
from mlxcel.http.context import server
from mlxcel.http.embeddings import EmbeddingsBody, NativeEmbeddingsBody, RerankBody
from mlxcel.http.native import DetokenizeBody, TokenizeBody
from mlxcel.http.openai_wire import ChatCompletionBody, CompletionBody
from mlxcel.http.openapi_shapes import FIELD_SCHEMAS, REQUIRED
from mlxcel.http.responses_wire import ResponsesBody

bp = Blueprint("openapi", __name__)


@attrs.frozen
class JsonModel:
    """A JSON body structured into this attrs class (unknown keys are a 400)."""

    model: type


@attrs.frozen
class JsonFields:
    """A JSON object whose keys a handler checks by hand against this set."""

    fields: frozenset[str]
    required: frozenset[str] = frozenset()


@attrs.frozen
class JsonList:
    """A JSON array of objects (llama-server's /lora-adapters)."""


@attrs.frozen
class Form:
    """A multipart/form-data upload: a binary ``file`` part and these text fields."""

    fields: frozenset[str]


Body = JsonModel | JsonFields | JsonList | Form

# Request bodies by endpoint (blueprint.function). Routes absent here take no body.
BODIES: dict[str, Body] = {
    "openai.chat_completions": JsonModel(ChatCompletionBody),
    "openai.chat_input_tokens": JsonModel(ChatCompletionBody),
    "openai.completions": JsonModel(CompletionBody),
    "native.apply_template": JsonModel(ChatCompletionBody),
    "native.tokenize": JsonModel(TokenizeBody),
    "native.detokenize": JsonModel(DetokenizeBody),
    "native_completion.completion": JsonModel(NativeCompletionBody),
    "native_completion.infill": JsonModel(InfillBody),
    "anthropic.messages": JsonModel(MessagesBody),
    "anthropic.count_tokens": JsonModel(MessagesBody),
    "responses.create": JsonModel(ResponsesBody),
    "responses.input_tokens": JsonModel(ResponsesBody),
    "embeddings.openai_embeddings": JsonModel(EmbeddingsBody),
    "embeddings.native_embeddings": JsonModel(NativeEmbeddingsBody),
    "embeddings.rerank": JsonModel(RerankBody),
    "audio.transcriptions": Form(audio.TRANSCRIPTION_FIELDS),
    "audio.translations": Form(audio.TRANSLATION_FIELDS),
    "audio.speech": JsonModel(SpeechBody),
    "conversations.create": JsonFields(conversations.CREATE_FIELDS),
    "conversations.update": JsonFields(conversations.UPDATE_FIELDS),
    "conversations.add_items": JsonFields(conversations.ADD_ITEMS_FIELDS),
    "control.control": JsonFields(control.FIELDS, control.FIELDS),
    "streams.lookup": JsonFields(streams.LOOKUP_FIELDS, streams.LOOKUP_FIELDS),
    "ops.set_lora_adapters": JsonList(),
    "ops.slot_action": JsonFields(ops.SLOT_FIELDS),
    "models.load": JsonFields(models.FIELDS, models.FIELDS),
    "models.unload": JsonFields(models.FIELDS, models.FIELDS),
}
# Routes taking POST whose body is not read: llama-server's disabled web-UI helpers, the
# props write (accepted and ignored, as llama-server without --props), actions named in the
# path.
NO_BODY = frozenset(
    {
        "ops.disabled_feature",
        "ops.set_props",
        "native.cache_reset",
        "responses.cancel",
    }
)
# Routes that need no API key (security.PUBLIC_PATHS): health, the model list, this document.
PUBLIC_ENDPOINTS = frozenset(
    {
        "health.health",
        "health.root",
        "public_health.health",
        "public_health.root",
        "openai.models",
        "openapi.document",
    }
)

_PRIMITIVES: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
}


def _schema(tp: Any, components: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for one annotation, as the codec structures it."""
    if tp is Any:
        return {}
    if tp in _PRIMITIVES:
        return dict(_PRIMITIVES[tp])
    if attrs.has(tp):
        name = tp.__name__
        if name not in components:
            components[name] = {}  # a placeholder first: classes may nest themselves
            components[name] = _object(tp, components)
        return {"$ref": f"#/components/schemas/{name}"}
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return {"anyOf": [_schema(a, components) for a in args]}
    if origin in (list, tuple) and args:
        return {"type": "array", "items": _schema(args[0], components)}
    if origin is dict and len(args) == 2:
        return {"type": "object", "additionalProperties": _schema(args[1], components)}
    if origin is typing.Literal:
        return {"enum": list(args)}
    raise TypeError(f"no JSON Schema for the wire type {tp!r}")


def _object(cls: type, components: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    properties = {}
    required = []
    for field in attrs.fields(cls):
        shape = FIELD_SCHEMAS.get((cls, field.name))
        properties[field.name] = (
            shape if shape is not None else _schema(hints[field.name], components)
        )
        if field.default is attrs.NOTHING or field.name in REQUIRED.get(cls, ()):
            required.append(field.name)
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        # The codec forbids extra keys: an unknown field is a 400 naming it.
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema


def _request_body(body: Body, components: dict[str, Any]) -> dict[str, Any]:
    if isinstance(body, JsonModel):
        schema = _schema(body.model, components)
        return {"required": True, "content": {"application/json": {"schema": schema}}}
    if isinstance(body, JsonFields):
        fields = {
            "type": "object",
            "properties": {name: {} for name in sorted(body.fields)},
            "additionalProperties": False,
        }
        if body.required:
            fields["required"] = sorted(body.required)
        return {"required": True, "content": {"application/json": {"schema": fields}}}
    if isinstance(body, JsonList):
        return {
            "required": True,
            "content": {"application/json": {"schema": {"type": "array", "items": {}}}},
        }
    form = {
        "type": "object",
        "properties": {
            "file": {"type": "string", "contentMediaType": "application/octet-stream"},
            **{name: {"type": "string"} for name in sorted(body.fields)},
        },
        "required": ["file"],
        "additionalProperties": False,
    }
    return {"required": True, "content": {"multipart/form-data": {"schema": form}}}


def _path(rule: str) -> tuple[str, list[dict[str, Any]]]:
    """Werkzeug's ``/slots/<int:slot_id>`` as OpenAPI's ``/slots/{slot_id}`` and its params."""
    parts = []
    params = []
    for segment in rule.split("/"):
        if segment.startswith("<") and segment.endswith(">"):
            converter, _, name = segment[1:-1].rpartition(":")
            kind = "integer" if converter == "int" else "string"
            params.append({"name": name, "in": "path", "required": True, "schema": {"type": kind}})
            segment = "{" + name + "}"
        parts.append(segment)
    return "/".join(parts), params


ERROR = {"description": "An error in the route family's own envelope"}


def build(app: Quart, *, secured: bool) -> dict[str, Any]:
    components: dict[str, Any] = {}
    paths: dict[str, dict[str, Any]] = {}
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: r.rule):
        if rule.websocket or rule.endpoint == "static":
            continue
        path, params = _path(rule.rule)
        name = rule.endpoint
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            operation: dict[str, Any] = {
                "operationId": f"{method.lower()}:{path}",
                "tags": [name.split(".")[0]],
                "responses": {"200": {"description": "Success"}, "4XX": ERROR, "5XX": ERROR},
            }
            if params:
                operation["parameters"] = params
            body = BODIES.get(name)
            if body is not None and method != "GET":
                operation["requestBody"] = _request_body(body, components)
            if secured and name not in PUBLIC_ENDPOINTS:
                operation["security"] = [{"bearer": []}, {"apiKey": []}]
            paths.setdefault(path, {})[method.lower()] = operation
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "mlxcel", "version": _version()},
        "paths": paths,
        "components": {"schemas": components},
    }
    if secured:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-Api-Key"},
        }
    return document


def _version() -> str:
    try:
        return version("mlxcel")
    except PackageNotFoundError:
        return "0"


@bp.get("/openapi.json")
async def document() -> Response:
    # Built on first use: the URL map is complete only once every blueprint is registered.
    cached = current_app.config.get("MLXCEL_OPENAPI")
    if cached is None:
        secured = bool(server().settings.api_keys)
        cached = json.dumps(build(current_app, secured=secured))
        current_app.config["MLXCEL_OPENAPI"] = cached
    return Response(cached, content_type="application/json")

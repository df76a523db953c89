"""/openapi.json: built from the app's routes and the wire models the handlers validate with."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from mlxcel.http import openapi
from mlxcel.http.app import create_app
from mlxcel.http.context import ServerContext
from mlxcel.runtime.settings import Settings


def _app(**settings: Any) -> Any:
    ctx: Any = ServerContext.__new__(ServerContext)
    object.__setattr__(ctx, "settings", Settings(**settings))
    return create_app(ctx)


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return openapi.build(_app(), secured=False)


def _body_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    content = document["paths"][path]["post"]["requestBody"]["content"]
    schema = next(iter(content.values()))["schema"]
    # $refs point into the document's components: validate against a root that carries them.
    return {**schema, "components": document["components"]}


def test_every_route_that_takes_a_body_is_documented() -> None:
    # A new POST route must say what it takes (a wire model, its checked keys, a form) or that
    # it reads no body: nothing is left out of the document silently.
    app = _app()
    endpoints = set()
    for rule in app.url_map.iter_rules():
        endpoints.add(rule.endpoint)
        if rule.websocket or not (rule.methods or set()) & {"POST", "PUT", "PATCH"}:
            continue
        assert rule.endpoint in openapi.BODIES or rule.endpoint in openapi.NO_BODY, rule.rule
    assert set(openapi.BODIES) <= endpoints
    assert openapi.NO_BODY <= endpoints


CLIENT_BODIES = {
    # What the official SDKs and llama.cpp's tools send.
    "/v1/chat/completions": {
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.7,
        "max_tokens": 64,
    },
    "/v1/completions": {"model": "m", "prompt": "Once upon", "max_tokens": 8, "logprobs": 2},
    "/completion": {"prompt": [1, 2, 3], "n_predict": 8, "stream": True, "n_probs": 2},
    "/v1/messages": {
        "model": "claude",
        "max_tokens": 64,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
    },
    "/v1/responses": {"model": "m", "input": "Hi", "store": True, "max_output_tokens": 16},
    "/v1/embeddings": {"model": "m", "input": ["a", "b"], "encoding_format": "base64"},
    "/v1/rerank": {"query": "q", "documents": ["a", "b"], "top_n": 1},
    "/v1/audio/speech": {"model": "tts-1", "input": "Hello", "voice": "alloy", "speed": 1.5},
    "/tokenize": {"content": "Hello", "with_pieces": True},
}


@pytest.mark.parametrize("path", sorted(CLIENT_BODIES))
def test_what_clients_send_is_valid_by_the_document(document: dict[str, Any], path: str) -> None:
    jsonschema.validate(CLIENT_BODIES[path], _body_schema(document, path))


@pytest.mark.parametrize("path", sorted(CLIENT_BODIES))
def test_an_unknown_field_or_a_wrong_type_is_invalid_by_the_document(
    document: dict[str, Any], path: str
) -> None:
    # As the server answers both with a 400 naming the field.
    schema = _body_schema(document, path)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**CLIENT_BODIES[path], "frobnicate": 1}, schema)
    wrong = {**CLIENT_BODIES[path], "model": 5} if path != "/tokenize" else {"content": 5}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, schema)


def test_uploads_are_multipart_with_a_file(document: dict[str, Any]) -> None:
    body = document["paths"]["/v1/audio/transcriptions"]["post"]["requestBody"]
    form = body["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["file"]
    assert {"model", "language", "response_format", "temperature"} <= set(form["properties"])


def test_path_parameters_are_named(document: dict[str, Any]) -> None:
    op = document["paths"]["/v1/responses/{rid}"]["get"]
    assert op["parameters"] == [
        {"name": "rid", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    item = document["paths"]["/v1/conversations/{cid}/items/{item_id}"]["get"]
    assert [p["name"] for p in item["parameters"]] == ["cid", "item_id"]


def test_the_document_is_itself_valid_openapi(document: dict[str, Any]) -> None:
    # Every schema in it is a valid JSON Schema (2020-12, OpenAPI 3.1's dialect).
    for item in document["paths"].values():
        for operation in item.values():
            for content in operation.get("requestBody", {}).get("content", {}).values():
                schema = {**content["schema"], "components": document["components"]}
                jsonschema.Draft202012Validator.check_schema(schema)
    assert document["openapi"] == "3.1.0"
    json.dumps(document)  # serialisable as served


async def test_the_document_needs_no_key_when_everything_else_does() -> None:
    app = _app(api_keys=frozenset({"sk-doc"}))
    client = app.test_client()
    r = await client.get("/openapi.json")
    assert r.status_code == 200
    doc = await r.get_json()
    assert doc["paths"]["/v1/chat/completions"]["post"]["security"]
    assert "security" not in doc["paths"]["/health"]["get"]
    assert "security" not in doc["paths"]["/v1/models"]["get"]
    assert (await client.get("/v1/models")).status_code != 401
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert (await client.get("/v1/cache/stats")).status_code == 401

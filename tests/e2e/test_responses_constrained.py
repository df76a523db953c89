"""Responses fields that need constrained decoding: a forced tool_choice and text.format
json_schema, against a real `mlxcel serve` with the tiny random llama (whose output is noise
unless the grammar holds it). These pass once the model runner honours
``GenerationRequest.constraint`` (ForcedToolCall, JsonSchemaFormat)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import ServerProcess

HERMES_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{# tools: <tool_call> #}<|im_start|>assistant\n"
)
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "name": "get_weather", "parameters": CITY},
    {"type": "function", "name": "get_time", "parameters": CITY},
]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from tests.support.tiny_model import build_tiny_model

    model = build_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-tools", chat_template=HERMES_TEMPLATE
    )
    store = tmp_path_factory.mktemp("store")
    server = ServerProcess(["-m", str(model), "--cache-dir", str(store)])
    sdk = openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    )
    yield sdk
    sdk.close()
    server.stop()


def test_named_tool_choice_forces_that_call(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="default",
        input="What's the weather?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=200,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.name == "get_time" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), CITY)


def test_required_tool_choice_calls_a_tool(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model="default",
        input="Hi",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
    ) as stream:
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.arguments), CITY)


def test_json_schema_text_format_is_obeyed(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="default",
        input="Pick a city.",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        max_output_tokens=200,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY)

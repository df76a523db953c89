"""JSON Schemas for the wire fields typed ``Any``: the shapes their hand-written checks accept.

A handful of fields (chat messages, content parts, tools, prompts) take several shapes that
no single annotation states; the wire modules check them by hand and answer 400 naming the
field. Without a schema, ``/openapi.json`` would leave them open and a fuzzer would almost
never build a valid request, so generation itself would go untested. These schemas describe
the common shapes each check accepts (not every one: the document is a floor, and the
handlers stay the authority). Keyed by (wire class, field name); ``openapi.py`` reads them.
"""

from __future__ import annotations

from typing import Any

from mlxcel.http.anthropic_wire import MessagesBody
from mlxcel.http.completion import InfillBody, NativeCompletionBody
from mlxcel.http.embeddings import EmbeddingsBody, NativeEmbeddingsBody, RerankBody
from mlxcel.http.openai_wire import ChatCompletionBody, CompletionBody
from mlxcel.http.responses_wire import ResponsesBody

TEXT = {"type": "string"}
# A message or prompt must say something: the checks refuse empty and blank text.
SAID = {"type": "string", "pattern": "\\S"}
STRINGS = {"type": "array", "items": TEXT}
TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
STOP = {"anyOf": [TEXT, STRINGS]}
PARAMETERS = {"type": "object", "properties": {"type": {"const": "object"}}}
TOOL_NAME = {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_-]{0,63}$"}

TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": SAID},
    "required": ["type", "text"],
}
CHAT_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        # null: an assistant turn that only called tools.
        "content": {
            "anyOf": [SAID, {"type": "array", "items": TEXT_PART, "minItems": 1}, {"type": "null"}]
        },
        "name": TEXT,
        "tool_call_id": TEXT,
        "tool_calls": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": TEXT,
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "properties": {"name": TOOL_NAME, "arguments": TEXT},
                        "required": ["name", "arguments"],
                    },
                },
                "required": ["id", "type", "function"],
            },
        },
    },
    "required": ["role", "content"],
}
OPENAI_TOOLS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {"name": TOOL_NAME, "description": TEXT, "parameters": PARAMETERS},
                "required": ["name"],
            },
        },
        "required": ["type", "function"],
    },
}
RESPONSE_FORMAT = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"type": {"enum": ["text", "json_object"]}},
            "required": ["type"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "properties": {"name": TOOL_NAME, "schema": PARAMETERS},
                    "required": ["name", "schema"],
                },
            },
            "required": ["type", "json_schema"],
        },
    ]
}
ANTHROPIC_BLOCK = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": SAID},
    "required": ["type", "text"],
}
ANTHROPIC_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"anyOf": [SAID, {"type": "array", "items": ANTHROPIC_BLOCK, "minItems": 1}]},
    },
    "required": ["role", "content"],
}
ANTHROPIC_TOOLS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": TOOL_NAME, "description": TEXT, "input_schema": PARAMETERS},
        "required": ["name", "input_schema"],
    },
}
RESPONSES_INPUT = {
    "anyOf": [
        SAID,
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "role": {"enum": ["system", "developer", "user", "assistant"]},
                    "content": SAID,
                },
                "required": ["role", "content"],
            },
            "minItems": 1,
        },
    ]
}
RESPONSES_TOOLS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "type": {"const": "function"},
            "name": TOOL_NAME,
            "description": TEXT,
            "parameters": PARAMETERS,
        },
        "required": ["type", "name"],
    },
}
PROMPT = {"anyOf": [SAID, STRINGS, TOKENS]}

FIELD_SCHEMAS: dict[tuple[type, str], dict[str, Any]] = {
    (ChatCompletionBody, "messages"): {"type": "array", "items": CHAT_MESSAGE, "minItems": 1},
    (ChatCompletionBody, "tools"): OPENAI_TOOLS,
    (ChatCompletionBody, "stop"): STOP,
    (ChatCompletionBody, "response_format"): RESPONSE_FORMAT,
    (CompletionBody, "prompt"): PROMPT,
    (CompletionBody, "stop"): STOP,
    (NativeCompletionBody, "prompt"): PROMPT,
    (NativeCompletionBody, "stop"): STRINGS,
    (InfillBody, "prompt"): TEXT,
    (MessagesBody, "messages"): {"type": "array", "items": ANTHROPIC_MESSAGE, "minItems": 1},
    (MessagesBody, "system"): {"anyOf": [TEXT, {"type": "array", "items": ANTHROPIC_BLOCK}]},
    (MessagesBody, "tools"): ANTHROPIC_TOOLS,
    (ResponsesBody, "input"): RESPONSES_INPUT,
    (ResponsesBody, "tools"): RESPONSES_TOOLS,
    (EmbeddingsBody, "input"): {"anyOf": [TEXT, STRINGS]},
    (NativeEmbeddingsBody, "content"): {"anyOf": [TEXT, STRINGS]},
    (RerankBody, "query"): SAID,
    (RerankBody, "documents"): STRINGS,
}
# Fields a handler requires although their wire type has a default (aliases: rerank takes
# `documents` or `texts`; the schema names the common one).
REQUIRED: dict[type, tuple[str, ...]] = {
    RerankBody: ("query", "documents"),
    ResponsesBody: ("input",),
}

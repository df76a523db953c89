"""Bad input, on every route a client can send JSON to: never a 5xx, never a 200.

Each refusal is a 400 in the route's own error envelope (OpenAI, Anthropic or llama-server's
native one) that names the field. The last test replays a seeded set of mutations of valid
bodies (values swapped for other JSON types, keys dropped or added), the way a fuzzer found the
TypeErrors these checks now stop at the edge.
"""

from __future__ import annotations

import copy
import json
import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProcess
from tests.support.tiny_reranker import MINILM, build_tiny_reranker

VOCAB = 49152  # SmolLM2's tokenizer, which the tiny model uses


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    reranker = build_tiny_reranker(tmp_path_factory.mktemp("models") / "tiny-reranker")
    process = ServerProcess(
        [
            "-m",
            str(tiny_model_dir),
            "--embedding-model",
            MINILM,
            "--reranker-model",
            str(reranker),
            "--parallel",
            "2",
            "--no-warmup",
        ]
    )
    yield process.base_url
    process.stop()


def family(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path in ("/completion", "/tokenize", "/detokenize", "/apply-template"):
        return "native"
    return "openai"


def refused(base: str, path: str, body: bytes | Any, field: str | None = None) -> str:
    """POST ``body``; assert a 400 in the route's envelope that names ``field``; the message."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(base + path, content=content, headers=JSON, timeout=60)
    assert r.status_code == 400, (path, r.status_code, r.text)
    message = envelope_message(path, r.json())
    if family(path) == "anthropic":
        assert r.json()["error"]["type"] == "invalid_request_error"
    if field is not None:
        assert field in message or r.json()["error"].get("param") == field, (path, r.text)
    return message


def envelope_message(path: str, data: dict[str, Any]) -> str:
    kind = family(path)
    if kind == "anthropic":
        assert data["type"] == "error"
        assert set(data["error"]) == {"type", "message"}
    elif kind == "native":
        assert set(data["error"]) == {"code", "message", "type"}
        assert data["error"]["code"] >= 400
    else:
        assert set(data["error"]) == {"message", "type", "param", "code"}
    message = data["error"]["message"]
    assert isinstance(message, str) and message
    return message


CHAT = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
# json.dumps writes it as the escape "\ud800", as a client's encoder would.
LONE = "a\ud800b"
JSON = {"content-type": "application/json"}

SURROGATES = [
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": LONE}]},
        "messages[0].content",
    ),
    ("/v1/completions", {"model": "default", "max_tokens": 2, "prompt": LONE}, "prompt"),
    ("/v1/responses", {"model": "default", "max_output_tokens": 2, "input": LONE}, "input"),
    ("/v1/messages", {**MESSAGES, "system": LONE}, "system"),
    ("/completion", {"n_predict": 2, "prompt": LONE}, "prompt"),
    ("/tokenize", {"content": LONE}, "content"),
    ("/v1/embeddings", {"input": ["ok", LONE]}, "input[1]"),
    ("/v1/rerank", {"query": "q", "documents": [LONE]}, "documents[0]"),
    ("/v1/audio/speech", {"model": "tts-1", "voice": "alloy", "input": LONE}, "input"),
]


@pytest.mark.parametrize(("path", "body", "field"), SURROGATES, ids=[s[0] for s in SURROGATES])
def test_a_lone_surrogate_is_a_400_naming_the_field(
    server: str, path: str, body: Any, field: str
) -> None:
    message = refused(server, path, body)
    assert "lone surrogate" in message
    # Named in the message too: the native and Anthropic envelopes carry no param.
    assert f"'{field}'" in message, message


def test_a_surrogate_pair_is_a_character(server: str) -> None:
    emoji = b'{"content": "\\ud83d\\ude00"}'
    r = httpx.post(server + "/tokenize", content=emoji, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"]


DEEP_ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/completion",
    "/tokenize",
    "/detokenize",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/audio/speech",
]


@pytest.mark.parametrize("path", DEEP_ROUTES)
@pytest.mark.parametrize("depth", [200, 10_000])
def test_deeply_nested_json_is_a_400(server: str, path: str, depth: int) -> None:
    body = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    assert "nests deeper than" in refused(server, path, body)


def test_nesting_as_deep_as_real_schemas_is_served(server: str) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(20):  # 20 nested objects: 40 JSON levels under response_format
        schema = {"type": "object", "properties": {"a": schema}}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("ids", [[-1], [2**64], [VOCAB], [1, -(2**70)]])
def test_token_ids_outside_the_vocabulary_are_a_400(server: str, ids: list[int]) -> None:
    refused(server, "/completion", {"n_predict": 2, "prompt": ids}, "prompt")
    refused(server, "/detokenize", {"tokens": ids}, "tokens")
    refused(server, "/v1/embeddings", {"input": [ids]}, "input")


@pytest.mark.parametrize("key", ["-1", str(VOCAB), "1" * 30])
def test_logit_bias_keys_must_be_token_ids_in_the_vocabulary(server: str, key: str) -> None:
    refused(server, "/v1/chat/completions", {**CHAT, "logit_bias": {key: 1}}, "logit_bias")
    body = {"model": "default", "max_tokens": 2, "prompt": "hi", "logit_bias": {key: 1}}
    refused(server, "/v1/completions", body, "logit_bias")


def test_llama_cpp_logit_bias_ids_are_never_rounded(server: str) -> None:
    for token in (1.5, True, None, ""):
        body = {"prompt": "hi", "n_predict": 1, "logit_bias": [[token, 1]]}
        refused(server, "/completion", body, "logit_bias")


def test_a_logit_bias_too_large_for_a_float_is_a_400(server: str) -> None:
    refused(server, "/completion", {"prompt": "hi", "logit_bias": [[1, 10**400]]}, "logit_bias")


def test_completion_prompt_nests_one_list_at_most(server: str) -> None:
    # One prompt: a string, ids, or ids mixed with strings (alone or as a list's only item).
    for prompt in (["hi"], [[1, 2]], [1, 2], [1, "x"]):
        r = httpx.post(server + "/completion", json={"n_predict": 1, "prompt": prompt}, timeout=60)
        assert r.status_code == 200 and isinstance(r.json(), dict), (prompt, r.text)
    for prompt in ([[["x"]]], [["x"]], [[[1]]], [[1], {"a": 1}], {"a": 1}):
        refused(server, "/completion", {"n_predict": 1, "prompt": prompt}, "prompt")


def test_tokenize_refuses_unknown_fields(server: str) -> None:
    refused(server, "/tokenize", {"content": "hi", "bogus": 1}, "bogus")
    refused(server, "/detokenize", {"tokens": [1], "bogus": 1}, "bogus")
    refused(server, "/tokenize", {"content": "hi", "with_pieces": "yes"}, "with_pieces")
    # Any model name is served, as in chat (--strict-model-names: test_llama_compat).
    for name in ("nope", "default"):
        r = httpx.post(server + "/tokenize", json={"content": "hi", "model": name}, timeout=30)
        assert r.status_code == 200 and r.json()["tokens"]


def test_small_bodies_refuse_unknown_fields(server: str) -> None:
    # The keys /openapi.json lists for them are the only ones taken.
    body = {"id": "chatcmpl-x", "action": "reasoning_end", "bogus": 1}
    refused(server, "/v1/chat/completions/control", body, "bogus")
    refused(server, "/v1/streams/lookup", {"conversation_ids": ["a"], "bogus": 1}, "bogus")
    refused(server, "/v1/audio/speech", {"input": "hi", "bogus": 1}, "bogus")
    refused(server, "/v1/audio/speech", {"input": 5}, "input")


# What the fuzzer found: wrong JSON types where the code assumed strings or objects.
WRONG_TYPES = [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": [], "content": "hi"}]}, "role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": [0], "content": "hi"}]}, "role"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": {}, "text": "x"}]}]},
        "messages[0].content[0].type",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]},
        "messages[0].content[0].type",
    ),
    (
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "f", "description": []}}],
        },
        "tools[0].function.description",
    ),
    (
        "/v1/responses",
        {"model": "default", "input": [{"role": "user", "content": [{"type": {"a": 1}}]}]},
        "input[0].content[0].type",
    ),
    ("/v1/responses", {"model": "default", "input": [{"type": ["message"]}]}, "input[0].type"),
    (
        "/v1/responses",
        {
            "model": "default",
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "description": 1}],
        },
        "tools[0].description",
    ),
    (
        "/v1/messages",
        {**MESSAGES, "tools": [{"name": "f", "description": [], "input_schema": {}}]},
        "tools[0].description",
    ),
    ("/v1/messages", {**MESSAGES, "messages": [{"role": "user", "content": "hi", "x": 1}]}, "x"),
    ("/apply-template", {"messages": [{"role": {}, "content": "hi"}]}, "role"),
]


@pytest.mark.parametrize(("path", "body", "field"), WRONG_TYPES)
def test_a_wrong_type_is_a_400_naming_the_field(
    server: str, path: str, body: Any, field: str
) -> None:
    refused(server, path, body, field)


def test_a_wav_header_that_claims_2_31_frames_decodes_what_is_there(server: str) -> None:
    rate = 16_000
    pcm = (np.sin(np.arange(rate) * 2 * np.pi * 440 / rate) * 8000).astype("<i2").tobytes()
    claimed = 2**31 * 2  # bytes of 2^31 16-bit frames, wrapped by the 32-bit field
    header = (
        b"RIFF"
        + struct.pack("<I", (36 + claimed) & 0xFFFFFFFF)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", min(claimed, 0xFFFFFFFF))
    )
    r = httpx.post(
        server + "/v1/audio/transcriptions",
        files={"file": ("lying.wav", header + pcm, "audio/wav")},
        data={"model": "whisper-1", "response_format": "verbose_json"},
        timeout=300,
    )
    # FFmpeg reads the samples that are there (one second), never the header's claim.
    assert r.status_code == 200, r.text
    assert r.json()["duration"] == pytest.approx(1.0, abs=0.05)


# --- seeded mutations ---------------------------------------------------------------------------

VALID = {
    "/v1/chat/completions": {
        **CHAT,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
        "stop": ["x"],
        "logit_bias": {"1": 1},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}},
    },
    "/v1/completions": {"model": "default", "max_tokens": 2, "prompt": "hi", "stop": "x"},
    "/v1/responses": {
        "model": "default",
        "max_output_tokens": 16,
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "done"},
        ],
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
        "store": False,
    },
    "/v1/messages": {
        **MESSAGES,
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}],
            },
        ],
        "stop_sequences": ["x"],
    },
    "/completion": {"prompt": [1, 2, 3], "n_predict": 2, "stop": ["x"], "logit_bias": [[1, 0.5]]},
    "/tokenize": {"content": "hello", "with_pieces": True},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/apply-template": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"input": ["hello", [1, 2, 3]]},
    "/v1/rerank": {"query": "q", "documents": ["a", "b"], "top_n": 1},
    "/v1/audio/speech": {
        "model": "tts-1",
        "voice": "alloy",
        "input": "hi",
        "response_format": "pcm",
    },
}
SWAPS: list[Any] = [[], {}, [0], 0, True, None, "x", 2**70, -1, 1.5, [[["x"]]], {"type": []}, LONE]


def mutations(body: Any, rng: random.Random, count: int) -> Iterator[Any]:
    def places(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
        if path:
            yield path
        items = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for key, child in items:
            yield from places(child, (*path, key))

    spots = list(places(body))
    for _ in range(count):
        out = copy.deepcopy(body)
        path = rng.choice(spots)
        parent = out
        for key in path[:-1]:
            parent = parent[key]
        roll = rng.random()
        if roll < 0.1 and isinstance(parent, dict):
            del parent[path[-1]]
        elif roll < 0.2 and isinstance(parent, dict):
            parent["unexpected_field"] = 1
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(SWAPS))
        yield out


@pytest.mark.parametrize("path", sorted(VALID))
def test_mutated_bodies_are_never_a_5xx(server: str, path: str) -> None:
    rng = random.Random(path)
    count = 6 if path == "/v1/audio/speech" else 30  # speech synthesises each accepted one
    with httpx.Client(base_url=server, timeout=120) as client:
        assert client.post(path, json=VALID[path]).status_code == 200
        for body in mutations(VALID[path], rng, count):
            # json.dumps escapes a lone surrogate as a client's encoder does.
            r = client.post(path, content=json.dumps(body), headers=JSON)
            assert r.status_code < 500, (body, r.status_code, r.text)
            if r.status_code >= 400:
                envelope_message(path, r.json())

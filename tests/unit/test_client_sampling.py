"""The client's keyword -> SDK parameter mapping (issue 6 §5), and what reaches the wire."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

import mlxcel
from mlxcel.client._sampling import TOP_LEVEL, build_params

OPENAI_FIELDS = dict(
    max_tokens=8,
    temperature=0.5,
    top_p=0.9,
    stop=["\n"],
    seed=7,
    presence_penalty=0.1,
    frequency_penalty=0.2,
    logit_bias={"1": -100},
    n=1,
    logprobs=2,
    top_logprobs=3,
)
SERVER_KNOBS = dict(
    top_k=40,
    min_p=0.05,
    repetition_penalty=1.1,
    dry_multiplier=0.8,
    dry_base=1.75,
    dry_allowed_length=2,
    xtc_probability=0.5,
    some_future_knob="x",
)


def test_openai_fields_are_named_parameters_for_chat() -> None:
    assert TOP_LEVEL == set(OPENAI_FIELDS)
    params = build_params(
        "chat", {**OPENAI_FIELDS, **SERVER_KNOBS, "response_format": {"type": "text"}}
    )
    assert params.pop("extra_body") == SERVER_KNOBS
    assert params == {**OPENAI_FIELDS, "response_format": {"type": "text"}}


def test_completions_carry_the_fields_the_sdk_lacks_in_extra_body() -> None:
    params = build_params("completion", {**OPENAI_FIELDS, "response_format": {"type": "text"}})
    assert params.pop("extra_body") == {"top_logprobs": 3, "response_format": {"type": "text"}}
    assert params == {k: v for k, v in OPENAI_FIELDS.items() if k != "top_logprobs"}


def test_explicit_extra_body_wins_on_conflict() -> None:
    params = build_params(
        "chat",
        {"temperature": 0.5, "top_k": 40, "extra_body": {"temperature": 0.1, "top_k": 5, "a": 1}},
    )
    assert params == {"extra_body": {"temperature": 0.1, "top_k": 5, "a": 1}}


def test_none_means_not_given_and_request_options_pass_through() -> None:
    params = build_params(
        "completion",
        {
            "temperature": None,
            "top_k": None,
            "timeout": 3.0,
            "extra_headers": {"X-A": "1"},
            "model": "m",
        },
    )
    assert params == {"timeout": 3.0, "extra_headers": {"X-A": "1"}, "model": "m"}


@pytest.mark.parametrize("reserved", ["stream", "prompt", "messages"])
def test_method_owned_fields_are_rejected(reserved: str) -> None:
    with pytest.raises(TypeError, match=reserved):
        build_params("chat", {reserved: True})


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_several_choices_are_refused_not_interleaved(endpoint: str) -> None:
    # A streamed n=2 answer would mix both choices' deltas into one text.
    with pytest.raises(ValueError, match="n=2"):
        build_params(endpoint, {"n": 2})  # type: ignore[arg-type]
    assert build_params(endpoint, {"n": 1}) == {"n": 1}  # type: ignore[arg-type]


class Recorder:
    """A fake server behind httpx.MockTransport that records each request."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path.endswith("/models"):
            return httpx.Response(
                200,
                json={
                    "object": "list",
                    "data": [
                        {"id": "served-id", "object": "model", "created": 0, "owned_by": "mlxcel"}
                    ],
                },
            )
        if path.endswith("/completions") and "chat" not in path:
            return httpx.Response(
                200,
                json={
                    "id": "c",
                    "object": "text_completion",
                    "created": 0,
                    "model": "served-id",
                    "choices": [
                        {"index": 0, "text": "out", "finish_reason": "stop", "logprobs": None}
                    ],
                },
            )
        if path.endswith("/chat/completions"):
            return httpx.Response(
                200,
                json={
                    "id": "c",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "served-id",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "hi"},
                        }
                    ],
                },
            )
        if path == "/api/tokenize":
            return httpx.Response(200, json={"tokens": [1, 2]})
        return httpx.Response(
            404, json={"error": {"message": "no route", "type": "not_found_error"}}
        )

    def body(self, i: int = -1) -> dict[str, Any]:
        return dict(json.loads(self.requests[i].content))


def test_the_wire_body_and_the_lazily_resolved_model() -> None:
    fake = Recorder()
    with mlxcel.LLM(
        base_url="http://example.test/api", transport=httpx.MockTransport(fake), api_key="k"
    ) as llm:
        assert fake.requests == []  # resolved lazily
        assert (
            llm.generate("p", temperature=0.5, top_k=4, extra_body={"temperature": 0.25}) == "out"
        )
        assert [r.url.path for r in fake.requests] == ["/api/v1/models", "/api/v1/completions"]
        assert fake.body() == {
            "model": "served-id",
            "prompt": "p",
            "stream": False,
            "temperature": 0.25,
            "top_k": 4,
        }
        assert llm.chat([{"role": "user", "content": "x"}], max_tokens=3, model="other") == "hi"
        assert fake.body() == {
            "model": "other",
            "messages": [{"role": "user", "content": "x"}],
            "stream": False,
            "max_tokens": 3,
        }
        # Native routes sit at the server root, beside /v1, and carry the key as the SDK does.
        assert llm.tokenize("a b") == [1, 2]
        assert fake.requests[-1].url.path == "/api/tokenize"
        assert fake.requests[-1].headers["authorization"] == "Bearer k"
        assert fake.body() == {"content": "a b", "add_special": False}
        assert len([r for r in fake.requests if r.url.path.endswith("/models")]) == 1


def test_async_client_sends_the_same_body() -> None:
    import asyncio

    fake = Recorder()

    async def main() -> None:
        async with mlxcel.AsyncLLM(
            socket="/nonexistent.sock", transport=httpx.MockTransport(fake)
        ) as llm:
            with pytest.raises(mlxcel.MlxcelError, match="resolve_model"):
                _ = llm.model
            assert await llm.generate("p", top_k=4, seed=1) == "out"
            assert llm.model == "served-id"

    asyncio.run(main())
    assert fake.body() == {
        "model": "served-id",
        "prompt": "p",
        "stream": False,
        "seed": 1,
        "top_k": 4,
    }
    assert fake.requests[-1].url.host == "localhost"

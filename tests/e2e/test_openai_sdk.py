"""The official openai SDK (strict response validation) against `mlxcel serve` on loopback,
serving a tiny random-weight llama with the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess

MESSAGES: list[Any] = [{"role": "user", "content": "Hello!"}]


def test_non_streaming_chat(openai_client: openai.OpenAI) -> None:
    r = openai_client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=12)
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None
    assert r.usage.completion_tokens <= 12
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_chunk_order_with_usage(openai_client: openai.OpenAI) -> None:
    chunks = list(
        openai_client.chat.completions.create(
            model="default",
            messages=MESSAGES,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant"
    assert not first.choices[0].delta.content
    assert first.choices[0].finish_reason is None
    assert middle, "no content chunks"
    for c in middle:
        assert c.choices[0].delta.role is None
        assert c.choices[0].finish_reason is None
        assert c.choices[0].delta.content
    assert finish.choices[0].finish_reason == "length"
    assert finish.choices[0].delta.content is None
    assert usage.choices == []
    assert usage.usage is not None and usage.usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1


def test_stream_ends_with_done(tiny_server: ServerProcess) -> None:
    body = {"messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith(("data: ", ":")) for line in lines)


def test_non_streaming_matches_streaming_under_greedy(openai_client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "default",
        "messages": MESSAGES,
        "max_tokens": 16,
        "temperature": 0,
    }
    whole = openai_client.chat.completions.create(**kw).choices[0].message.content
    pieces = openai_client.chat.completions.create(**kw, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert whole == streamed


def test_async_client_chat(tiny_server: ServerProcess) -> None:
    # Under asyncio, as AsyncOpenAI users run it.
    async def main() -> tuple[str | None, list[str]]:
        client = openai.AsyncOpenAI(
            base_url=f"{tiny_server.base_url}/v1",
            api_key="x",
            max_retries=0,
            _strict_response_validation=True,
        )
        async with client:
            r = await client.chat.completions.create(
                model="default", messages=MESSAGES, max_tokens=5
            )
            stream = await client.chat.completions.create(
                model="default", messages=MESSAGES, max_tokens=5, stream=True
            )
            texts = [
                c.choices[0].delta.content
                async for c in stream
                if c.choices and c.choices[0].delta.content
            ]
        return r.choices[0].message.content, texts

    content, texts = asyncio.run(main())
    assert content
    assert texts


def test_completions_stream_and_non_stream(
    openai_client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    r = openai_client.completions.create(model="default", prompt="Once upon a time", max_tokens=8)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 8
    # The SDK types a legacy completion chunk's finish_reason as non-null, yet OpenAI (and
    # llama-server, vLLM) stream null until the last chunk; strict validation cannot apply here.
    loose = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="x", max_retries=0)
    chunks = list(
        loose.completions.create(
            model="default", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    greedy = openai_client.completions.create(
        model="default", prompt="Once upon a time", max_tokens=8, temperature=0
    )
    assert "".join(c.choices[0].text for c in chunks) == greedy.choices[0].text


def test_models_list_and_model_names(openai_client: openai.OpenAI, tiny_model_dir: Any) -> None:
    models = openai_client.models.list().data
    # The chat model first, then the packaged speech models served beside it.
    assert [m.id for m in models] == [tiny_model_dir.name, "whisper-tiny.en", "en_US-joe-medium"]
    for name in (models[0].id, "default"):
        r = openai_client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
        assert r.model == models[0].id
    # Single-model mode serves whatever name a client sends (llama-server does the same).
    r = openai_client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert r.model == models[0].id


def test_stop_string_is_cut(openai_client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "default",
        "messages": MESSAGES,
        "max_tokens": 24,
        "temperature": 0,
    }
    full = openai_client.chat.completions.create(**kw).choices[0].message.content
    assert full and len(full) > 6
    stop = full[3:6]
    r = openai_client.chat.completions.create(**kw, stop=[stop])
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MESSAGES, "max_tokens": "ten"}, "max_tokens"),
        ({"messages": MESSAGES, "temperature": -1}, "temperature"),
        ({"messages": MESSAGES, "top_p": 1.5}, "top_p"),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        # -1 is llama.cpp's "no limit"; another negative used to mean the same, silently.
        ({"messages": MESSAGES, "max_tokens": -5}, "max_tokens"),
        ({"messages": MESSAGES, "max_completion_tokens": -2}, "max_completion_tokens"),
        # OpenAI's rule: stream options without a stream.
        ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": MESSAGES, "seed": -5}, "seed"),
        ({"messages": MESSAGES, "frobnicate": True}, "frobnicate"),
        ({"messages": MESSAGES, "n": 5}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "   "}]}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_fields_are_400_naming_the_field(
    tiny_server: ServerProcess, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_openai_fields_that_ask_for_nothing_are_accepted(openai_client: Any) -> None:
    """What SDK users and agent frameworks pass along: store=False, text modalities, metadata,
    the default tier and verbosity (they used to be 400 "Unsupported field")."""
    r = openai_client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        store=False,
        modalities=["text"],
        metadata={"run": "ci"},
        service_tier="auto",
        verbosity="medium",
        safety_identifier="user-1",
    )
    assert r.choices[0].message.content is not None and r.usage.completion_tokens > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("store", True),
        ("modalities", ["text", "audio"]),
        ("metadata", {"n": 1}),
        ("service_tier", "flex"),
        ("verbosity", "low"),
    ],
)
def test_openai_fields_that_ask_for_what_we_do_not_do_are_400_naming_them(
    tiny_server: ServerProcess, field: str, value: Any
) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value}
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field


def test_image_part_message_says_image_input_is_not_supported(tiny_server: ServerProcess) -> None:
    content = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    r = httpx.post(
        f"{tiny_server.base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": content}]},
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "image input is not supported"


@pytest.mark.parametrize(
    "raw", [b"{not json", b"[1, 2]", b"", '{"messages": "\xff"}'.encode("latin1")]
)
def test_malformed_json_is_400_in_the_openai_envelope(
    tiny_server: ServerProcess, raw: bytes
) -> None:
    r = httpx.post(
        f"{tiny_server.base_url}/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert set(r.json()["error"]) >= {"message", "type", "code"}


def test_sdk_raises_bad_request_on_bad_input(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model="default", messages=MESSAGES, temperature=-3)
    assert "temperature" in str(info.value)


def test_unknown_route_is_json_404(tiny_server: ServerProcess) -> None:
    r = httpx.get(f"{tiny_server.base_url}/v1/nothing-here")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


def test_long_prompt_beyond_context_is_400(tiny_server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 4}
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert "context" in r.json()["error"]["message"]


def test_health(tiny_server: ServerProcess) -> None:
    r = httpx.get(f"{tiny_server.base_url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert json.loads(httpx.get(f"{tiny_server.base_url}/v1/health").text) == {"status": "ok"}


def test_the_loop_breaker_stops_a_looping_answer(tiny_server: ServerProcess) -> None:
    """vLLM's max_pattern_size / min_count: the tiny model's greedy output falls into a loop,
    which runs to max_tokens unless the loop breaker is asked for."""
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    url = f"{tiny_server.base_url}/v1/completions"
    free = httpx.post(url, json=body).json()["choices"][0]
    assert free["finish_reason"] == "length"
    cut = httpx.post(url, json={**body, "max_pattern_size": 16, "min_count": 4}).json()
    choice = cut["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert choice["finish_reason"] == "stop" and len(tokens) < 300
    # It stopped on the fourth repeat of a pattern of at most 16 tokens, not before.
    size = next(
        n
        for n in range(1, 17)
        if all(tokens[-n:] == tokens[-k * n - n : -k * n or None] for k in range(4))
    )
    assert tokens == free["logprobs"]["tokens"][: len(tokens)] and size <= 16
    # The chat route takes the same fields: a logit bias makes it say one token over and over.
    chat = httpx.post(
        f"{tiny_server.base_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 50,
            "temperature": 0,
            "ignore_eos": True,
            "logit_bias": {"100": 100},
            "max_pattern_size": 1,
            "min_count": 3,
        },
    ).json()
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["usage"]["completion_tokens"] == 3

"""Log-probabilities through the official SDK (strict validation), legacy and native shapes."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess

MESSAGES: list[Any] = [{"role": "user", "content": "Say something"}]


def test_chat_logprobs_have_bytes_and_the_sampled_token(openai_client: openai.OpenAI) -> None:
    r = openai_client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert len(lp.content) == r.usage.completion_tokens  # type: ignore[union-attr]
    raw = b"".join(bytes(e.bytes or []) for e in lp.content)
    assert raw.decode() == r.choices[0].message.content
    for e in lp.content:
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the sampled token is the most likely one, with the same score.
        assert e.top_logprobs[0].bytes == e.bytes
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.logprob <= 0


def test_streamed_logprobs_match_non_streamed(openai_client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "default",
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = openai_client.chat.completions.create(**kw).choices[0].logprobs
    assert whole is not None and whole.content is not None
    streamed = []
    for chunk in openai_client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in whole.content
    ]


def test_logprobs_without_top(openai_client: openai.OpenAI) -> None:
    r = openai_client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=3, logprobs=True
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(e.top_logprobs == [] for e in content)
    plain = openai_client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_logprob_requests_are_400(
    tiny_server: ServerProcess, extra: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        f"{tiny_server.base_url}/v1/chat/completions", json={"messages": MESSAGES, **extra}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_legacy_completion_logprobs(
    openai_client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    r = openai_client.completions.create(
        model="default", prompt="Hello", max_tokens=5, logprobs=2, temperature=0
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset or []) == 5
    assert lp.text_offset == sorted(lp.text_offset or [])
    assert all(len(t) == 2 for t in lp.top_logprobs or [])
    bad = httpx.post(f"{tiny_server.base_url}/v1/completions", json={"prompt": "x", "logprobs": 6})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"


def test_native_n_probs(tiny_server: ServerProcess) -> None:
    body = {"prompt": "Hello", "n_predict": 3, "n_probs": 2, "ignore_eos": True}
    r = httpx.post(f"{tiny_server.base_url}/completion", json=body).json()
    probs = r["completion_probabilities"]
    assert len(probs) == 3
    assert all({"id", "token", "bytes", "logprob", "top_logprobs"} <= set(p) for p in probs)
    assert all(len(p["top_logprobs"]) == 2 for p in probs)

"""Sampling fields through the official SDK: every llama.cpp knob, batched, seeded, validated."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess

MESSAGES: list[Any] = [{"role": "user", "content": "Write a short poem"}]
ALL_KNOBS = {
    "top_k": 20,
    "min_p": 0.02,
    "typical_p": 0.95,
    "top_n_sigma": 2.0,
    "xtc_probability": 0.5,
    "xtc_threshold": 0.1,
    "repetition_penalty": 1.1,
    "repetition_context_size": 32,
    "presence_penalty": 0.2,
    "frequency_penalty": 0.2,
    "dry_multiplier": 0.8,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 64,
    "dry_sequence_breakers": ["\n", "."],
}


def gen(client: openai.OpenAI, **kw: Any) -> str:
    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=12, **kw)
    return r.choices[0].message.content or ""


def test_every_knob_is_accepted_and_aliases_work(openai_client: openai.OpenAI) -> None:
    assert gen(openai_client, temperature=0.9, seed=5, extra_body=ALL_KNOBS)
    aliases = {"repeat_penalty": 1.2, "repeat_last_n": 16, "n_predict": 3}
    r = openai_client.chat.completions.create(
        model="default", messages=MESSAGES, extra_body=aliases
    )
    assert r.usage is not None and r.usage.completion_tokens <= 3


def test_top_k_1_is_greedy_whatever_the_temperature(openai_client: openai.OpenAI) -> None:
    greedy = gen(openai_client, temperature=0)
    assert gen(openai_client, temperature=1.5, extra_body={"top_k": 1}) == greedy


def test_logit_bias_bans_the_greedy_first_token(
    openai_client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    greedy = gen(openai_client, temperature=0)
    first = httpx.post(f"{tiny_server.base_url}/tokenize", json={"content": greedy}).json()[
        "tokens"
    ][0]
    banned = gen(openai_client, temperature=0, logit_bias={str(first): -100})
    assert (
        httpx.post(f"{tiny_server.base_url}/tokenize", json={"content": banned}).json()["tokens"][0]
        != first
    )
    # llama.cpp's list form, with false meaning "never".
    banned2 = gen(openai_client, temperature=0, extra_body={"logit_bias": [[first, False]]})
    assert banned2 == banned


def test_same_seed_same_text_alone_and_in_a_concurrent_batch(openai_client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "temperature": 1.0,
        "seed": 1234,
        "extra_body": {"top_k": 0, "top_p": 1.0, "min_p": 0.0},
    }
    alone = gen(openai_client, **kw)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(gen, openai_client, temperature=1.0) for _ in range(3)]
        batched = pool.submit(gen, openai_client, **kw)
        for f in others:
            f.result()
        assert batched.result() == alone
    assert gen(openai_client, **{**kw, "seed": 4321}) != alone


def test_repetition_penalty_stops_greedy_repeats(tiny_server: ServerProcess) -> None:
    def ids(**extra: Any) -> list[int]:
        body = {
            "prompt": "The",
            "n_predict": 200,
            "temperature": 0,
            "ignore_eos": True,
            "n_probs": 1,
            **extra,
        }
        r = httpx.post(f"{tiny_server.base_url}/completion", json=body, timeout=120).json()
        return [p["id"] for p in r["completion_probabilities"]]

    plain = ids()
    penalised = ids(repeat_penalty=3.0, repeat_last_n=-1)
    assert len(set(plain)) < 0.95 * len(plain), "the test needs a greedy run that repeats itself"
    assert len(set(penalised)) > len(set(plain))
    assert len(set(ids(frequency_penalty=2.0, presence_penalty=2.0, repeat_last_n=-1))) > len(
        set(plain)
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", -1),
        ("min_p", 1.5),
        ("typical_p", 0.0),
        ("top_n_sigma", "x"),
        ("xtc_probability", 2.0),
        ("xtc_threshold", 0.9),
        ("repetition_penalty", 0.0),
        ("repeat_last_n", -2),
        ("dry_multiplier", -1.0),
        ("dry_allowed_length", -1),
        ("dry_penalty_last_n", -5),
        ("dry_sequence_breakers", []),
        ("logit_bias", {"999999999": 1.0}),
        ("logit_bias", {"abc": "high"}),
        ("temperature", -0.5),
        ("top_p", 2.0),
        ("seed", -7),
    ],
)
def test_out_of_range_is_400_naming_the_field(
    tiny_server: ServerProcess, field: str, value: Any
) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/completion"):
        body: dict[str, Any] = {"messages": MESSAGES} if "chat" in path else {"prompt": "x"}
        r = httpx.post(
            f"{tiny_server.base_url}{path}", json={**body, field: value, "max_tokens": 2}
        )
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert field in error["message"] or error.get("param") == field, (path, error)

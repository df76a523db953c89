"""The prompt (prefix) cache, seen from a client: `cached_tokens` in usage, tenants, opt-out,
stats and reset."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from tests.conftest import ServerProcess

PREFIX = " ".join(f"fact{i}" for i in range(150))


def ask(client: openai.OpenAI, question: str, **extra: Any) -> Any:
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": PREFIX}, {"role": "user", "content": question}],
        max_tokens=2,
        extra_body=extra or None,
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage


def test_shared_prefix_is_reused_per_tenant(
    openai_client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    httpx.post(f"{tiny_server.base_url}/v1/cache/reset")
    cold = ask(openai_client, "first question?", prompt_cache_key="tenant-a")
    assert cold.prompt_tokens_details.cached_tokens == 0
    warm = ask(openai_client, "second question?", prompt_cache_key="tenant-a")
    # Everything up to the user turn is shared: at least the long system prompt.
    assert warm.prompt_tokens_details.cached_tokens > 300
    assert warm.prompt_tokens_details.cached_tokens < warm.prompt_tokens
    other = ask(openai_client, "second question?", prompt_cache_key="tenant-b")
    assert other.prompt_tokens_details.cached_tokens == 0, "tenants must not share cache entries"
    opted_out = ask(
        openai_client, "second question?", prompt_cache_key="tenant-a", cache_prompt=False
    )
    assert opted_out.prompt_tokens_details.cached_tokens == 0


def test_user_field_is_the_tenant_when_no_cache_key(openai_client: openai.OpenAI) -> None:
    ask(openai_client, "q1", user="alice")
    assert ask(openai_client, "q2", user="alice").prompt_tokens_details.cached_tokens > 300
    assert ask(openai_client, "q2", user="bob").prompt_tokens_details.cached_tokens == 0


def test_exact_repeat_reuses_all_but_the_last_token(openai_client: openai.OpenAI) -> None:
    first = ask(openai_client, "the same question", prompt_cache_key="rep")
    again = ask(openai_client, "the same question", prompt_cache_key="rep")
    assert again.prompt_tokens_details.cached_tokens == first.prompt_tokens - 1


def test_cached_and_uncached_answers_are_the_same(
    openai_client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    def greedy(**extra: Any) -> str | None:
        r = openai_client.chat.completions.create(
            model="default",
            messages=[{"role": "system", "content": PREFIX}, {"role": "user", "content": "same"}],
            max_tokens=12,
            temperature=0,
            extra_body=extra,
        )
        return r.choices[0].message.content

    uncached = greedy(cache_prompt=False)
    greedy(prompt_cache_key="eq")
    assert greedy(prompt_cache_key="eq") == uncached


def test_stats_and_reset(openai_client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    ask(openai_client, "fill", prompt_cache_key="stats")
    stats = httpx.get(f"{tiny_server.base_url}/v1/cache/stats").json()
    assert stats["enabled"] is True
    assert stats["entries"] >= 1 and stats["bytes"] > 0
    assert stats["hits"] + stats["misses"] >= 1
    assert httpx.post(f"{tiny_server.base_url}/v1/cache/reset").json() == {"success": True}
    assert httpx.get(f"{tiny_server.base_url}/v1/cache/stats").json()["entries"] == 0
    assert (
        ask(openai_client, "fill", prompt_cache_key="stats").prompt_tokens_details.cached_tokens
        == 0
    )


def test_cache_off_means_no_prompt_tokens_details(tiny_model_dir: Any) -> None:
    server = ServerProcess(["-m", str(tiny_model_dir), "--cache-ram", "0", "--no-warmup"])
    try:
        r = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ).json()
        assert "prompt_tokens_details" not in r["usage"]
        assert httpx.get(f"{server.base_url}/v1/cache/stats").json()["enabled"] is False
    finally:
        server.stop()

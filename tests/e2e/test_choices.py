"""n > 1 through the official OpenAI SDK (strict validation) on the tiny model: choices by
index streamed and not, usage over every choice, seeds per choice, the cap, logprobs, and the
prompt read once."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story"}]
# Exactly max_tokens per choice: random weights may say end-of-sequence at any point.
FULL = {"ignore_eos": True}
SEEDED: dict[str, Any] = {"temperature": 1.0, "seed": 2024, "extra_body": FULL}


def test_n2_gives_two_choices_and_usage_counts_both(openai_client: openai.OpenAI) -> None:
    one = openai_client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=5, extra_body=FULL
    )
    r = openai_client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=5, n=2, extra_body=FULL
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason == "length" for c in r.choices)
    assert r.usage is not None and one.usage is not None
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == 2 * 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def test_seeded_choices_are_reproducible_and_differ(openai_client: openai.OpenAI) -> None:
    def texts() -> list[str]:
        r = openai_client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=8, n=3, **SEEDED
        )
        return [c.message.content or "" for c in r.choices]

    first = texts()
    assert texts() == first
    assert len(set(first)) == 3


def test_streamed_choices_accumulate_by_index(openai_client: openai.OpenAI) -> None:
    whole = openai_client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=8, n=2, **SEEDED
    )
    chunks = list(
        openai_client.chat.completions.create(
            model="default",
            messages=MESSAGES,
            max_tokens=8,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            **SEEDED,
        )
    )
    texts = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {0: "length", 1: "length"}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 16


def test_the_sdk_stream_helper_merges_choices(openai_client: openai.OpenAI) -> None:
    # The helper refuses "length" finishes, so a stop string ends each (seeded) choice.
    kw: dict[str, Any] = {"max_tokens": 40, "n": 2, "stop": ["e"], **SEEDED}
    whole = openai_client.chat.completions.create(model="default", messages=MESSAGES, **kw)
    assert [c.finish_reason for c in whole.choices] == ["stop", "stop"]
    with openai_client.chat.completions.stream(model="default", messages=MESSAGES, **kw) as s:
        final = s.get_final_completion()
    assert [c.index for c in final.choices] == [0, 1]
    # A choice that stopped before any text: "" whole, and None streamed (no content delta is
    # sent for it: the first delta's content is null, as llama-server's).
    streamed = [c.message.content or "" for c in final.choices]
    assert streamed == [c.message.content for c in whole.choices]
    assert final.choices[0].message.content != final.choices[1].message.content


def test_legacy_completions_choices(
    openai_client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    r = openai_client.completions.create(
        model="default", prompt="Once upon a time", max_tokens=6, n=2, **SEEDED
    )
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text != r.choices[1].text
    assert r.usage is not None and r.usage.completion_tokens == 12
    # Streamed with httpx: the SDK's legacy Completion type has no null finish_reason, which
    # OpenAI itself sends in every chunk but the last.
    body = {"prompt": "Once upon a time", "max_tokens": 6, "n": 2, "stream": True}
    body |= {"temperature": 1.0, "seed": 2024}
    texts = {0: "", 1: ""}
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/completions", json={**body, **FULL}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                (c,) = json.loads(line[6:])["choices"]
                texts[c["index"]] += c["text"]
    assert texts == {c.index: c.text for c in r.choices}


def test_logprobs_per_choice(openai_client: openai.OpenAI) -> None:
    r = openai_client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=4,
        n=2,
        logprobs=True,
        top_logprobs=2,
        **SEEDED,
    )
    for c in r.choices:
        assert c.logprobs is not None and c.logprobs.content is not None
        assert len(c.logprobs.content) == 4
        raw = b"".join(bytes(e.bytes or []) for e in c.logprobs.content)
        assert raw.decode(errors="replace") == c.message.content
        assert all(len(e.top_logprobs) == 2 for e in c.logprobs.content)


@pytest.mark.parametrize("n", [5, 0, 129])
def test_n_out_of_bounds_is_400_naming_n(openai_client: openai.OpenAI, n: int) -> None:
    # The tiny server runs --parallel 4: every choice is a batch row, so n is capped there.
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model="default", messages=MESSAGES, n=n)
    assert caught.value.param == "n"
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(model="default", prompt="x", n=n)
    assert caught.value.param == "n"


def _counter(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.M)
    assert match, name
    return float(match.group(1))


def test_the_prompt_is_read_once_for_all_choices(tiny_model_dir: Path) -> None:
    server = ServerProcess(["-m", str(tiny_model_dir), "--parallel", "4", "--metrics"])
    try:
        client = openai.OpenAI(
            base_url=f"{server.base_url}/v1",
            api_key="x",
            max_retries=0,
            _strict_response_validation=True,
        )
        long_prompt: list[Any] = [{"role": "user", "content": "many words " * 300}]

        def prefilled() -> float:
            text = httpx.get(f"{server.base_url}/metrics").text
            return _counter(text, "llamacpp:prompt_tokens_total")

        before = prefilled()
        r = client.chat.completions.create(
            model="default",
            messages=long_prompt,
            max_tokens=3,
            n=4,
            extra_body={**FULL, "cache_prompt": False},
        )
        assert r.usage is not None and r.usage.prompt_tokens > 600
        assert prefilled() - before == r.usage.prompt_tokens
        assert r.usage.completion_tokens == 12 and len(r.choices) == 4
        client.close()
    finally:
        server.stop()

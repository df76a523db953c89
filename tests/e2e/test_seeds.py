"""A seeded answer on the embedded default model does not depend on the requests beside it:
the same seed gives the same text alone, three at a time, and with neighbours joining."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import ServerProcess

# Seed and prompt pairs whose text changed with the batch before the top-k candidates were put
# in token-id order (tests/unit/test_sampler_chain.py has the mechanism).
FOOD = (1238, "What is your favourite food?")
DRAGON = (1239, "Tell me about a dragon.")


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    server = ServerProcess(["--parallel", "8"])
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300
    ) as c:
        yield c
    server.stop()


def ask(client: openai.OpenAI, seed: int | None, prompt: str, delay: float = 0.0) -> str:
    time.sleep(delay)
    kw: dict[str, Any] = {} if seed is None else {"seed": seed}
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=1.0,
        **kw,
    )
    return r.choices[0].message.content or ""


def together(client: openai.OpenAI, specs: list[tuple[int | None, str, float]]) -> list[str]:
    out = [""] * len(specs)

    def run(i: int) -> None:
        out[i] = ask(client, *specs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_seed_gives_its_solo_text_whatever_runs_beside_it(client: openai.OpenAI) -> None:
    solo = {seed: ask(client, seed, prompt) for seed, prompt in (FOOD, DRAGON)}
    assert solo[FOOD[0]] != solo[DRAGON[0]]
    # Six at once: three of each seed.
    answers = together(client, [(*FOOD, 0.0), (*DRAGON, 0.0)] * 3)
    assert answers == [solo[FOOD[0]], solo[DRAGON[0]]] * 3
    # Again, with unseeded neighbours and the seeded requests themselves joining mid-way.
    specs: list[tuple[int | None, str, float]] = [
        (*FOOD, 0.0),
        (None, "Write a poem about the sea.", 0.2),
        (*DRAGON, 0.4),
        (*FOOD, 0.6),
        (None, "Describe a city at night.", 0.8),
        (*DRAGON, 1.0),
        (*FOOD, 1.2),
        (*DRAGON, 1.4),
    ]
    answers = together(client, specs)
    for (seed, _, _), text in zip(specs, answers, strict=True):
        if seed is not None:
            assert text == solo[seed], seed

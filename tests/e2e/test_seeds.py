"""A seeded answer on the embedded default model does not depend on the requests beside it:
the same seed gives the same text alone, three at a time, and with neighbours joining."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import KERNEL_PATHS, ServerProcess

# Seed and prompt pairs whose text changed with the batch before the top-k candidates were put
# in token-id order (tests/unit/test_sampler_chain.py has the mechanism).
FOOD = (1238, "What is your favourite food?")
DRAGON = (1239, "Tell me about a dragon.")


@pytest.fixture(scope="module", params=sorted(KERNEL_PATHS))
def client(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    server = ServerProcess(["--parallel", "8"], env=KERNEL_PATHS[request.param])
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300
    ) as c:
        yield c
    server.stop()


def ask(
    client: openai.OpenAI,
    seed: int | None,
    prompt: str,
    delay: float = 0.0,
    *,
    top_k: int | None = None,
) -> str:
    time.sleep(delay)  # a client arriving later, not synchronisation
    kw: dict[str, Any] = {} if seed is None else {"seed": seed}
    if top_k is not None:
        kw["extra_body"] = {"top_k": top_k}
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=1.0,
        **kw,
    )
    return r.choices[0].message.content or ""


def together(
    client: openai.OpenAI,
    specs: list[tuple[int | None, str, float]],
    top_k: int | None = None,
) -> list[str]:
    out = [""] * len(specs)

    def run(i: int) -> None:
        out[i] = ask(client, *specs[i], top_k=top_k)

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


PROMPTS = (
    "What is your favourite food?",
    "Tell me about a dragon.",
    "Why is the sky blue?",
    "Name three rivers.",
)


def fingerprint(client: openai.OpenAI) -> str | None:
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    return r.system_fingerprint


def test_batch_invariant_mode_gives_the_solo_text_over_the_whole_vocabulary(
    client: openai.OpenAI,
) -> None:
    """--batch-invariant: with nothing cut from the distribution (top_k 0), where a near-tie in
    the far tail follows the last bits of the logits, each seeded answer is still its solo
    answer, with neighbours joining mid-way and the same prompt already in the prompt cache."""
    server = ServerProcess(["--parallel", "8", "--batch-invariant"])
    try:
        with openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300
        ) as invariant:
            seeds = [(1300 + i, PROMPTS[i % len(PROMPTS)]) for i in range(6)]
            solo = {seed: ask(invariant, seed, prompt, top_k=0) for seed, prompt in seeds}
            assert len(set(solo.values())) > 1
            specs: list[tuple[int | None, str, float]] = []
            for i, (seed, prompt) in enumerate(seeds):
                specs.append((seed, prompt, 0.3 * i))
                specs.append((None, PROMPTS[(i + 1) % len(PROMPTS)], 0.3 * i + 0.15))
            answers = together(invariant, specs, top_k=0)
            for (seed, _, _), text in zip(specs, answers, strict=True):
                if seed is not None:
                    assert text == solo[seed], seed
            # system_fingerprint names the configuration: stable, and not the default mode's.
            mode = fingerprint(invariant)
            assert mode is not None and mode.startswith("fp_") and mode == fingerprint(invariant)
            assert fingerprint(client) not in (None, mode)
    finally:
        server.stop()

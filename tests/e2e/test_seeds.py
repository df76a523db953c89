"""A seeded answer on the embedded default model does not depend on the requests beside it:
the same seed gives the same text alone, three at a time, and with neighbours joining; nor on
where its prompt's KV came from: read fresh, from the prompt cache after another request
shared its prefix (a grammar-constrained one, as in issue 40), beside neighbours in one batch,
or from the cached first turn of a conversation."""

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


# -- where the prompt's KV came from (issue 40) --------------------------------------

DRAGON_SEED, DRAGON_TEXT = DRAGON
# Before prompt passes took int8 at every row count, this seed's answer after the grammar
# request below (its 11-token suffix computed in float32, the fresh read in int8) parted from
# the fresh answer at its 15th token.
PERSON = {
    "type": "json_schema",
    "json_schema": {
        "name": "person",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
    },
}


def ask_chat(
    client: openai.OpenAI,
    messages: list[Any],
    *,
    tenant: str | None = None,
    fresh: bool = False,
    seed: int = DRAGON_SEED,
) -> tuple[str, int]:
    """The seeded answer at temperature 1, and how many prompt tokens the cache served.
    ``fresh``: the prompt is read whole (``cache_prompt: false``), the reference."""
    extra: dict[str, Any] = {"cache_prompt": False} if fresh else {}
    if tenant is not None:
        extra["prompt_cache_key"] = tenant
    r = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=24,
        temperature=1.0,
        seed=seed,
        extra_body=extra,
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens_details.cached_tokens or 0


def grammar_request(client: openai.OpenAI, tenant: str) -> None:
    """A grammar-constrained request: its prompt shares the chat template's system prefix."""
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Give me a person as JSON."}],
        max_tokens=32,
        temperature=1.0,
        response_format=PERSON,  # type: ignore[arg-type]
        extra_body={"prompt_cache_key": tenant},
    )
    assert r.choices[0].message.content


def three_chats_at_once(client: openai.OpenAI, tenant: str) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = [("", 0)] * 3

    def run(i: int) -> None:
        out[i] = ask_chat(client, [{"role": "user", "content": DRAGON_TEXT}], tenant=tenant)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_seeded_request_after_a_grammar_request_gives_its_fresh_text(
    client: openai.OpenAI,
) -> None:
    """Issue 40: the same seeded request three times in one batch right after a grammar
    request, and once alone after one, each gives the text the prompt read fresh gives. Each
    case has a tenant of its own, so that only the grammar request's entry is in its cache."""
    question = [{"role": "user", "content": DRAGON_TEXT}]
    fresh, cached = ask_chat(client, question, fresh=True)
    assert fresh and cached == 0
    grammar_request(client, "batch")
    together = three_chats_at_once(client, "batch")
    assert [text for text, _ in together] == [fresh] * 3
    # At least one of them started from the grammar request's prefix (the system prompt).
    assert max(n for _, n in together) > 0
    grammar_request(client, "alone")
    alone, cached = ask_chat(client, question, tenant="alone")
    assert cached > 0, "the system prompt should come from the grammar request's entry"
    assert alone == fresh


def test_a_seeded_follow_up_turn_gives_its_fresh_text_from_the_cached_first_turn(
    client: openai.OpenAI,
) -> None:
    """The second turn of a conversation starts with the first turn's prompt and answer, both
    in the prompt cache: the seeded second answer is the one a fresh read gives."""
    first, _ = ask_chat(client, [{"role": "user", "content": DRAGON_TEXT}], tenant="talk")
    follow = [
        {"role": "user", "content": DRAGON_TEXT},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And a second one?"},
    ]
    fresh, _ = ask_chat(client, follow, fresh=True, seed=DRAGON_SEED + 1)
    again, cached = ask_chat(client, follow, tenant="talk", seed=DRAGON_SEED + 1)
    assert cached > 0, "the first turn's prompt should come from the cache"
    assert again == fresh

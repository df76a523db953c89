"""N-gram speculation on the embedded default model, through the server: on by default, it
proposes and has proposals accepted on a copying task, and every answer (chat, /completion
with log-probabilities, choices, stop strings, streams) is what a server without it gives;
a stream cancelled mid-way leaves nothing running."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import KERNEL_PATHS, ServerProcess
from tests.support.metrics import sample, wait_for

PASSAGE = (
    "The harbour master walked the length of the pier with a lantern, counting the boats and "
    "checking the knots, as his father had done before him. When the sun rose over the "
    "hills, the market opened in the square, and farmers brought apples, cabbages and wheels "
    "of yellow cheese."
)
COPY = f"Repeat this text exactly, word for word:\n\n{PASSAGE}"


@pytest.fixture(scope="module", params=sorted(KERNEL_PATHS))
def servers(request: pytest.FixtureRequest) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    env = KERNEL_PATHS[request.param]
    on = ServerProcess(["--parallel", "4", "--metrics"], env=env)
    try:
        off = ServerProcess(["--parallel", "4", "--no-spec-ngram"], env=env)
    except BaseException:
        on.stop()
        raise
    yield on, off
    on.stop()
    off.stop()


def _chat(base: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_props_and_slots_say_ngram(servers: tuple[ServerProcess, ServerProcess]) -> None:
    on, off = servers
    props = httpx.get(f"{on.base_url}/props").json()
    assert props["speculative"] == {"model": None, "kind": "ngram", "n_max": 16}
    assert httpx.get(f"{off.base_url}/props").json()["speculative"]["n_max"] == 0
    assert all(s["speculative"] for s in httpx.get(f"{on.base_url}/slots").json())
    assert not any(s["speculative"] for s in httpx.get(f"{off.base_url}/slots").json())


def test_a_copy_is_drafted_and_the_text_is_unchanged(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    on, off = servers
    before = sample(on.base_url, "mlxcel_spec_accepted_tokens_total", proposer="ngram") or 0.0
    messages = [{"role": "user", "content": COPY}]
    prompt = httpx.post(f"{on.base_url}/apply-template", json={"messages": messages}).json()
    body = {"prompt": prompt["prompt"], "n_predict": 80, "temperature": 0}
    a = httpx.post(f"{on.base_url}/completion", json=body, timeout=300).json()
    b = httpx.post(f"{off.base_url}/completion", json=body, timeout=300).json()
    assert a["content"] == b["content"]
    assert PASSAGE[:60] in a["content"]
    timings = a["timings"]
    assert timings["draft_n"] >= timings["draft_n_accepted"] > 20
    assert "draft_n" not in b["timings"]
    after = wait_for(
        on.base_url,
        "mlxcel_spec_accepted_tokens_total",
        lambda v: v >= before + timings["draft_n_accepted"],
        proposer="ngram",
    )
    assert after >= before + timings["draft_n_accepted"]


def test_logprobs_choices_and_stop_strings_are_unchanged(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    on, off = servers
    ask = {
        "messages": [{"role": "user", "content": COPY}],
        "max_tokens": 60,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "n": 2,
        "stop": ["cabbages"],
    }
    a, b = _chat(on.base_url, **ask), _chat(off.base_url, **ask)
    for ca, cb in zip(a["choices"], b["choices"], strict=True):
        assert ca["message"]["content"] == cb["message"]["content"]
        assert ca["finish_reason"] == cb["finish_reason"] == "stop"
        assert "cabbages" not in ca["message"]["content"]
        la, lb = ca["logprobs"]["content"], cb["logprobs"]["content"]
        assert [t["token"] for t in la] == [t["token"] for t in lb]
        # The verifying pass reads a row's tokens as several rows of one sequence, whose
        # attention sums in other orders; int8 activations (mlxcel.native) round the next
        # layer's input from those sums, so a last-bit difference can flip a rounding, and
        # 30 layers carry it on: measured up to 0.054 here, not only in the last bits.
        for ta, tb in zip(la, lb, strict=True):
            assert ta["logprob"] == pytest.approx(tb["logprob"], abs=0.1)
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]


def test_a_stream_is_the_same_text(servers: tuple[ServerProcess, ServerProcess]) -> None:
    texts = []
    for server in servers:
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as c:
            stream = c.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": COPY}],
                max_tokens=70,
                temperature=0,
                stream=True,
            )
            texts.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
    assert texts[0] == texts[1] and PASSAGE[:40] in texts[0]


def test_a_cancelled_stream_leaves_nothing_running(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    on, _ = servers
    aborts = sample(on.base_url, "mlxcel_aborts_total") or 0.0
    body = {
        "messages": [{"role": "user", "content": COPY}],
        # Long enough to be running when the client leaves, however fast the copy goes.
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{on.base_url}/v1/chat/completions", json=body, timeout=300) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 8:
                break  # the client goes away mid-answer
    wait_for(on.base_url, "mlxcel_aborts_total", lambda v: v >= aborts + 1)
    # The /metrics request reading the gauge is the one left in flight.
    wait_for(on.base_url, "mlxcel_http_requests_in_flight", lambda v: v == 1)
    assert not any(s["is_processing"] for s in httpx.get(f"{on.base_url}/slots").json())


def test_a_draft_model_proposes_and_changes_no_text(
    servers: tuple[ServerProcess, ServerProcess], tiny_model_dir: Path
) -> None:
    """The tiny random llama (SmolLM2's tokenizer) drafting for SmolLM2: its guesses are
    nearly always wrong, which exercises rejection; the text is the plain server's."""
    _, off = servers
    draft = ServerProcess(
        ["--parallel", "2", "--metrics", "--model-draft", str(tiny_model_dir), "--draft-p-min", "0"]
    )
    try:
        props = httpx.get(f"{draft.base_url}/props").json()
        assert props["speculative"] == {"model": str(tiny_model_dir), "kind": "draft", "n_max": 16}
        ask = {"messages": [{"role": "user", "content": COPY}], "max_tokens": 40, "temperature": 0}
        a, b = _chat(draft.base_url, **ask), _chat(off.base_url, **ask)
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        proposed = wait_for(
            draft.base_url, "mlxcel_spec_proposed_tokens_total", lambda v: v > 0, proposer="draft"
        )
        accepted = sample(draft.base_url, "mlxcel_spec_accepted_tokens_total", proposer="draft")
        assert accepted is not None and accepted < proposed
    finally:
        draft.stop()

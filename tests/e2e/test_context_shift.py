"""`--context-shift` against the embedded default model with `-c 128 -n -1`: a sequence that
fills its context drops old tokens and goes on; without the flag it stops at the context's end
(llama-server's default)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess

CTX = 128
# ~100 tokens: the context is full after a few dozen generated ones.
PROMPT = " ".join(f"item {i}," for i in range(21))
LONG_PROMPT = " ".join(f"line {i} of a long text," for i in range(60))


@pytest.fixture(scope="module")
def shifting() -> Iterator[ServerProcess]:
    server = ServerProcess(["-np", "1", "-c", str(CTX), "-n", "-1", "--context-shift"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain() -> Iterator[ServerProcess]:
    server = ServerProcess(["-np", "1", "-c", str(CTX), "-n", "-1"])
    yield server
    server.stop()


def complete(server: ServerProcess, **fields: Any) -> httpx.Response:
    body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{server.base_url}/completion", json=body, timeout=300)


def test_a_full_context_shifts_and_generation_goes_on(shifting: ServerProcess) -> None:
    r = complete(shifting, n_predict=48)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens_evaluated"] == out["timings"]["prompt_n"] < CTX - 16  # not cut
    assert out["tokens_evaluated"] + out["tokens_predicted"] > CTX
    assert out["tokens_predicted"] == 48 and out["timings"]["predicted_n"] == 48
    assert out["stop_type"] == "limit"
    assert out["truncated"] is True


def test_without_the_flag_generation_stops_at_the_context_end(plain: ServerProcess) -> None:
    r = complete(plain, n_predict=48)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens_evaluated"] + out["tokens_predicted"] == CTX
    assert out["stop_type"] == "limit"


def test_chat_goes_on_past_the_context_with_n_keep(shifting: ServerProcess) -> None:
    body = {
        "messages": [{"role": "user", "content": PROMPT[: len(PROMPT) // 2]}],
        "max_tokens": 60,
        "temperature": 0,
        "ignore_eos": True,
        # The whole prompt stays; each shift drops the 16 oldest generated tokens.
        "n_keep": -1,
        "n_discard": 16,
    }
    r = httpx.post(f"{shifting.base_url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 60
    assert usage["prompt_tokens"] + usage["completion_tokens"] > CTX


def test_the_shift_fields_show_in_generation_settings(shifting: ServerProcess) -> None:
    out = complete(shifting, n_predict=1, n_keep=5, n_discard=7).json()
    assert out["generation_settings"]["n_keep"] == 5
    assert out["generation_settings"]["n_discard"] == 7
    props = httpx.get(f"{shifting.base_url}/props").json()
    assert props["default_generation_settings"]["params"]["n_keep"] == 0


def test_a_prompt_longer_than_the_context_is_cut_to_fit(shifting: ServerProcess) -> None:
    r = complete(shifting, prompt=LONG_PROMPT, n_predict=4)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens_evaluated"] < CTX and out["truncated"] is True
    assert out["tokens_predicted"] == 4


def test_without_the_flag_a_long_prompt_is_refused(plain: ServerProcess) -> None:
    r = complete(plain, prompt=LONG_PROMPT, n_predict=4)
    assert r.status_code == 400
    assert "exceeds the available context size" in r.json()["error"]["message"]


@pytest.mark.parametrize(("field", "value"), [("n_keep", -2), ("n_discard", -1)])
def test_bad_shift_fields_are_400(shifting: ServerProcess, field: str, value: int) -> None:
    r = complete(shifting, n_predict=1, **{field: value})
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def tiny_shifting(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    # The tiny random model decodes ~20x faster: long structured output stays quick.
    args = ["-m", str(tiny_model_dir), "-np", "1", "-c", str(CTX), "--context-shift"]
    server = ServerProcess(args)
    yield server
    server.stop()


def test_a_grammar_holds_across_shifts(tiny_shifting: ServerProcess) -> None:
    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 120,
        "maxItems": 125,
    }
    r = complete(tiny_shifting, prompt="JSON:", n_predict=600, json_schema=schema, ignore_eos=False)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens_evaluated"] + out["tokens_predicted"] > 2 * CTX  # shifted more than once
    assert out["truncated"] is True and out["stop_type"] == "eos"
    assert 120 <= len(json.loads(out["content"])) <= 125

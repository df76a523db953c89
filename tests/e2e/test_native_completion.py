"""llama-server's native /completion request fields beyond the basics (docs/reference/http-api.md):
the response echoes the settings this completion ran with, the field aliases, n_predict 0,
response_fields, timings_per_token, and a 400 naming each field asking for what we do not do."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess

# The final object's keys, in the order llama-server writes them.
FINAL_KEYS = [
    "index",
    "content",
    "tokens",
    "id_slot",
    "stop",
    "model",
    "tokens_predicted",
    "tokens_evaluated",
    "generation_settings",
    "prompt",
    "has_new_line",
    "truncated",
    "stop_type",
    "stopping_word",
    "tokens_cached",
    "timings",
]


def complete(server: ServerProcess, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completion", json={"prompt": "Once upon", **body})


def stream(server: ServerProcess, **body: Any) -> list[dict[str, Any]]:
    body = {"prompt": "Once upon", "stream": True, **body}
    with httpx.stream("POST", f"{server.base_url}/completion", json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_generation_settings_are_the_ones_this_completion_ran_with(
    tiny_server: ServerProcess,
) -> None:
    body = complete(
        tiny_server,
        n_predict=3,
        temperature=0.25,
        top_k=5,
        seed=7,
        stop=["zzqx"],
        ignore_eos=True,
        n_probs=2,
        cache_prompt=False,
    ).json()
    assert list(body)[: len(FINAL_KEYS)] == FINAL_KEYS
    assert body["prompt"] == "Once upon"
    settings = body["generation_settings"]
    assert settings["n_predict"] == 3 and body["tokens_predicted"] == 3
    assert settings["temperature"] == 0.25 and settings["top_k"] == 5 and settings["seed"] == 7
    assert settings["stop"] == ["zzqx"] and settings["ignore_eos"] is True
    assert settings["n_probs"] == 2 and settings["cache_prompt"] is False
    assert settings["stream"] is False
    # The server's defaults are unchanged by it.
    props = httpx.get(f"{tiny_server.base_url}/props").json()
    defaults = props["default_generation_settings"]["params"]
    assert defaults["temperature"] == 0.8 and defaults["n_predict"] == -1
    assert defaults["stop"] == [] and defaults["ignore_eos"] is False

    final = stream(tiny_server, n_predict=2, ignore_eos=True, top_p=0.5)[-1]
    assert final["stop"] is True
    assert final["generation_settings"]["stream"] is True
    assert final["generation_settings"]["top_p"] == 0.5


def test_aliases_of_n_predict_and_n_probs(tiny_server: ServerProcess) -> None:
    body = complete(tiny_server, max_completion_tokens=3, ignore_eos=True).json()
    assert body["tokens_predicted"] == 3 and body["stop_type"] == "limit"
    # n_predict comes first, as in llama-server.
    body = complete(tiny_server, n_predict=2, max_tokens=5, ignore_eos=True).json()
    assert body["tokens_predicted"] == 2
    body = complete(tiny_server, n_predict=2, logprobs=3, ignore_eos=True).json()
    probs = body["completion_probabilities"]
    assert len(probs) == 2 and all(len(p["top_logprobs"]) == 3 for p in probs)


def test_n_predict_zero_reads_the_prompt_and_emits_one_token(tiny_server: ServerProcess) -> None:
    r = complete(tiny_server, n_predict=0, ignore_eos=True)
    assert r.status_code == 200
    body = r.json()
    assert body["tokens_predicted"] == 1 and body["tokens_evaluated"] > 0
    assert body["generation_settings"]["n_predict"] == 0
    r = complete(tiny_server, n_predict=-2)
    assert r.status_code == 400 and "n_predict" in r.json()["error"]["message"]


def test_response_fields_project_the_final_object(tiny_server: ServerProcess) -> None:
    fields = ["content", "generation_settings/n_predict", "timings/predicted_n", "no/such"]
    body = complete(tiny_server, n_predict=4, ignore_eos=True, response_fields=fields).json()
    assert set(body) == {"content", "generation_settings/n_predict", "timings/predicted_n"}
    assert body["generation_settings/n_predict"] == 4 and body["timings/predicted_n"] == 4
    assert isinstance(body["content"], str) and body["content"]
    # Streamed: the token frames are whole, the final object is projected.
    frames = stream(tiny_server, n_predict=3, ignore_eos=True, response_fields=["stop_type"])
    assert all(f["stop"] is False for f in frames[:-1]) and len(frames) > 1
    assert frames[-1] == {"stop_type": "limit"}
    r = complete(tiny_server, n_predict=1, response_fields="content")
    assert r.status_code == 400 and "response_fields" in r.json()["error"]["message"]


def test_timings_per_token_puts_the_timings_so_far_in_every_frame(
    tiny_server: ServerProcess,
) -> None:
    frames = stream(tiny_server, n_predict=5, ignore_eos=True, timings_per_token=True)
    tokens = frames[:-1]
    assert len(tokens) == 5
    counts = [f["timings"]["predicted_n"] for f in tokens]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(f["timings"]["prompt_n"] > 0 for f in tokens)
    plain = stream(tiny_server, n_predict=3, ignore_eos=True)
    assert all("timings" not in f for f in plain[:-1]) and "timings" in plain[-1]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_indent", 4),
        ("n", 2),
        ("n_cmpl", 3),
        ("t_max_predict_ms", 500),
        ("return_tokens", "yes"),
        ("return_progress", 1),
        ("verbose", True),
        ("response_format", {"type": "json_object"}),
        ("stream_options", {"include_usage": "yes"}),
        ("sse_ping_interval", -1),
        ("logprobs", 21),
    ],
)
def test_a_field_asking_for_what_this_route_does_not_do_is_a_400_naming_it(
    tiny_server: ServerProcess, field: str, value: Any
) -> None:
    r = complete(tiny_server, n_predict=1, **{field: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"]


def test_the_same_fields_at_their_defaults_are_accepted(tiny_server: ServerProcess) -> None:
    inert = {
        "n_indent": 0,
        "n": 1,
        "n_cmpl": 1,
        "t_max_predict_ms": 0,
        "return_tokens": False,
        "return_progress": False,
        "verbose": False,
        "stream_options": {"include_usage": True},
        "sse_ping_interval": 0,
    }
    r = complete(tiny_server, n_predict=2, ignore_eos=True, **inert)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
    # A stream_options that is not an object is ignored, as llama-server does.
    r = complete(tiny_server, n_predict=1, stream_options=5)
    assert r.status_code == 200

"""What llama.cpp's own server tests showed a drop-in llama-server must do (issue 19): any model
name served, llama-server's context-overflow error, its input forms, stream shapes and
metrics, run against a server started with the suite's preset (-c 256 -np 2 -n 64)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import ServerProcess

CTX = 256
N_PREDICT = 64
CHUNK = 32
USER = [{"role": "user", "content": "Write an example"}]


@pytest.fixture(scope="module")
def preset(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        [
            "-m",
            str(tiny_model_dir),
            "-c",
            str(CTX),
            "-np",
            "2",
            "-n",
            str(N_PREDICT),
            # llama-server's prompt chunk: return_progress reports one per chunk.
            "-b",
            str(CHUNK),
            "--metrics",
            "--no-audio",
            "--no-warmup",
        ]
    )
    yield server
    server.stop()


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def frames(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


# -- 1. model names ---------------------------------------------------------------------------


def test_any_model_name_is_served_in_single_model_mode(preset: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{preset.base_url}/v1", api_key="x", max_retries=0)
    served = client.models.list().data[0].id
    chat = client.chat.completions.create(model="gpt-4o-mini", messages=USER, max_tokens=2)
    assert chat.model == served and chat.usage is not None and chat.usage.prompt_tokens > 0
    text = client.completions.create(model="davinci-002", prompt="Once", max_tokens=2)
    assert text.model == served
    claude = anthropic.Anthropic(base_url=preset.base_url, api_key="x", max_retries=0)
    msg = claude.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=USER)
    assert msg.model == served and msg.usage.input_tokens > 0
    r = post(preset, "/tokenize", {"content": "hello", "model": "any-name"})
    assert r.status_code == 200 and r.json()["tokens"]


def test_strict_model_names_answer_404_on_every_route(tiny_model_dir: Path) -> None:
    from tests.e2e.test_embeddings import MINILM

    server = ServerProcess(
        [
            "-m",
            str(tiny_model_dir),
            "--strict-model-names",
            "--embedding-model",
            MINILM,
            "--no-audio",
            "--no-warmup",
        ]
    )
    try:
        for path, body in [
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            ("/completion", {"prompt": "hi", "n_predict": 1}),
            ("/tokenize", {"content": "hi"}),
            ("/v1/embeddings", {"input": "hi"}),
        ]:
            r = post(server, path, {**body, "model": "nope"})
            assert r.status_code == 404, (path, r.text)
            assert "'nope'" in r.json()["error"]["message"], path
            assert post(server, path, {**body, "model": "default"}).status_code == 200, path
    finally:
        server.stop()


# -- 2. context overflow ----------------------------------------------------------------------

LONG = "the quick brown fox jumps over the lazy dog " * 60


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "stream": True}),
        ("/completion", {"prompt": LONG}),
        ("/completion", {"prompt": LONG, "stream": True}),
    ],
)
def test_context_overflow_is_llama_servers_error(
    preset: ServerProcess, path: str, body: dict[str, Any]
) -> None:
    r = post(preset, path, body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == CTX and error["n_prompt_tokens"] > CTX
    assert "exceeds the available context size" in error["message"]
    # OpenAI's code on the OpenAI routes; llama-server's numeric one on its own.
    assert error["code"] == (400 if path == "/completion" else "context_length_exceeded")


def test_context_overflow_in_responses_and_anthropic(preset: ServerProcess) -> None:
    """Each family says it in its own terms: Responses names `input` (OpenAI's SDK raises
    BadRequestError with code context_length_exceeded); Anthropic says "prompt is too long",
    the words its clients read as the cue to compact the conversation."""
    openai_client = openai.OpenAI(base_url=preset.base_url + "/v1", api_key="x", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            openai_client.responses.create(model="m", input=LONG, stream=stream)
        assert caught.value.code == "context_length_exceeded"
        assert caught.value.param == "input"
        assert isinstance(caught.value.body, dict) and caught.value.body["n_ctx"] == CTX
    claude = anthropic.Anthropic(base_url=preset.base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": LONG}]
        )
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    message = refused.value.body["error"]["message"]  # type: ignore[index]
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {CTX} maximum", message)


# -- 3, 7. constraints on chat ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"response_format": {"type": "json_object", "schema": {"const": "42"}}}, '"42"'),
        ({"json_schema": {"const": "42"}}, '"42"'),
        ({"grammar": 'root ::= "a"{5,5}'}, "aaaaa"),
    ],
)
def test_chat_is_constrained_by_llama_server_fields(
    preset: ServerProcess, extra: dict[str, Any], expected: str
) -> None:
    r = post(preset, "/v1/chat/completions", {"messages": USER, "max_tokens": 10, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_object", "schema": 123},
        {"type": "json_object", "schema": {"type": "hiccup"}},
        {"type": "sound"},
    ],
)
def test_a_bad_response_format_is_a_400(preset: ServerProcess, fmt: dict[str, Any]) -> None:
    r = post(preset, "/v1/chat/completions", {"messages": USER, "response_format": fmt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


# -- 5, 13. chat stream shapes ----------------------------------------------------------------


def test_chat_stream_starts_with_null_content_and_sends_usage_only_when_asked(
    preset: ServerProcess,
) -> None:
    body = {"messages": USER, "max_tokens": 3, "stream": True}
    plain = frames(preset, "/v1/chat/completions", body)
    assert plain[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    # As llama-server: no usage chunk unless stream_options.include_usage asks for it.
    assert all(f["choices"] and "usage" not in f for f in plain)
    usage = frames(
        preset, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert usage[-1]["choices"] == [] and usage[-1]["usage"]["completion_tokens"] <= 3


def test_chat_timings_progress_and_probabilities(preset: ServerProcess) -> None:
    body = {
        "messages": USER,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "timings_per_token": True,
        "return_progress": True,
        "return_tokens": True,
        "logprobs": True,
        "top_logprobs": 2,
        "post_sampling_probs": True,
    }
    out = frames(preset, "/v1/chat/completions", body)
    assert "timings" not in out[0]
    assert all("prompt_per_second" in f["timings"] for f in out[1:])
    assert out[-1]["timings"]["predicted_n"] <= 4
    reports = [f["prompt_progress"] for f in out if "prompt_progress" in f]
    assert reports[-1]["total"] == reports[-1]["processed"] == out[-1]["usage"]["prompt_tokens"]
    scored = [
        e
        for f in out
        if f["choices"] and f["choices"][0]["logprobs"]
        for e in f["choices"][0]["logprobs"]["content"]
    ]
    assert scored and all(0.0 < e["prob"] <= 1.0 and len(e["top_probs"]) == 2 for e in scored)


# -- 6. --n-predict caps, truncated -----------------------------------------------------------


def test_server_n_predict_caps_the_request(preset: ServerProcess) -> None:
    body = {"prompt": "Once", "n_predict": 200, "ignore_eos": True}
    r = post(preset, "/completion", body).json()
    assert r["tokens_predicted"] == N_PREDICT and r["generation_settings"]["n_predict"] == N_PREDICT
    assert r["truncated"] is False and r["stop_type"] == "limit"
    chat = post(
        preset, "/v1/chat/completions", {"messages": USER, "max_tokens": 200, "ignore_eos": True}
    )
    assert chat.json()["usage"]["completion_tokens"] == N_PREDICT


def test_truncated_when_generation_reaches_the_context_end(preset: ServerProcess) -> None:
    prompt = "the quick brown fox jumps over the lazy dog " * 22
    n_prompt = len(
        post(preset, "/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]
    )
    assert CTX - N_PREDICT < n_prompt < CTX
    r = post(preset, "/completion", {"prompt": prompt, "n_predict": 64, "ignore_eos": True}).json()
    assert r["tokens_predicted"] == CTX - n_prompt and r["truncated"] is True


# -- 7, 12. /completion input and output forms ------------------------------------------------


def test_completion_takes_a_list_of_prompts_and_mixed_arrays(preset: ServerProcess) -> None:
    text = "I believe the meaning of life is"
    ids = post(preset, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    greedy = {"n_predict": 4, "temperature": 0, "cache_prompt": False}
    one = post(preset, "/completion", {"prompt": text, **greedy}).json()
    both = post(preset, "/completion", {"prompt": [ids, text], **greedy})
    assert both.status_code == 200, both.text
    assert [r["index"] for r in both.json()] == [0, 1]
    assert [r["content"] for r in both.json()] == [one["content"]] * 2
    streamed = frames(preset, "/completion", {"prompt": [ids, text], "stream": True, **greedy})
    finals = [f for f in streamed if f["stop"]]
    assert [f["index"] for f in finals] == [0, 1]
    for i in (0, 1):
        got = "".join(f["content"] for f in streamed if f["index"] == i and not f["stop"])
        assert got == one["content"]
    mixed = post(preset, "/completion", {"prompt": [1, 2, 3, text, 4, text], **greedy})
    assert mixed.status_code == 200 and mixed.json()["tokens_evaluated"] > 2 * len(ids)
    bad = post(preset, "/completion", {"prompt": [[["x"]]], **greedy})
    assert bad.status_code == 400


def test_completion_tokens_streamed_and_returned(preset: ServerProcess) -> None:
    body = {"prompt": "Once upon", "n_predict": 6, "temperature": 0, "ignore_eos": True}
    final = post(preset, "/completion", {**body, "return_tokens": True}).json()
    assert len(final["tokens"]) == 6 and all(isinstance(t, int) for t in final["tokens"])
    assert post(preset, "/completion", body).json()["tokens"] == []
    out = frames(preset, "/completion", {**body, "stream": True, "return_progress": True})
    progress = [f for f in out if "prompt_progress" in f]
    text = [f for f in out[:-1] if "prompt_progress" not in f]
    streamed = [t for f in text for t in f["tokens"]]
    assert streamed == final["tokens"] and all(f["tokens"] for f in text)
    assert progress[0]["prompt_progress"]["total"] == final["tokens_evaluated"]
    assert all(f["content"] == "" and f["tokens"] == [] for f in progress)


@pytest.mark.parametrize("reuse", [False, True], ids=["cold", "cached"])
def test_prompt_progress_per_chunk(preset: ServerProcess, reuse: bool) -> None:
    """return_progress: a report as the prompt starts (what the cache gave), one per prefill
    chunk (-b), the last when the whole prompt is read; never after the first token."""
    body = {
        "messages": [{"role": "user", "content": f"This is test {reuse} " * 20}],
        "max_tokens": 3,
        "stream": True,
        "return_progress": True,
        "cache_prompt": reuse,
    }
    if reuse:
        frames(preset, "/v1/chat/completions", body)
    out = frames(preset, "/v1/chat/completions", body)
    at = [i for i, f in enumerate(out) if "prompt_progress" in f]
    reports = [out[i]["prompt_progress"] for i in at]
    first_text = next(
        i for i, f in enumerate(out) if f["choices"] and f["choices"][0]["delta"].get("content")
    )
    assert at[-1] < first_text
    total, cache = reports[0]["total"], reports[0]["cache"]
    assert reports[0]["processed"] == cache and (cache > 0) == reuse
    assert all(r["total"] == total and r["cache"] == cache for r in reports)
    done = [r["processed"] for r in reports]
    assert done == sorted(set(done)) and done[-1] == total
    assert len(reports) == 1 + -(-(total - cache) // CHUNK)
    assert all(out[i]["choices"][0]["delta"] == {"role": "assistant", "content": None} for i in at)
    assert "timings" in out[-1] and out[-1]["timings"]["prompt_n"] == total - cache


def test_final_answers_carry_timings(preset: ServerProcess) -> None:
    """llama-server puts `timings` on every OpenAI-style final answer, streamed or not."""
    chat = {"messages": USER, "max_tokens": 3}
    text = {"prompt": "Once upon", "max_tokens": 3}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", text)):
        whole = post(preset, path, body).json()
        assert whole["timings"]["predicted_n"] == whole["usage"]["completion_tokens"]
        out = frames(preset, path, {**body, "stream": True})
        assert [("timings" in f) for f in out] == [False] * (len(out) - 1) + [True]
        usage = frames(
            preset, path, {**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert (
            "usage" in usage[-1]
            and usage[-1]["timings"]["predicted_n"] == usage[-1]["usage"]["completion_tokens"]
        )
        assert all("timings" not in f for f in usage[:-1])


def test_completion_post_sampling_probs(preset: ServerProcess) -> None:
    body = {"prompt": "Once", "n_predict": 3, "n_probs": 4, "post_sampling_probs": True}
    probs = post(preset, "/completion", body).json()["completion_probabilities"]
    assert len(probs) == 3
    for tok in probs:
        assert 0.0 < tok["prob"] <= 1.0 and "logprob" not in tok and len(tok["top_probs"]) == 4


def test_greedy_post_sampling_probs_are_one_hot(preset: ServerProcess) -> None:
    body = {"prompt": "Once", "n_predict": 3, "n_probs": 4, "temperature": 0}
    probs = post(preset, "/completion", {**body, "post_sampling_probs": True}).json()
    for tok in probs["completion_probabilities"]:
        assert tok["prob"] == 1.0
        assert sorted(p["prob"] for p in tok["top_probs"]) == [0.0, 0.0, 0.0, 1.0]


def test_completion_takes_an_object_prompt(preset: ServerProcess) -> None:
    body = {"n_predict": 2, "temperature": 0, "cache_prompt": False}
    text = post(preset, "/completion", {**body, "prompt": "I believe"}).json()
    obj = post(preset, "/completion", {**body, "prompt": {"prompt_string": "I believe"}})
    assert obj.status_code == 200 and obj.json()["content"] == text["content"]
    image = {"prompt_string": "a <__media__>", "multimodal_data": ["iVBORw0KGgo="]}
    assert post(preset, "/completion", {**body, "prompt": image}).status_code == 400


def test_logit_bias_keys_may_be_text(preset: ServerProcess) -> None:
    body = {"prompt": "Once upon", "n_predict": 1, "temperature": 0, "return_tokens": True}
    first = post(preset, "/completion", body).json()
    piece = first["content"]
    assert piece
    for bias in ([[piece, -100]], {piece: -100}):
        other = post(preset, "/completion", {**body, "logit_bias": bias})
        assert other.status_code == 200, other.text
        assert other.json()["tokens"] != first["tokens"]
    chat = post(
        preset,
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 1, "logit_bias": {" the": -100}},
    )
    assert chat.status_code == 200


@pytest.mark.parametrize("family", ["chat", "responses", "anthropic"])
def test_text_logit_bias_in_every_chat_family(preset: ServerProcess, family: str) -> None:
    """A text key bans every token of its encoding, on each chat route (as on /completion)."""

    def first_word(bias: dict[str, float] | None) -> str:
        extra = {} if bias is None else {"logit_bias": bias}
        if family == "chat":
            body = {"messages": USER, "max_tokens": 2, "temperature": 0, **extra}
            r = post(preset, "/v1/chat/completions", body)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["message"]["content"])
        if family == "responses":
            body = {"input": USER[0]["content"], "max_output_tokens": 2, "temperature": 0}
            r = post(preset, "/v1/responses", {**body, **extra})
            assert r.status_code == 200, r.text
            return str(r.json()["output"][-1]["content"][0]["text"])
        body = {"messages": USER, "max_tokens": 2, "temperature": 0, **extra}
        r = post(preset, "/v1/messages", body)
        assert r.status_code == 200, r.text
        return str(r.json()["content"][0]["text"])

    plain = first_word(None)
    assert plain.strip()
    word = plain.split()[0]
    banned = first_word({word: -100, " " + word: -100})
    assert not banned.strip().startswith(word)
    bad = post(preset, "/v1/messages", {"messages": USER, "max_tokens": 2, "logit_bias": {"": 1}})
    assert bad.status_code == 400 and "logit_bias" in bad.text


# -- 8. history validation --------------------------------------------------------------------


def test_history_errors_name_the_message(preset: ServerProcess) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    bad_args = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    r = post(preset, "/v1/chat/completions", {"messages": bad_args})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    two = [*USER, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    r = post(preset, "/v1/chat/completions", {"messages": two})
    assert r.status_code == 400 and "messages[2]" in r.json()["error"]["message"]


# -- 11. metrics ------------------------------------------------------------------------------


def test_prompt_cache_metrics(preset: ServerProcess) -> None:
    body = {"prompt": "I believe the meaning of life is", "n_predict": 2, "temperature": 0}
    post(preset, "/completion", body)
    assert post(preset, "/completion", body).json()["timings"]["cache_n"] > 0
    text = httpx.get(f"{preset.base_url}/metrics").text
    cached = re.search(r"^llamacpp:prompt_tokens_cache_total (\S+)$", text, re.M)
    ratio = re.search(r"^llamacpp:prompt_cache_hit_ratio (\S+)$", text, re.M)
    assert cached is not None and float(cached.group(1)) > 0
    assert ratio is not None and 0.0 < float(ratio.group(1)) < 1.0


# -- 15. /infill ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra", [{"filename": "x.py"}, {"text": 1}, {"text": "a", "filename": 2}, "x"]
)
def test_infill_checks_input_extra_first(preset: ServerProcess, extra: Any) -> None:
    body = {"input_prefix": "def f():", "input_suffix": "", "input_extra": [extra]}
    r = post(preset, "/infill", body)
    assert r.status_code == 400 and "input_extra[0]" in r.json()["error"]["message"]

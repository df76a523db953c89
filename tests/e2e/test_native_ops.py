"""llama-server native routes and operations: shapes, gates, auth, CORS, UDS, limits."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxcel.models import device
from tests.conftest import ServerProcess

CHAT = {"messages": [{"role": "user", "content": "Hello there"}]}


def test_native_completion_shape(tiny_server: ServerProcess) -> None:
    r = httpx.post(
        f"{tiny_server.base_url}/completion",
        json={"prompt": "Once upon", "n_predict": 6, "ignore_eos": True},
    )
    body = r.json()
    assert r.status_code == 200
    assert body["stop"] is True and body["stop_type"] == "limit" and body["stopping_word"] == ""
    assert body["tokens_predicted"] == 6
    assert body["tokens_evaluated"] > 0
    assert isinstance(body["content"], str) and body["content"]
    assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"} <= set(
        body["timings"]
    )
    assert body["generation_settings"]["n_ctx"] == 4096


def test_native_completion_stop_word_and_token_prompt(tiny_server: ServerProcess) -> None:
    url = f"{tiny_server.base_url}/completion"
    full = httpx.post(
        url, json={"prompt": [1, 2, 3], "n_predict": 20, "temperature": 0, "ignore_eos": True}
    ).json()
    word = full["content"][4:7]
    cut = httpx.post(
        url, json={"prompt": [1, 2, 3], "n_predict": 20, "temperature": 0, "stop": [word]}
    ).json()
    assert cut["stop_type"] == "word" and cut["stopping_word"] == word
    assert cut["content"] == full["content"][: full["content"].index(word)]


def test_native_completions_without_v1_streams_native_frames(tiny_server: ServerProcess) -> None:
    body = {"prompt": "Once upon", "n_predict": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{tiny_server.base_url}/completions", json=body) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    # No [DONE] sentinel: every frame is a JSON object, and the last one is the final object.
    assert "[DONE]" not in data
    frames = [json.loads(d) for d in data]
    assert all(f["stop"] is False for f in frames[:-1])
    assert frames[-1]["stop"] is True and frames[-1]["tokens_predicted"] == 4
    assert "timings" in frames[-1]


def test_tokenize_detokenize_round_trip(tiny_server: ServerProcess) -> None:
    base = tiny_server.base_url
    text = "Hi 🎉 <|im_start|>"
    ids = httpx.post(f"{base}/tokenize", json={"content": text}).json()["tokens"]
    assert 1 in ids  # <|im_start|> parsed as the special token by default
    literal = httpx.post(f"{base}/tokenize", json={"content": text, "parse_special": False}).json()[
        "tokens"
    ]
    assert 1 not in literal
    pieces = httpx.post(f"{base}/tokenize", json={"content": text, "with_pieces": True}).json()[
        "tokens"
    ]
    assert [p["id"] for p in pieces] == ids
    assert any(isinstance(p["piece"], list) for p in pieces), (
        "emoji bytes split across tokens come back as byte lists"
    )
    raw = b"".join(
        bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces
    )
    assert raw.decode() == text
    assert httpx.post(f"{base}/detokenize", json={"tokens": ids}).json() == {"content": text}
    assert httpx.post(f"{base}/tokenize", json={}).json() == {"tokens": []}
    assert httpx.post(f"{base}/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_apply_template_and_input_tokens_match_generation(tiny_server: ServerProcess) -> None:
    base = tiny_server.base_url
    prompt = httpx.post(f"{base}/apply-template", json=CHAT).json()["prompt"]
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")
    n = httpx.post(f"{base}/v1/chat/completions/input_tokens", json=CHAT).json()["input_tokens"]
    usage = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()[
        "usage"
    ]
    assert n == usage["prompt_tokens"]
    # Under OpenAI's path, its errors are in OpenAI's envelope (code null, param named).
    bad = httpx.post(f"{base}/v1/chat/completions/input_tokens", json={})
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["code"] is None and error["type"] == "invalid_request_error"
    assert error["param"] == "messages"


def test_infill_without_fim_tokens_is_501(tiny_server: ServerProcess) -> None:
    r = httpx.post(
        f"{tiny_server.base_url}/infill", json={"input_prefix": "def f(", "input_suffix": "x"}
    )
    assert r.status_code == 501
    assert r.json()["error"]["type"] == "not_supported_error"


def test_props_and_gates(tiny_server: ServerProcess, tiny_model_dir: Path) -> None:
    props = httpx.get(f"{tiny_server.base_url}/props").json()
    assert props["total_slots"] == 4
    assert props["model_alias"] == tiny_model_dir.name
    assert props["model_path"] == str(tiny_model_dir)
    assert "<|im_start|>" in props["chat_template"]
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert props["default_generation_settings"]["n_ctx"] == 4096
    assert props["build_info"].startswith("mlxcel-")
    # The device the server computes on is the one mlx picks here (the same wheel).
    assert props["device"] == device.describe().label
    assert props["model_ftype"] == "MLX F32"
    # The tiny model's ChatML template takes a system turn and has no tool syntax.
    caps = props["chat_template_caps"]
    assert caps["supports_system_role"] is True and caps["supports_tools"] is False
    assert props["geometry"]["n_batch_decode"] == 4 and props["geometry"]["n_kv_max"] == 4096
    assert props["kv_cache_mode"] == "full"
    assert props["speculative"] == {"model": None, "kind": "ngram", "n_max": 16}
    for method, path, flag in (("POST", "/props", "--props"), ("GET", "/metrics", "--metrics")):
        r = httpx.request(method, f"{tiny_server.base_url}{path}")
        assert r.status_code == 501
        error = r.json()["error"]
        assert set(error) == {"code", "message", "type"} and flag in error["message"]


def test_models_list_has_llama_servers_meta(
    tiny_server: ServerProcess, tiny_model_dir: Path
) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    before = time.time()
    listing = httpx.get(f"{tiny_server.base_url}/v1/models").json()
    entry = listing["data"][0]
    assert entry["owned_by"] == "llamacpp" and "default" in entry["aliases"]
    assert entry["tags"] == [] and before - 1 <= entry["created"] <= time.time() + 1
    meta = entry["meta"]
    tok = httpx.post(f"{tiny_server.base_url}/tokenize", json={"content": "hello"}).json()
    assert tok["tokens"] and all(t < meta["n_vocab"] for t in tok["tokens"])
    assert meta["n_ctx_train"] == config["max_position_embeddings"] and meta["n_ctx"] == 4096
    assert meta["n_embd"] == config["hidden_size"] and meta["vocab_type"] == 2  # BPE
    # float32 weights: four bytes a parameter.
    assert meta["n_params"] > 0 and meta["size"] == 4 * meta["n_params"]
    assert meta["ftype"] == "MLX F32"
    assert listing["models"][0]["details"]["format"] == "safetensors"


def test_slots_busy_during_a_stream_and_idle_after_disconnect(tiny_server: ServerProcess) -> None:
    base = tiny_server.base_url
    body = {**CHAT, "max_tokens": 5000, "stream": True, "ignore_eos": True}
    body |= {"temperature": 0.1, "top_k": 3, "stop": ["zzqx"]}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
        slots = httpx.get(f"{base}/slots").json()
        busy = [s for s in slots if s["is_processing"]]
        assert len(slots) == 4 and len(busy) == 1
        assert busy[0]["next_token"]["n_decoded"] >= 0 and busy[0]["prompt"] == ""
        # The busy slot shows its request's settings, the idle ones the server's defaults.
        params = busy[0]["params"]
        assert params["temperature"] == 0.1 and params["top_k"] == 3
        # n_predict: the 5000 asked for, capped to the context left after the prompt.
        ctx_left = busy[0]["n_ctx"] - busy[0]["n_prompt_tokens"]
        assert params["n_predict"] == min(5000, ctx_left) and params["stop"] == ["zzqx"]
        assert params["ignore_eos"] is True
        idle = next(s for s in slots if not s["is_processing"])["params"]
        assert idle["temperature"] == 0.8 and idle["top_k"] == 40
    deadline = time.monotonic() + 5
    while any(s["is_processing"] for s in httpx.get(f"{base}/slots").json()):
        assert time.monotonic() < deadline, "the slot stayed busy after the client left"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def ops_server(tiny_model_dir: Path) -> Any:
    server = ServerProcess(
        [
            "-m",
            str(tiny_model_dir),
            "--metrics",
            "--parallel",
            "1",
            "--no-slots",
            "--props",
            "--api-key",
            "k1,k2",
            "--api-key",
            "k3",
            "--no-warmup",
            "--max-request-bytes",
            "65536",
        ]
    )
    yield server
    server.stop()


def auth(key: str = "k1") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_metrics_after_known_traffic(ops_server: ServerProcess) -> None:
    base = ops_server.base_url

    def scrape() -> dict[str, float]:
        text = httpx.get(f"{base}/metrics", headers=auth()).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
                out[key] = s.value
        return out

    before = scrape()
    for _ in range(2):
        httpx.post(
            f"{base}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 7, "ignore_eos": True},
            headers=auth(),
        )
    after = scrape()
    assert (
        after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 14
    )
    assert after["llamacpp:prompt_tokens_total"] > before["llamacpp:prompt_tokens_total"]
    assert (
        after['mlxcel_requests_total{"finish_reason": "length"}']
        - before.get('mlxcel_requests_total{"finish_reason": "length"}', 0)
        == 2
    )
    assert (
        after["mlxcel_time_to_first_token_seconds_count"]
        - before.get("mlxcel_time_to_first_token_seconds_count", 0)
        == 2
    )
    assert after["llamacpp:requests_processing"] == 0
    assert "mlxcel_prompt_cache_misses_total" in after
    tic = time.perf_counter()
    httpx.get(f"{base}/metrics", headers=auth())
    assert time.perf_counter() - tic < 1.0


def test_gated_slots_and_open_props(ops_server: ServerProcess) -> None:
    r = httpx.get(f"{ops_server.base_url}/slots", headers=auth())
    assert r.status_code == 501 and "--slots" in r.json()["error"]["message"]
    assert httpx.post(f"{ops_server.base_url}/props", headers=auth(), json={}).json() == {
        "success": True
    }


def _routes() -> list[tuple[str, str]]:
    """Every route of the real app, enumerated from its URL map."""
    from mlxcel.http.app import create_app
    from mlxcel.http.context import ServerContext
    from mlxcel.runtime.settings import Settings

    ctx: Any = ServerContext.__new__(ServerContext)
    object.__setattr__(ctx, "settings", Settings())
    app = create_app(ctx)
    out = []
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            out.append((method, rule.rule.replace("<id>", "x")))
    return sorted(set(out))


# llama-server's public routes: health and the model list.
PUBLIC = {"/", "/health", "/v1/health", "/models", "/v1/models", "/openapi.json"}


def test_every_non_public_route_needs_a_key(ops_server: ServerProcess) -> None:
    routes = _routes()
    assert len(routes) > 15
    base = ops_server.base_url
    for method, path in routes:
        # A tiny generation budget: routes that generate from an empty prompt stop at once.
        kw: dict[str, Any] = {"json": {"n_predict": 1}} if method == "POST" else {}
        missing = httpx.request(method, base + path, **kw)
        if path in PUBLIC:
            assert missing.status_code == 200, path
            continue
        wrong = httpx.request(method, base + path, headers=auth("nope"), **kw)
        for r in (missing, wrong):
            assert r.status_code == 401, (method, path, r.status_code)
            if path.endswith(("/messages", "/messages/count_tokens")):
                # Anthropic SDKs read Anthropic's envelope.
                assert r.json() == {
                    "type": "error",
                    "error": {"type": "authentication_error", "message": "Invalid API Key"},
                }
                continue
            assert r.json() == {
                "error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}
            }
        for headers in (auth("k2"), {"X-Api-Key": "k3"}):
            ok = httpx.request(method, base + path, headers=headers, **kw)
            assert ok.status_code != 401, (method, path)


def test_cors_preflight_is_answered_before_auth(ops_server: ServerProcess) -> None:
    # The headers the official JS SDKs send from a browser, x-stainless-* included.
    asked = "authorization,content-type,x-stainless-os,x-stainless-lang"
    r = httpx.options(
        f"{ops_server.base_url}/v1/chat/completions",
        headers={
            "Origin": "http://example.test",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": asked,
        },
    )
    assert r.status_code == 200
    # llama-server's answer: the Origin echoed, credentials allowed, the asked headers allowed.
    assert r.headers["access-control-allow-origin"] == "http://example.test"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == asked
    assert "Origin" in r.headers["vary"]
    get = httpx.get(
        f"{ops_server.base_url}/v1/models", headers={**auth(), "Origin": "http://example.test"}
    )
    assert get.headers["access-control-allow-origin"] == "http://example.test"
    assert get.headers["access-control-allow-credentials"] == "true"
    # A 401 carries them too, so the browser lets the page read it.
    denied = httpx.get(f"{ops_server.base_url}/props", headers={"Origin": "http://x.test"})
    assert denied.status_code == 401
    assert denied.headers["access-control-allow-origin"] == "http://x.test"


def test_key_lookup_takes_bearer_off_either_header_and_compares_exactly(
    ops_server: ServerProcess,
) -> None:
    url = f"{ops_server.base_url}/props"
    for headers in (
        {"Authorization": "Bearer k3"},
        {"Authorization": "k3"},
        {"X-Api-Key": "k3"},
        {"X-Api-Key": "Bearer k3"},
        {"Authorization": "", "X-Api-Key": "k2"},
    ):
        assert httpx.get(url, headers=headers).status_code == 200, headers
    for headers in (
        # Exact: the second space is part of the key presented (" k3").
        {"Authorization": "Bearer  k3"},
        {"X-Api-Key": "Bearer  k3"},
        {"Authorization": "k3x"},
        {"Authorization": "Bearer wrong", "X-Api-Key": "k3"},
    ):
        assert httpx.get(url, headers=headers).status_code == 401, headers


def test_sdk_with_and_without_key(ops_server: ServerProcess) -> None:
    good = openai.OpenAI(base_url=f"{ops_server.base_url}/v1", api_key="k3", max_retries=0)
    assert good.models.list().data
    bad = openai.OpenAI(base_url=f"{ops_server.base_url}/v1", api_key="wrong", max_retries=0)
    # The model list is public (llama-server's rule), whatever key is sent; the rest is not.
    assert bad.models.list().data
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="default", prompt="hi", max_tokens=1)
    good.close()
    bad.close()


def test_body_over_2_mib_is_413_in_the_openai_envelope(tiny_server: ServerProcess) -> None:
    big = {"messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024 + 10)}]}
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=big)
    assert r.status_code == 413
    assert set(r.json()["error"]) >= {"message", "type", "code"}


def test_request_size_limit_is_configurable(ops_server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "x" * 70_000}]}
    r = httpx.post(f"{ops_server.base_url}/v1/chat/completions", json=body, headers=auth())
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]


def test_bad_priority_header_is_400(tiny_server: ServerProcess) -> None:
    r = httpx.post(
        f"{tiny_server.base_url}/v1/chat/completions",
        json={**CHAT, "max_tokens": 1},
        headers={"X-Priority": "urgent"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Priority"
    ok = httpx.post(
        f"{tiny_server.base_url}/v1/chat/completions",
        json={**CHAT, "max_tokens": 1},
        headers={"X-Priority": "high"},
    )
    assert ok.status_code == 200


def test_unix_socket_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    import os
    import stat
    import subprocess
    import sys

    sock = tmp_path / "mlxcel.sock"
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxcel",
            "serve",
            "-m",
            str(tiny_model_dir),
            "--host",
            str(sock),
            "--port",
            "0",
            "--no-warmup",
        ],
        stderr=log,
    )
    try:
        transport = httpx.HTTPTransport(uds=str(sock))
        client = httpx.Client(transport=transport, base_url="http://localhost")
        deadline = time.monotonic() + 120
        # The server logs "serving ... on unix:..." once its listener is up. (Polling with
        # connects before that leaks sockets inside httpcore on failed UDS connects.)
        while "serving " not in (tmp_path / "server.log").read_text(errors="replace"):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        assert client.get("/health").status_code == 200
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        sdk = openai.OpenAI(
            base_url="http://localhost/v1",
            api_key="x",
            max_retries=0,
            http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))),
        )
        r = sdk.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert r.choices[0].message.content is not None
        sdk.close()
        client.close()
    finally:
        proc.terminate()
        code = proc.wait(timeout=60)
        log.close()
    assert code == 0
    assert not sock.exists(), "the socket file must be removed on exit"


def test_api_prefix(tiny_model_dir: Path) -> None:
    server = ServerProcess(["-m", str(tiny_model_dir), "--api-prefix", "/api", "--no-warmup"])
    try:
        assert httpx.get(f"{server.base_url}/api/v1/models").status_code == 200
        assert httpx.get(f"{server.base_url}/api/health").status_code == 200
        assert httpx.get(f"{server.base_url}/v1/models").status_code == 404
    finally:
        server.stop()


def test_infill_with_fim_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A tokenizer that has FIM tokens: /infill builds prefix-suffix-middle and generates."""
    import shutil

    fim_dir = tmp_path / "tiny-fim"
    shutil.copytree(tiny_model_dir, fim_dir)
    # Give three unused special tokens (ids 3-5) the StarCoder FIM names, keeping the vocab size.
    raw = (fim_dir / "tokenizer.json").read_text()
    for old, new in (
        ("<repo_name>", "<fim_prefix>"),
        ("<reponame>", "<fim_suffix>"),
        ("<file_sep>", "<fim_middle>"),
    ):
        assert old in raw
        raw = raw.replace(f'"{old}"', f'"{new}"')
    (fim_dir / "tokenizer.json").write_text(raw)
    for extra in fim_dir.glob("tokenizer_config.json"):
        text = extra.read_text()
        for old, new in (
            ("<repo_name>", "<fim_prefix>"),
            ("<reponame>", "<fim_suffix>"),
            ("<file_sep>", "<fim_middle>"),
        ):
            text = text.replace(f'"{old}"', f'"{new}"')
        extra.write_text(text)
    server = ServerProcess(["-m", str(fim_dir), "--no-warmup"])
    try:
        body = {
            "input_prefix": "def add(a, b):\n    return ",
            "input_suffix": "\n",
            "n_predict": 4,
            "ignore_eos": True,
        }
        r = httpx.post(f"{server.base_url}/infill", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["tokens_predicted"] == 4
        prefix_ids = httpx.post(
            f"{server.base_url}/tokenize", json={"content": body["input_prefix"]}
        ).json()["tokens"]
        suffix_ids = httpx.post(f"{server.base_url}/tokenize", json={"content": "\n"}).json()[
            "tokens"
        ]
        # <fim_prefix> prefix <fim_suffix> suffix <fim_middle>
        assert out["tokens_evaluated"] == len(prefix_ids) + len(suffix_ids) + 3
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "kind", "message"),
    [
        ("POST", "/lora-adapters", [{"id": 0, "scale": 0.5}], 400, "invalid_request_error", "LoRA"),
        ("GET", "/tools", None, 403, "feature_disabled", "/tools"),
        ("POST", "/cors-proxy", {"url": "http://x"}, 403, "feature_disabled", "/cors-proxy"),
    ],
)
def test_llama_server_routes_we_do_not_offer_say_so_in_the_native_envelope(
    tiny_server: ServerProcess,
    method: str,
    path: str,
    body: object,
    status: int,
    kind: str,
    message: str,
) -> None:
    r = httpx.request(method, f"{tiny_server.base_url}{path}", json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == status and error["type"] == kind and message in error["message"]


def test_lora_adapters_lists_none_and_accepts_the_empty_list(tiny_server: ServerProcess) -> None:
    base = tiny_server.base_url
    assert httpx.get(f"{base}/lora-adapters").json() == []
    assert httpx.post(f"{base}/lora-adapters", json=[]).json() == {"success": True}

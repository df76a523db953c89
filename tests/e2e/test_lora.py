"""LoRA adapters (`--lora`, `--lora-scaled`, `--lora-init-without-apply`, `/lora-adapters`, a
request's `lora` field) on the tiny llama, with two adapters written in mlx-lm's format.

Every answer is greedy, so an adapter's effect is a different token sequence, and "the same
as alone" is token-for-token equality.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO, ServerProcess
from tests.support.tiny_lora import build_tiny_adapter

PROMPT = "Once upon a time in a land far away, there lived a"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return build_tiny_adapter(root / "a0", seed=1), build_tiny_adapter(root / "a1", seed=2)


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, adapters: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    a0, a1 = adapters
    server = ServerProcess(
        [
            "--slot-save-path",
            str(tmp_path_factory.mktemp("slots")),
            "-m",
            str(tiny_model_dir),
            "--parallel",
            "4",
            "--lora",
            str(a0),
            "--lora-scaled",
            str(a1),
            "0.5",
            "--lora-init-without-apply",
        ]
    )
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def no_global_scales(server: ServerProcess) -> Iterator[None]:
    """Each test starts, and leaves, with every adapter at scale 0 (as the flags load them)."""
    yield
    httpx.post(f"{server.base_url}/lora-adapters", json=[])


def complete(server: ServerProcess, n: int = 12, prompt: str = PROMPT, **fields: Any) -> Any:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, **fields}
    r = httpx.post(f"{server.base_url}/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(server: ServerProcess, **fields: Any) -> list[int]:
    return list(complete(server, return_tokens=True, **fields)["tokens"])


def test_the_adapters_are_listed_with_their_scales(
    server: ServerProcess, adapters: tuple[Path, Path]
) -> None:
    listed = httpx.get(f"{server.base_url}/lora-adapters").json()
    assert [(a["id"], a["path"], a["scale"]) for a in listed] == [
        (0, str(adapters[0]), 0.0),
        (1, str(adapters[1]), 0.0),
    ]


def test_scale_zero_is_the_base_model_and_scale_one_is_not(server: ServerProcess) -> None:
    base = tokens(server, cache_prompt=False)
    assert tokens(server, lora=[{"id": 0, "scale": 0.0}], cache_prompt=False) == base
    one = tokens(server, lora=[{"id": 0, "scale": 1.0}], cache_prompt=False)
    other = tokens(server, lora=[{"id": 1, "scale": 1.0}], cache_prompt=False)
    assert one != base and other != base and one != other


def test_rows_with_different_adapters_in_one_batch_each_answer_as_alone(
    server: ServerProcess,
) -> None:
    mixes: list[list[dict[str, float]]] = [
        [],
        [{"id": 0, "scale": 1.0}],
        [{"id": 1, "scale": 1.0}],
        [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.5}],
    ]
    alone = [tokens(server, n=24, lora=m, cache_prompt=False) for m in mixes]
    together: list[Any] = [None] * len(mixes)
    start = threading.Barrier(len(mixes))

    def run(i: int) -> None:
        start.wait()
        together[i] = tokens(server, n=24, lora=mixes[i], cache_prompt=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(mixes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    assert len({tuple(t) for t in alone}) == len(mixes)  # four different answers


def test_posted_scales_change_only_requests_admitted_afterwards(server: ServerProcess) -> None:
    base = tokens(server, n=64, cache_prompt=False)
    adapted = tokens(server, n=64, lora=[{"id": 0, "scale": 1.0}], cache_prompt=False)
    # A long stream admitted before the POST keeps the scales it was admitted with.
    body = {"prompt": PROMPT, "n_predict": 64, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "return_tokens": True, "cache_prompt": False}
    streamed: list[int] = []
    with httpx.stream("POST", f"{server.base_url}/completion", json=body, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                streamed += httpx.Response(200, content=line[6:]).json()["tokens"]
                break
        r_post = httpx.post(f"{server.base_url}/lora-adapters", json=[{"id": 0, "scale": 1}])
        assert r_post.status_code == 200 and r_post.json() == {"success": True}
        for line in lines:
            if line.startswith("data: "):
                streamed += httpx.Response(200, content=line[6:]).json()["tokens"]
    assert streamed == base
    assert tokens(server, n=64, cache_prompt=False) == adapted
    scales = [a["scale"] for a in httpx.get(f"{server.base_url}/lora-adapters").json()]
    assert scales == [1.0, 0.0]  # adapter 1 was not listed: 0, as llama-server
    # A request's own field overrides the global scales (unlisted adapters at 0).
    assert tokens(server, n=64, lora=[], cache_prompt=False) == base


def test_the_lora_field_works_on_the_openai_routes_and_with_choices(server: ServerProcess) -> None:
    def chat(lora: Any) -> str:
        body = {
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 12,
            "temperature": 0,
            "lora": lora,
        }
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    assert chat([{"id": 1, "scale": 1.0}]) != chat([])
    assert chat([{"id": 1, "scale": 0.0}]) == chat([])
    # Choices fork from the prompt's cache, read under the request's adapters.
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "n": 2}
    body["lora"] = [{"id": 1, "scale": 1.0}]
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    alone = httpx.post(f"{server.base_url}/v1/completions", json=body | {"n": 1}, timeout=120)
    base = httpx.post(f"{server.base_url}/v1/completions", json=body | {"lora": []}, timeout=120)
    assert texts == [alone.json()["choices"][0]["text"]] * 2
    assert texts[0] != base.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    ("route", "lora"),
    [
        ("/completion", [{"id": 2, "scale": 1.0}]),
        ("/completion", [{"id": 0, "scale": "big"}]),
        ("/completion", {"id": 0}),
        ("/v1/chat/completions", [{"id": -1, "scale": 1.0}]),
        ("/v1/completions", [{"id": 7}]),
    ],
)
def test_a_bad_lora_field_is_a_400_naming_it(server: ServerProcess, route: str, lora: Any) -> None:
    body: dict[str, Any] = {"lora": lora, "max_tokens": 2}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    r = httpx.post(f"{server.base_url}{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "lora" in r.text


@pytest.mark.parametrize("body", [[{"id": 5, "scale": 1.0}], [{"id": 0, "scale": None}], {"id": 0}])
def test_posting_bad_scales_is_a_400_and_changes_nothing(server: ServerProcess, body: Any) -> None:
    httpx.post(f"{server.base_url}/lora-adapters", json=[{"id": 1, "scale": 0.25}])
    r = httpx.post(f"{server.base_url}/lora-adapters", json=body)
    assert r.status_code == 400, r.text
    scales = [a["scale"] for a in httpx.get(f"{server.base_url}/lora-adapters").json()]
    assert scales == [0.0, 0.25]


def test_the_prompt_cache_never_serves_kv_read_under_other_adapters(
    server: ServerProcess,
) -> None:
    prompt = PROMPT + " dragon who guarded a mountain of gold and told riddles to travellers."
    adapter = [{"id": 0, "scale": 1.0}]
    fresh = complete(server, prompt=prompt, lora=adapter, cache_prompt=False, return_tokens=True)
    base = complete(server, prompt=prompt, return_tokens=True)  # donates the base model's KV
    assert base["tokens"] != fresh["tokens"]
    again = complete(server, prompt=prompt, lora=adapter, return_tokens=True)
    assert again["timings"]["cache_n"] == 0  # the base entry is not this request's
    assert again["tokens"] == fresh["tokens"]
    # The same adapters do share their entries.
    warm = complete(server, prompt=prompt, lora=adapter, return_tokens=True)
    assert warm["timings"]["cache_n"] > 0
    assert warm["tokens"] == fresh["tokens"]


def _start(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", "--port", "0", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_adapter_that_does_not_fit_the_model_stops_start_up(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Adapting a layer the tiny llama has, with the wrong input width.
    bad = build_tiny_adapter(tmp_path / "bad", seed=3)
    from mlxcel.models.mlx_setup import mx

    weights = mx.load(str(bad / "adapters.safetensors"))
    assert isinstance(weights, dict)
    name = "model.layers.0.self_attn.q_proj.lora_a"
    weights[name] = mx.zeros((7, 4))
    mx.save_safetensors(str(bad / "adapters.safetensors"), weights)
    done = _start(["-m", str(tiny_model_dir), "--lora", str(bad)])
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --lora") and "q_proj" in last and "Traceback" not in done.stderr
    missing = _start(["-m", str(tiny_model_dir), "--lora", str(tmp_path / "nowhere")])
    assert missing.returncode != 0
    assert missing.stderr.strip().splitlines()[-1].startswith("error: --lora")


def test_a_slot_read_under_adapters_is_not_saved_and_a_base_one_is(
    server: ServerProcess,
) -> None:
    complete(server, id_slot=0, lora=[{"id": 0, "scale": 1.0}])
    r = httpx.post(f"{server.base_url}/slots/0?action=save", json={"filename": "a.bin"})
    assert r.status_code == 400 and "LoRA" in r.json()["error"]["message"], r.text
    complete(server, id_slot=1)
    r = httpx.post(f"{server.base_url}/slots/1?action=save", json={"filename": "b.bin"})
    assert r.status_code == 200 and r.json()["n_saved"] > 0, r.text


def test_generation_settings_and_props_show_the_scales_a_request_runs_with(
    server: ServerProcess,
) -> None:
    httpx.post(f"{server.base_url}/lora-adapters", json=[{"id": 1, "scale": 0.5}])
    own = complete(server, n=2, lora=[{"id": 0, "scale": 1.0}])["generation_settings"]["lora"]
    assert own == [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]
    given = complete(server, n=2)["generation_settings"]["lora"]
    assert given == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]
    props = httpx.get(f"{server.base_url}/props").json()
    assert props["default_generation_settings"]["params"]["lora"] == given

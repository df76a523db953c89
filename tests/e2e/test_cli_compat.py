"""A llama-server launch line serves, and its -t is honoured (OpenBLAS threads per matmul)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.conftest import ServerProcess


def test_llama_server_flags_start_a_server_and_t_sets_the_blas_threads(
    tiny_model_dir: Path,
) -> None:
    args = ["-m", str(tiny_model_dir), "-ngl", "99", "-fa", "on", "--jinja", "-t", "1"]
    server = ServerProcess([*args, "--metrics", "--no-warmup"])
    try:
        metrics = httpx.get(f"{server.base_url}/metrics").text
        r = httpx.post(
            f"{server.base_url}/completion", json={"prompt": "Hi", "n_predict": 2}, timeout=60
        )
    finally:
        server.stop()
    assert r.status_code == 200 and r.json()["tokens_predicted"] >= 1
    assert "mlxcel_blas_threads 1.0" in metrics


def test_chat_template_file_replaces_the_models_template(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    template = (
        "{% for m in messages %}<<{{ m.role }}: {{ m.content }}>>{% endfor %}"
        "{% if add_generation_prompt %}<<assistant:{% endif %}"
    )
    f = tmp_path / "plain.jinja"
    f.write_text(template)
    server = ServerProcess(["-m", str(tiny_model_dir), "--chat-template-file", str(f), "--props"])
    try:
        base = server.base_url
        chat = {"messages": [{"role": "user", "content": "Hello"}]}
        prompt = httpx.post(f"{base}/apply-template", json=chat).json()["prompt"]
        props = httpx.get(f"{base}/props").json()
        r = httpx.post(f"{base}/v1/chat/completions", json={**chat, "max_tokens": 2}, timeout=60)
    finally:
        server.stop()
    assert prompt == "<<user: Hello>><<assistant:"
    assert props["chat_template"] == template
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0

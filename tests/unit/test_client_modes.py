"""Mode selection, binary discovery and the managed server's command line, without a server."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import mlxcel
from mlxcel.client._managed import ManagedServer, default_socket_path, find_binary
from mlxcel.client.errors import MlxcelError, MlxcelServerError, MlxcelTimeoutError


def test_error_hierarchy() -> None:
    assert issubclass(MlxcelTimeoutError, MlxcelServerError)
    assert issubclass(MlxcelServerError, MlxcelError)
    assert MlxcelServerError("boom", stderr="last line").stderr == "last line"
    assert mlxcel.MlxcelTimeoutError is MlxcelTimeoutError


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"model": "m", "base_url": "http://x/v1"}, "not both"),
        ({"base_url": "http://x/v1", "socket": "/tmp/s.sock"}, "not both"),
        ({}, "nothing to run or connect to"),
        ({"base_url": "http://x/v1", "ctx_size": 512}, "ctx_size= configures a server"),
        ({"socket": "/tmp/s.sock", "extra_args": ["-np", "2"]}, "extra_args= configures"),
    ],
)
@pytest.mark.parametrize("cls", [mlxcel.LLM, mlxcel.AsyncLLM])
def test_ambiguous_or_missing_mode_is_an_error(
    cls: type, args: dict[str, object], match: str
) -> None:
    with pytest.raises(MlxcelError, match=match):
        cls(**args)


def test_model_with_transport_is_an_error() -> None:
    import httpx

    with pytest.raises(MlxcelError, match="not both"):
        mlxcel.LLM("m", transport=httpx.MockTransport(lambda r: httpx.Response(200)))


def test_binary_discovery_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "mlxcel"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    monkeypatch.setenv("MLXCEL_BIN", "/opt/env/mlxcel")
    assert find_binary("/explicit/mlxcel") == ["/explicit/mlxcel"]
    assert find_binary(["python3", "-m", "mlxcel"]) == ["python3", "-m", "mlxcel"]
    assert find_binary() == ["/opt/env/mlxcel"]
    monkeypatch.delenv("MLXCEL_BIN")
    assert find_binary() == [str(fake)]
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_binary() == [sys.executable, "-m", "mlxcel"]


def test_unix_socket_by_default_with_options_forwarded_verbatim() -> None:
    server = ManagedServer(
        "/models/m",
        binary="mlxcel",
        api_key="secret",
        ctx_size=512,
        n_predict=32,
        alias="a",
        warmup=False,
        extra_args=["--parallel", "2", "--odd flag"],
    )
    assert server.socket_path is not None
    assert server.socket_path.startswith(f"/tmp/mlxcel-{os.getpid()}-")
    assert server.socket_path.endswith(".sock")
    assert server.target.base_url == "http://localhost/v1"
    assert server.argv == [
        "mlxcel",
        "serve",
        "-m",
        "/models/m",
        "--host",
        server.socket_path,
        "--port",
        "0",
        "--ctx-size",
        "512",
        "--n-predict",
        "32",
        "--alias",
        "a",
        "--no-warmup",
        "--parallel",
        "2",
        "--odd flag",
    ]
    # The key travels in the environment only.
    assert "secret" not in " ".join(server.argv)
    assert server._env["LLAMA_API_KEY"] == "secret"
    assert default_socket_path() != default_socket_path()


def test_tcp_when_host_or_port_given() -> None:
    server = ManagedServer("m", binary="mlxcel", port=0, warmup=True)
    host, port = (
        server.argv[server.argv.index("--host") + 1],
        int(server.argv[server.argv.index("--port") + 1]),
    )
    assert host == "127.0.0.1" and port > 0  # a free ephemeral port
    assert server.socket_path is None
    assert server.target.base_url == f"http://127.0.0.1:{port}/v1"
    assert server.argv[-1] == "--warmup"
    for host, url in [("::1", "http://[::1]:9000/v1"), ("0.0.0.0", "http://127.0.0.1:9000/v1")]:
        assert ManagedServer("m", binary="mlxcel", host=host, port=9000).target.base_url == url


def test_socket_path_over_100_bytes_is_a_server_error() -> None:
    with pytest.raises(MlxcelServerError, match="100-byte"):
        mlxcel.LLM("m", socket="/tmp/" + "s" * 100 + ".sock")


def test_missing_binary_is_a_server_error_with_a_hint() -> None:
    with pytest.raises(MlxcelServerError, match="MLXCEL_BIN"):
        mlxcel.LLM("m", binary="/nonexistent/mlxcel")


def test_import_mlxcel_loads_only_the_client() -> None:
    import subprocess

    code = (
        "import sys, mlxcel\n"
        "assert mlxcel.LLM and mlxcel.AsyncLLM and mlxcel.__version__\n"
        "heavy = {'mlx', 'trio', 'quart', 'quart_trio', 'hypercorn', 'transformers',\n"
        "         'tokenizers', 'numpy', 'openai', 'httpx', 'attrs', 'cattrs'}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))\n"
        "print(sorted(m for m in sys.modules if m.startswith('mlxcel')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    loaded, ours = out.splitlines()
    assert loaded == "[]"
    assert all(
        m == "'mlxcel'" or m.startswith("'mlxcel.client") for m in ours.strip("[]").split(", ")
    ), ours


def test_socket_with_a_model_is_where_the_managed_server_binds() -> None:
    server = ManagedServer("m", binary="mlxcel", socket="/tmp/mine.sock")
    assert server.argv[3:] == ["m", "--host", "/tmp/mine.sock", "--port", "0"]
    with pytest.raises(MlxcelError, match="pass one"):
        ManagedServer("m", binary="mlxcel", socket="/tmp/mine.sock", port=8080)

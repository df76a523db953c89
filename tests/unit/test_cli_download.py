"""`mlxcel download` and `--offline`: a hub repo id is fetched into the Hugging Face hub cache,
or served from it without touching the network; what cannot be had is one line, exit 1, no
traceback. (This machine has no route to the hub: the online failure is the no-network one.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from mlxcel.models.default import default_gguf_path
from mlxcel.models.resolve import _choose_gguf
from tests.conftest import REPO, ServerProcess, free_port


def mlxcel(*args: str, hub: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(hub)}
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cached_repo(hub: Path, repo: str, source: Path) -> Path:
    """``source``'s files as the hub cache holds a downloaded repo: a snapshot folder and the
    ref that names it."""
    owner, name = repo.split("/")
    root = hub / f"models--{owner}--{name}"
    snapshot = root / "snapshots" / ("0" * 40)
    shutil.copytree(source, snapshot)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)
    return snapshot


def one_line_error(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, p.stderr
    return errors[0]


def test_download_of_a_repo_it_cannot_reach_is_one_line(tmp_path: Path) -> None:
    line = one_line_error(mlxcel("download", "no-such-owner/no-such-model", hub=tmp_path))
    assert "'no-such-owner/no-such-model' not found" in line
    assert "cannot be reached" in line or "no such repo" in line


def test_offline_never_touches_the_network(tmp_path: Path) -> None:
    line = one_line_error(
        mlxcel("download", "--offline", "no-such-owner/no-such-model", hub=tmp_path)
    )
    assert "offline" in line and "not in the local hub cache" in line


def test_not_a_repo_id_is_one_line(tmp_path: Path) -> None:
    line = one_line_error(mlxcel("download", "not a repo", hub=tmp_path))
    assert "is not a hub repo id" in line


def test_offline_finds_a_cached_repo_and_serves_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    snapshot = cached_repo(tmp_path, "tiny-owner/tiny-llama", tiny_model_dir)
    found = mlxcel("download", "--offline", "tiny-owner/tiny-llama", hub=tmp_path)
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == snapshot
    os.environ["HF_HUB_CACHE"] = str(tmp_path)
    try:
        server = ServerProcess(["-m", "tiny-owner/tiny-llama", "--offline", "--no-warmup"])
    finally:
        del os.environ["HF_HUB_CACHE"]
    try:
        r = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_serve_offline_without_the_repo_is_one_line(tmp_path: Path) -> None:
    args = ["serve", "--offline", "-m", "no-such-owner/no-such-model", "--port", str(free_port())]
    p = mlxcel(*args, hub=tmp_path)
    assert "Traceback" not in p.stderr
    assert "not in the local hub cache" in p.stderr
    assert p.returncode != 0


def cached_gguf_repo(hub: Path, repo: str, names: list[str]) -> Path:
    """A GGUF repository in the hub cache: each name a link to the packaged SmolLM2 GGUF."""
    owner, name = repo.split("/")
    root = hub / f"models--{owner}--{name}"
    snapshot = root / "snapshots" / ("1" * 40)
    snapshot.mkdir(parents=True)
    for file in names:
        (snapshot / file).symlink_to(default_gguf_path())
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("1" * 40)
    return snapshot


GGUF_FILES = ["smol-Q4_K_M.gguf", "smol-Q4_K_S.gguf", "smol-q8_0.gguf", "mmproj-smol-f16.gguf"]


def test_a_quant_tag_picks_the_gguf_file_as_llama_server_does(tmp_path: Path) -> None:
    snapshot = cached_gguf_repo(tmp_path, "someone/smol-GGUF", GGUF_FILES)
    tagged = mlxcel("download", "--offline", "someone/smol-GGUF:Q8_0", hub=tmp_path)
    assert tagged.returncode == 0, tagged.stderr
    assert Path(tagged.stdout.strip()) == snapshot / "smol-q8_0.gguf"  # case-insensitive
    untagged = mlxcel("download", "--offline", "someone/smol-GGUF", hub=tmp_path)
    assert untagged.returncode == 0, untagged.stderr
    assert Path(untagged.stdout.strip()) == snapshot / "smol-Q4_K_M.gguf"  # llama's default
    line = one_line_error(mlxcel("download", "--offline", "someone/smol-GGUF:Q4_K", hub=tmp_path))
    # Q4_K is not Q4_K_M: the whole tag must match, and the error lists what there is
    assert "no Q4_K file" in line and "smol-Q4_K_M.gguf" in line and "smol-q8_0.gguf" in line


def test_a_tagged_gguf_repo_is_served(tmp_path: Path) -> None:
    cached_gguf_repo(tmp_path, "someone/smol-GGUF", GGUF_FILES)
    os.environ["HF_HUB_CACHE"] = str(tmp_path)
    try:
        server = ServerProcess(["-m", "someone/smol-GGUF:Q4_K_M", "--offline", "--no-warmup"])
    finally:
        del os.environ["HF_HUB_CACHE"]
    try:
        models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
        assert models["data"][0]["id"] == "someone/smol-GGUF:Q4_K_M"
        r = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_a_split_gguf_is_fetched_whole_and_named_by_its_first_part(tmp_path: Path) -> None:
    parts = ["big-Q4_K_M-00001-of-00002.gguf", "big-Q4_K_M-00002-of-00002.gguf"]
    assert (
        _choose_gguf("someone/big-GGUF", [*reversed(parts), "big-Q8_0.gguf"], "Q4_K_M")
        == (parts[0])
    )
    snapshot = cached_gguf_repo(tmp_path, "someone/big-GGUF", [*parts, "big-Q8_0.gguf"])
    got = mlxcel("download", "--offline", "someone/big-GGUF:Q4_K_M", hub=tmp_path)
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()) == snapshot / parts[0]
    # A part missing from the cache: the download names it, as for any missing file.
    (snapshot / parts[1]).unlink()
    line = one_line_error(mlxcel("download", "--offline", "someone/big-GGUF:Q4_K_M", hub=tmp_path))
    assert parts[1] in line and "not in the local hub cache" in line

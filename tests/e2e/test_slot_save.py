"""`POST /slots/{id}?action=save|restore|erase` with `--slot-save-path`, and `id_slot` on
requests, against the embedded default model: a restored slot serves a later prompt from its
cache, with the same greedy answer as when that prompt was read from scratch."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from mlxcel.http import slot_files
from mlxcel.runtime.messages import SlotState
from tests.conftest import ServerProcess

PROMPT = "The three primary colors are red, yellow and blue. Mixing red and yellow gives"


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def server(save_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["-np", "2", "-c", "512", "--slot-save-path", str(save_dir)])
    yield server
    server.stop()


def complete(server: ServerProcess, **fields: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "ignore_eos": True, **fields}
    r = httpx.post(f"{server.base_url}/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def action(server: ServerProcess, slot: int | str, what: str, **body: Any) -> httpx.Response:
    url = f"{server.base_url}/slots/{slot}?action={what}"
    return httpx.post(url, json=body or None, timeout=60)


def test_save_erase_restore_round_trip(server: ServerProcess, save_dir: Path) -> None:
    cold = complete(server, id_slot=1)
    assert cold["id_slot"] == 1
    assert cold["timings"]["cache_n"] == 0
    n_prompt = cold["tokens_evaluated"]

    saved = action(server, 1, "save", filename="colors.bin")
    assert saved.status_code == 200, saved.text
    out = saved.json()
    assert list(out) == ["id_slot", "filename", "n_saved", "n_written", "timings"]
    assert out["id_slot"] == 1 and out["filename"] == "colors.bin"
    # The prompt and what was generated after it.
    assert out["n_saved"] >= n_prompt + cold["tokens_predicted"] - 1
    assert out["n_written"] == (save_dir / "colors.bin").stat().st_size
    assert out["timings"]["save_ms"] > 0

    erased = action(server, 1, "erase")
    assert erased.status_code == 200, erased.text
    assert erased.json() == {"id_slot": 1, "n_erased": out["n_saved"]}
    # Nothing cached any more: the whole prompt is read again.
    again = complete(server, id_slot=1)
    assert again["timings"]["cache_n"] == 0
    assert action(server, 1, "erase").status_code == 200

    restored = action(server, 0, "restore", filename="colors.bin")
    assert restored.status_code == 200, restored.text
    back = restored.json()
    assert list(back) == ["id_slot", "filename", "n_restored", "n_read", "timings"]
    assert back["id_slot"] == 0 and back["n_restored"] == out["n_saved"]
    assert back["n_read"] == out["n_written"] and back["timings"]["restore_ms"] > 0

    warm = complete(server, id_slot=0)
    assert warm["id_slot"] == 0
    # All of the prompt but its last token comes from the restored KV state ...
    assert warm["timings"]["cache_n"] == n_prompt - 1
    assert warm["timings"]["prompt_n"] == 1
    # ... and it is the very state the prompt had: the greedy answer is the same.
    assert warm["content"] == cold["content"]


def test_erasing_a_slot_never_used_erases_nothing(server: ServerProcess) -> None:
    fresh = action(server, 0, "erase")
    assert fresh.status_code == 200
    assert fresh.json()["id_slot"] == 0


@pytest.mark.parametrize(
    ("slot", "what", "body", "message"),
    [
        (0, "save", {"filename": "../escape.bin"}, "Invalid filename"),
        (0, "save", {"filename": ""}, "Invalid filename"),
        (0, "restore", {"filename": "sub/x.bin"}, "Invalid filename"),
        (0, "restore", {"filename": "never-saved.bin"}, "Unable to restore slot"),
        (9, "erase", {}, "Invalid slot ID"),
        ("x", "erase", {}, "Invalid slot ID"),
        (0, "fly", {}, "Invalid action"),
    ],
)
def test_bad_slot_actions_are_400(
    server: ServerProcess, slot: int | str, what: str, body: dict[str, Any], message: str
) -> None:
    r = action(server, slot, what, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]


def test_a_corrupt_save_file_is_a_400_and_the_slot_still_serves(
    server: ServerProcess, save_dir: Path
) -> None:
    (save_dir / "corrupt.bin").write_bytes(b"not a slot file")
    r = action(server, 0, "restore", filename="corrupt.bin")
    assert r.status_code == 400
    assert "invalid slot save file" in r.json()["error"]["message"]
    assert complete(server, id_slot=0)["id_slot"] == 0


def test_a_saved_prompt_longer_than_the_context_is_refused(
    server: ServerProcess, save_dir: Path
) -> None:
    complete(server, id_slot=1)
    assert action(server, 1, "save", filename="short.bin").status_code == 200
    # The same model's file, grown past the context (512): only the length check can refuse it.
    data = (save_dir / "short.bin").read_bytes()
    n_head = int.from_bytes(data[len(slot_files.MAGIC) : len(slot_files.MAGIC) + 8], "little")
    start = len(slot_files.MAGIC) + 8
    header = json.loads(data[start : start + n_head])
    n = 513
    arrays = [np.zeros((*a["shape"][:2], n, a["shape"][3]), a["dtype"]) for a in header["arrays"]]
    state = SlotState(tuple([1] * n), tuple(arrays[0::2]), tuple(arrays[1::2]))
    slot_files.write(save_dir / "long.bin", state, header["model"])
    r = action(server, 0, "restore", filename="long.bin")
    assert r.status_code == 400
    assert "Restored prompt does not fit in the slot context" in r.json()["error"]["message"]


def test_a_slot_in_use_is_busy(server: ServerProcess) -> None:
    # Long enough that it is still running when the action arrives: a sampled answer that falls
    # into a loop is drafted by n-gram speculation many tokens a step.
    body = {"prompt": PROMPT, "n_predict": 400, "ignore_eos": True, "stream": True, "id_slot": 1}
    with httpx.stream("POST", f"{server.base_url}/completion", json=body, timeout=120) as s:
        lines = s.iter_lines()
        # A few tokens in, not just the first: right after the first token the slot was seen
        # free for a moment (twice in CI, its cache then held the prompt and one token; the
        # cause is not found yet, see the notes of 2026-12-04).
        seen = [next(lines) for _ in range(8)]
        r = action(server, 1, "save", filename="busy.bin")
        assert r.status_code == 503, (seen[-1], r.text)
        assert r.json()["error"]["message"] == "Requested slot is processing"


@pytest.mark.parametrize("route", ["/completion", "/v1/completions", "/v1/chat/completions"])
def test_id_slot_past_the_last_slot_is_a_400(server: ServerProcess, route: str) -> None:
    body: dict[str, Any] = {"max_tokens": 1, "id_slot": 2}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r = httpx.post(f"{server.base_url}{route}", json=body, timeout=60)
    assert r.status_code == 400
    assert "slot" in r.json()["error"]["message"].lower()


def test_chat_runs_in_the_slot_it_names(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "id_slot": 1}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_without_a_save_path_slot_actions_are_501(tiny_server: ServerProcess) -> None:
    for what in ("save", "restore", "erase"):
        r = httpx.post(f"{tiny_server.base_url}/slots/0?action={what}", json={"filename": "a.bin"})
        assert r.status_code == 501
        error = r.json()["error"]
        assert error["type"] == "not_supported_error"
        assert error["message"] == (
            "This server does not support slots action. Start it with `--slot-save-path`"
        )

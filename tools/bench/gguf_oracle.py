#!/usr/bin/env python
"""llama.cpp's answers on the tiny GGUF of each served architecture, recorded for the suite.

    .venv/bin/python tools/bench/gguf_oracle.py              # every model in tiny_gguf.MODELS
    .venv/bin/python tools/bench/gguf_oracle.py qwen3 phi3   # some (merged into the record)

For each model of ``tests/support/tiny_gguf.py`` it writes the file, starts ``llama-server``
on it (``llama_server.find_or_build``; 127.0.0.1, a free port, one slot of the model's ``ctx``
tokens, recorded as ``ctx``: LongRoPE's factors depend on it) and records into
``tests/data/gguf_oracle.json``:

- ``tokenize``: ``/tokenize`` of ``TEXT`` (no BOS, special tokens parsed);
- ``prompt``: the token ids of ``PROMPT`` with llama.cpp's own BOS rule;
- ``greedy``: the 16 tokens ``/completion`` gives for them at temperature 0;
- ``top``: for each of those steps, the top-10 next-token log-probabilities (``n_probs``,
  a softmax of the raw logits); null for a step whose token ends inside a UTF-8 character,
  which llama-server reports no probabilities for.

``tests/unit/test_gguf_oracle.py`` regenerates the same files (checked by ``sha256``), runs
them through mlxcel and compares. The suite machines have no llama.cpp; rerun this whenever
a tiny model, the texts or llama.cpp change, and commit the JSON.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "bench"))

import llama_server  # noqa: E402 - after sys.path

from tests.support.tiny_gguf import MODELS, sha256, write_tiny_gguf  # noqa: E402 - after sys.path

RECORD = ROOT / "tests" / "data" / "gguf_oracle.json"
# Accents, CJK, Greek/Cyrillic/Arabic, emoji with modifiers and ZWJ, code, runs of spaces,
# tabs and newlines, digits, contractions, and the special-token spellings of the vocabularies.
TEXT = (
    "Hello world! Café naïve résumé — Zürich, 東京タワー, Ελληνικά, Привет, مرحبا.\n"
    "emoji 🙂🚀👍🏽 and ZWJ 👩‍💻  \n\n"
    "def f(x):\n    return x ** 2  # I'm done, you'LL see\n\t\tprint('hi')\r\n"
    "In 2024, 3.14159 apples cost $12.50;   1234567   end  \n"
    "<|im_start|>user [INST] <start_of_turn>model\n"
)
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,"
N_PREDICT, N_PROBS = 16, 10
# A float32 KV cache and no flash attention (its default is float16 for both): with F32
# weights llama.cpp then computes in float32 throughout, as mlxcel does on the CPU.
FLOAT32 = ("--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off")


def _post(port: int, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ask(gguf: Path, ctx: int) -> dict[str, Any]:
    """llama-server's answers for one file served with a context of ``ctx`` tokens (see the
    module doc)."""
    port = _free_port()
    with tempfile.TemporaryFile() as log:
        proc = llama_server.start(gguf, port, parallel=1, ctx=ctx, extra=FLOAT32, log_file=log)
        try:
            llama_server.wait_ready(port, 120, proc)
            tokens = _post(
                port, "/tokenize", {"content": TEXT, "add_special": False, "parse_special": True}
            )["tokens"]
            prompt = _post(
                port, "/tokenize", {"content": PROMPT, "add_special": True, "parse_special": True}
            )["tokens"]
            done = _post(
                port,
                "/completion",
                {
                    "prompt": prompt,
                    "n_predict": N_PREDICT,
                    "temperature": 0.0,
                    "n_probs": N_PROBS,
                    "ignore_eos": True,
                    "cache_prompt": False,
                    "return_tokens": True,
                },
            )
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise
        finally:
            proc.terminate()
            proc.wait(30)
    greedy = done["tokens"]
    # llama-server holds back a token that ends inside a UTF-8 character and reports only the
    # probabilities of the token that completes it: those steps have none (null).
    top: list[Any] = [None] * len(greedy)
    at = 0
    for step in done["completion_probabilities"]:
        at = greedy.index(step["id"], at)
        top[at] = [[t["id"], round(t["logprob"], 6)] for t in step["top_logprobs"]]
        at += 1
    return {"tokenize": tokens, "prompt": prompt, "greedy": greedy, "top": top}


def _dumps(record: dict[str, Any]) -> str:
    """The record as JSON with one line per model field (reviewable diffs, small file)."""

    def line(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    head = [f" {line(k)}: {line(v)}" for k, v in record.items() if k != "models"]
    models = []
    for name, fields in record["models"].items():
        body = ",\n".join(f"   {line(k)}: {line(v)}" for k, v in fields.items())
        models.append(f"  {line(name)}: {{\n{body}\n  }}")
    return "{\n" + ",\n".join([*head, ' "models": {\n' + ",\n".join(models) + "\n }"]) + "\n}\n"


def main(names: list[str]) -> int:
    record: dict[str, Any] = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    record.update(
        {
            "llama_cpp": f"{llama_server.PACKAGE}=={llama_server.VERSION} sources, "
            + llama_server.version(llama_server.find_or_build()).splitlines()[0],
            "text": TEXT,
            "prompt_text": PROMPT,
        }
    )
    models = record.setdefault("models", {})
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or list(MODELS):
            gguf = write_tiny_gguf(name, Path(tmp) / f"{name}.gguf")
            llama_server.log(f"{name}: asking llama-server")
            ctx = MODELS[name].ctx
            models[name] = {"sha256": sha256(gguf), "ctx": ctx, **ask(gguf, ctx)}
    record["models"] = dict(sorted(models.items()))
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(_dumps(record), encoding="utf-8")
    llama_server.log(f"wrote {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

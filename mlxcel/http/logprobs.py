"""Log-probabilities in each API's wire shape: OpenAI chat, OpenAI legacy, llama-server native.

Every token comes with its exact bytes: a token can be a fragment of a UTF-8 character, and
then its text is shown as `bytes:\\xNN...` as OpenAI does, while `bytes` carries the truth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mlxcel.actors.token_bytes import token_bytes
from mlxcel.runtime.slot import TokenLogprob


def _text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _piece(tok: Any, token_id: int) -> tuple[str, list[int]]:
    data = token_bytes(tok, token_id)
    return _text(data), list(data)


def _scored(tok: Any, token_id: int, logprob: float, with_id: bool) -> dict[str, Any]:
    text, raw = _piece(tok, token_id)
    entry: dict[str, Any] = {"id": token_id} if with_id else {}
    entry.update({"token": text, "logprob": logprob, "bytes": raw})
    return entry


def _entries(tok: Any, entries: Sequence[TokenLogprob], with_id: bool) -> list[dict[str, Any]]:
    """Each token with its alternatives; llama-server's shape adds the token ids."""
    return [
        {
            **_scored(tok, e.token, e.logprob, with_id),
            "top_logprobs": [_scored(tok, t, lp, with_id) for t, lp in e.top],
        }
        for e in entries
    ]


def chat_content(tok: Any, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    return _entries(tok, entries, with_id=False)


def chat(tok: Any, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": chat_content(tok, entries), "refusal": None}


def legacy(tok: Any, entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy completions shape; ``offset`` is where these tokens' text starts."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for e in entries:
        text, _ = _piece(tok, e.token)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        top_logprobs.append({_piece(tok, t)[0]: lp for t, lp in e.top})
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def native(tok: Any, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """llama-server's `completion_probabilities` (n_probs)."""
    return _entries(tok, entries, with_id=True)


def as_probs(entries: list[dict[str, Any]], *, greedy: bool = False) -> list[dict[str, Any]]:
    """llama-server's ``post_sampling_probs`` shape: ``prob`` and ``top_probs`` in place of
    ``logprob`` and ``top_logprobs``. The values are the model's probabilities (this server
    scores tokens before the sampler's truncation), except under greedy decoding
    (temperature 0), where sampling leaves one candidate: the chosen token has probability 1
    and the others 0, as llama-server reports."""

    def one(e: dict[str, Any], chosen: Any) -> dict[str, Any]:
        out = {k: v for k, v in e.items() if k not in ("logprob", "top_logprobs")}
        if greedy:
            out["prob"] = 1.0 if (e.get("id"), e.get("token")) == chosen else 0.0
        else:
            out["prob"] = math.exp(e["logprob"])
        if "top_logprobs" in e:
            out["top_probs"] = [one(t, chosen) for t in e["top_logprobs"]]
        return out

    return [one(e, (e.get("id"), e.get("token"))) for e in entries]

"""llama-server's prompt forms, shared by /completion and the embedding routes.

A prompt is a string, a list of token ids, or a list mixing ids and strings (each string
encoded in place); a list of such prompts is several prompts, one result each.
"""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_mixed(value: list[Any]) -> bool:
    """Token ids and strings in one list: llama-server reads them as one prompt."""
    return any(is_int(v) for v in value) and any(isinstance(v, str) for v in value)


def encode_mixed(value: list[Any], tokenizer: Any) -> list[Any]:
    """Each string encoded where it stands; only a leading string gets the special prefix
    (BOS), as it would as a prompt of its own. Non-string items are left for the caller's
    token-id check."""
    out: list[Any] = []
    for i, v in enumerate(value):
        if isinstance(v, str):
            out.extend(tokenizer.encode(v, add_special_tokens=i == 0))
        else:
            out.append(v)
    return out

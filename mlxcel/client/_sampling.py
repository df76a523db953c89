"""Keyword arguments of generate/chat -> keyword arguments of the openai SDK's ``create``.

On the wire every field is a top-level JSON key. The split only decides *how* the SDK carries
it: as a named parameter (the OpenAI fields below) or through ``extra_body`` (llama-server
knobs such as ``top_k``, ``min_p``, ``repetition_penalty``, DRY/XTC, and any unknown keyword,
which is forwarded untouched so the server, not the client, decides what it supports).
An explicit ``extra_body={...}`` wins over a keyword of the same name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

Endpoint = Literal["chat", "completion"]

#: Passed as named SDK parameters (issue 6 §5).
TOP_LEVEL = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "n",
        "logprobs",
        "top_logprobs",
    }
)
# `completions.create` has no `top_logprobs` parameter and `response_format` is chat-only in
# the SDK: carried by extra_body there, which puts them at the same place in the JSON.
_NAMED: dict[Endpoint, frozenset[str]] = {
    "chat": TOP_LEVEL | {"response_format"},
    "completion": TOP_LEVEL - {"top_logprobs"},
}
#: The SDK's per-request options, not body fields.
REQUEST_OPTIONS = frozenset({"extra_headers", "extra_query", "timeout"})
_RESERVED = frozenset({"stream", "prompt", "messages"})


def build_params(endpoint: Endpoint, sampling: Mapping[str, Any]) -> dict[str, Any]:
    """Split ``sampling`` into the SDK's named parameters, request options and ``extra_body``.

    A keyword whose value is None is treated as not given. ``model`` is left in place (a
    per-call override of the resolved id).
    """
    bad = _RESERVED & sampling.keys()
    if bad:
        raise TypeError(f"{sorted(bad)[0]!r} is set by the method itself; it cannot be a keyword")
    n = sampling.get("n")
    if n is not None and n != 1:
        # The helpers return (or stream) one text; a stream of n choices would interleave them.
        raise ValueError(
            f"n={n!r}: generate, chat and their streams return one text; for several choices "
            "call client.openai_client (the openai SDK) with n"
        )
    named = _NAMED[endpoint]
    params: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in sampling.items():
        if key == "extra_body" or value is None:
            continue
        if key in named or key in REQUEST_OPTIONS or key == "model":
            params[key] = value
        else:
            extra[key] = value
    explicit = sampling.get("extra_body")
    if explicit:
        for key in explicit.keys() - REQUEST_OPTIONS:
            params.pop(key, None)  # the explicit extra_body wins, not the SDK's merge order
        extra.update(explicit)
    if extra:
        params["extra_body"] = extra
    return params

"""Sampling fields on the wire (OpenAI names, llama.cpp names and aliases) -> SamplingParams.

Every generation route shares these fields; they arrive as top-level JSON keys (the OpenAI
SDK's `extra_body`). A field the client leaves out takes the server's default (the `--temp`,
`--top-k`, ... flags, as llama-server does). Out-of-range values are a 400 naming the field,
before any work starts.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import SamplingParams
from mlxcel.runtime.sampling_rules import validate


@attrs.frozen(kw_only=True)
class SamplingFields:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    repetition_penalty: float | None = None
    repeat_penalty: float | None = None
    repetition_context_size: int | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: Any = None
    logit_bias: Any = None
    seed: int | None = None


_SAME = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "typical_p",
    "top_n_sigma",
    "xtc_probability",
    "xtc_threshold",
    "presence_penalty",
    "frequency_penalty",
    "dry_multiplier",
    "dry_allowed_length",
    "dry_penalty_last_n",
)


def _logit_bias(value: Any, tokenizer: Any = None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} or llama.cpp's [[id, bias | false], ...] (false bans).

    As llama-server, a key that is not a token id is text: the bias goes to every token of
    its encoding (``[[" the", -100]]``, ``{" the": -100}``)."""
    pairs: list[tuple[Any, Any]]
    keyed = isinstance(value, dict)
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise InvalidRequest("logit_bias must map token ids to biases", param="logit_bias")
    out: list[tuple[int, float]] = []
    for token, bias in pairs:
        # An integer, or (as an object key, which JSON makes a string) its decimal string;
        # never a float or a boolean that int() would quietly round or turn into 1.
        if keyed and isinstance(token, str) and token.lstrip("-").isdigit():
            if len(token) >= 20:
                raise InvalidRequest(
                    f"logit_bias key {token[:40]!r} is not a token id", param="logit_bias"
                )
            ids = [int(token)]
        elif isinstance(token, int) and not isinstance(token, bool):
            ids = [token]
        elif isinstance(token, str) and token and tokenizer is not None:
            ids = list(tokenizer.encode(token, add_special_tokens=False))
        else:
            raise InvalidRequest(
                f"logit_bias key {str(token)[:40]!r} is not a token id or text",
                param="logit_bias",
            )
        if bias is False:
            bias = -math.inf
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidRequest(f"logit_bias for {token!r} must be a number", param="logit_bias")
        try:
            out.extend((token_id, float(bias)) for token_id in ids)
        except OverflowError:  # an integer too large for a float
            raise InvalidRequest(
                f"logit_bias for {token!r} must be a finite number", param="logit_bias"
            ) from None
    return tuple(out)


def sampling_params(
    body: SamplingFields, defaults: SamplingParams, vocab_size: int | None, tokenizer: Any = None
) -> SamplingParams:
    """``tokenizer`` encodes logit_bias keys given as text (without it they are a 400)."""
    values: dict[str, Any] = {f: getattr(body, f) for f in _SAME if getattr(body, f) is not None}
    # Errors name the field as the client spelled it.
    spelled: dict[str, str] = {}
    for name, alias in (
        ("repetition_penalty", "repeat_penalty"),
        ("repetition_context_size", "repeat_last_n"),
    ):
        if getattr(body, name) is not None:
            values[name] = getattr(body, name)
        elif getattr(body, alias) is not None:
            values[name] = getattr(body, alias)
            spelled[name] = alias
    if "top_n_sigma" in values and values["top_n_sigma"] < 0:
        values["top_n_sigma"] = 0.0  # llama.cpp's -1: off
    if body.dry_base is not None:
        # llama-server's rule: a base below 1 falls back to the default.
        values["dry_base"] = body.dry_base if body.dry_base >= 1.0 else defaults.dry_base
    if body.dry_sequence_breakers is not None:
        breakers = body.dry_sequence_breakers
        if (
            not isinstance(breakers, list)
            or not all(isinstance(b, str) and b for b in breakers)
            or not breakers
        ):
            raise InvalidRequest(
                "dry_sequence_breakers must be a non-empty list of non-empty strings",
                param="dry_sequence_breakers",
            )
        values["dry_sequence_breakers"] = tuple(breakers)
    if body.logit_bias is not None:
        values["logit_bias"] = _logit_bias(body.logit_bias, tokenizer)
    if body.seed is not None:
        if body.seed < -1:
            raise InvalidRequest("seed must be -1 (random) or a non-negative integer", param="seed")
        values["seed"] = None if body.seed == -1 else body.seed
    params = attrs.evolve(defaults, **values)
    try:
        validate(params, vocab_size=vocab_size)
    except ValueError as error:
        field, _, why = str(error).partition(": ")
        wire = spelled.get(field, field)
        raise InvalidRequest(f"{wire} {why}", param=wire) from None
    return params

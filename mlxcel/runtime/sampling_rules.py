"""Range checks for sampling settings: pure, so the HTTP layer can reject a request (400 naming
the field) before any work, and the compute thread can trust what it gets."""

from __future__ import annotations

import math

from mlxcel.runtime.messages import SamplingParams as SamplerConfig

# Stop strings a request may give (OpenAI's limit is 4; llama-server takes any number).
MAX_STOP_STRINGS = 16


def validate(config: SamplerConfig, *, vocab_size: int | None = None) -> None:
    """Raise ValueError("<field>: <why>") for the first out-of-range setting."""

    def check(ok: bool, field: str, why: str) -> None:
        if not ok:
            raise ValueError(f"{field}: {why}")

    def finite(field: str) -> float:
        value = float(getattr(config, field))
        check(math.isfinite(value), field, "must be a finite number")
        return value

    check(finite("temperature") >= 0.0, "temperature", "must be >= 0")
    check(0.0 <= finite("top_p") <= 1.0, "top_p", "must be in [0, 1]")
    check(config.top_k >= 0, "top_k", "must be >= 0")
    check(0.0 <= finite("min_p") <= 1.0, "min_p", "must be in [0, 1]")
    check(0.0 < finite("typical_p") <= 1.0, "typical_p", "must be in (0, 1]")
    check(finite("top_n_sigma") >= 0.0, "top_n_sigma", "must be >= 0")
    check(0.0 <= finite("xtc_probability") <= 1.0, "xtc_probability", "must be in [0, 1]")
    check(0.0 <= finite("xtc_threshold") <= 0.5, "xtc_threshold", "must be in [0, 0.5]")
    check(finite("repetition_penalty") > 0.0, "repetition_penalty", "must be > 0")
    check(config.repetition_context_size >= -1, "repetition_context_size", "must be >= -1")
    finite("presence_penalty")
    finite("frequency_penalty")
    check(finite("dry_multiplier") >= 0.0, "dry_multiplier", "must be >= 0")
    check(finite("dry_base") >= 0.0, "dry_base", "must be >= 0")
    check(config.dry_allowed_length >= 0, "dry_allowed_length", "must be >= 0")
    check(config.dry_penalty_last_n >= -1, "dry_penalty_last_n", "must be >= -1")
    for token, bias in config.logit_bias:
        in_range = token >= 0 and (vocab_size is None or token < vocab_size)
        check(in_range, "logit_bias", f"token id {token} is out of range")
        # -inf bans a token; NaN and +inf have no meaning.
        check(
            not math.isnan(bias) and bias != math.inf,
            "logit_bias",
            f"bias for {token} is not a number",
        )
    if config.seed is not None:
        check(0 <= config.seed < 2**64, "seed", "must be in [0, 2**64)")

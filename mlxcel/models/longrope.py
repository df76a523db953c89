"""LongRoPE (Phi-3 128k and 3.5, Phi-4-mini): which factors run, chosen for the served context.

A LongRoPE checkpoint carries two sets of per-frequency divisors: ``short_factor``, for
contexts within ``original_max_position_embeddings``, and ``long_factor``, for beyond it.
llama.cpp picks one set per context, not per sequence: the long factors when the context per
sequence (``-c``, over ``--parallel`` slots) exceeds the original context (its
``n_ctx_orig_yarn``), else the short ones (``llama_model::get_rope_factors``); every position
of every request then rotates with that set. mlx-lm's ``SuScaledRoPE`` always runs the long
ones, which moves every logit of a model served within its original context. So the choice is
made when the model loads, for the context it will serve (``--ctx-size``, or the model's own):
``choose`` picks as llama.cpp does and ``apply`` puts the divisors, and the attention factor
when the config names one (``attention_factor``: a GGUF's ``rope.scaling.attn_factor``, which
llama.cpp multiplies into cos and sin whichever set runs), into each SuScaledRoPE module.
"""

from __future__ import annotations

from typing import Any

from mlxcel.models import mlx_lm_compat
from mlxcel.models.mlx_setup import mx

__all__ = ["apply", "choose"]

_KINDS = ("longrope", "su")


def choose(scaling: dict[str, Any], original: int, ctx: int) -> tuple[str, list[float]]:
    """Which factors of the ``rope_scaling`` block llama.cpp runs for a context of ``ctx``
    tokens per sequence: ("long", factors) when ``ctx`` exceeds the ``original`` context,
    else ("short", factors)."""
    if ctx > original:
        return "long", [float(f) for f in scaling["long_factor"]]
    return "short", [float(f) for f in scaling["short_factor"]]


def apply(model: Any, config: dict[str, Any], ctx: int) -> str | None:
    """Set every SuScaledRoPE of ``model`` to the factors ``choose`` picks for ``ctx``; which
    set that was, or None when the model has no LongRoPE."""
    from mlx_lm.models.rope_utils import SuScaledRoPE

    scaling = config.get("rope_scaling")
    if not isinstance(scaling, dict) or scaling.get("type") not in _KINDS:
        return None
    if "short_factor" not in scaling or "long_factor" not in scaling:
        return None  # one set only: nothing to choose
    ropes = [m for _, m in model.named_modules() if isinstance(m, SuScaledRoPE)]
    if not ropes:
        return None
    which, factors = choose(scaling, _original(config, scaling), ctx)
    found = scaling.get("attention_factor")
    scale = None if found is None else float(found)
    base = float(config.get("rope_theta", 10000.0))
    for rope in ropes:
        # As SuScaledRoPE computes its own, so the long set gives mlx-lm's array bit for bit.
        dims = rope.dim
        freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        mlx_lm_compat.set_longrope(rope, mx.array(factors, dtype=mx.float32) * freqs, scale)
    return which


def _original(config: dict[str, Any], scaling: dict[str, Any]) -> int:
    # HF Phi-3 configs name it at the top level; mlx-lm's generic longrope, in the block.
    found = scaling.get("original_max_position_embeddings")
    if found is None:
        found = config.get("original_max_position_embeddings", 4096)
    return int(found)

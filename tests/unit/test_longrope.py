"""Phi-3 LongRoPE: the factors llama.cpp runs for the served context, and the GGUF mapping.

llama.cpp runs ``rope_factors_long`` when the context per sequence exceeds
``rope.scaling.original_context_length``, else ``rope_factors_short``; mlx-lm always runs the
long ones. ``test_gguf_oracle.py`` checks the numbers against llama-server on either side of
that line (``phi3-longrope``: 512 > 256, long; ``phi3-longrope-short``: 256, short); these
pin the choice and the mapping on their own, so a swap names itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.gguf_arch import config_from_metadata, convert_tensor
from mlxcel.models.longrope import choose
from mlxcel.models.mlx_setup import mx

_SCALING = {"type": "longrope", "long_factor": [4.0, 8.0], "short_factor": [1.5, 2.0]}


@pytest.mark.parametrize(
    ("ctx", "which", "factors"),
    [(255, "short", [1.5, 2.0]), (256, "short", [1.5, 2.0]), (257, "long", [4.0, 8.0])],
)
def test_long_factors_run_only_beyond_the_original_context(
    ctx: int, which: str, factors: list[float]
) -> None:
    assert choose(_SCALING, 256, ctx) == (which, factors)


def _phi3_md(**extra: Any) -> dict[str, Any]:
    md: dict[str, Any] = {
        "general.architecture": "phi3",
        "phi3.embedding_length": 64,
        "phi3.block_count": 2,
        "phi3.feed_forward_length": 128,
        "phi3.attention.head_count": 4,
        "phi3.attention.head_count_kv": 4,
        "phi3.attention.layer_norm_rms_epsilon": 1e-5,
        "phi3.context_length": 131072,
        "phi3.rope.dimension_count": 16,
        "phi3.rope.scaling.original_context_length": 4096,
        "tokenizer.ggml.tokens": ["a", "b"],
    }
    md.update(extra)
    return md


def test_gguf_factor_tensors_become_the_longrope_block() -> None:
    long = mx.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 48.0, 64.0])
    short = mx.array([1.0, 1.0, 1.5, 1.5, 2.0, 2.0, 2.5, 3.0])
    md = _phi3_md(**{"phi3.rope.scaling.attn_factor": 1.190238})
    config = config_from_metadata(md, tied=False, rope_factors=(long, short))
    assert config["rope_scaling"] == {
        "type": "longrope",
        "long_factor": long.tolist(),
        "short_factor": short.tolist(),
        "original_max_position_embeddings": 4096,
        "attention_factor": 1.190238,
    }
    assert config["original_max_position_embeddings"] == 4096  # mlx-lm's phi3 reads this one
    # The tensors are in the config now, not weights of the model.
    assert convert_tensor("rope_factors_long.weight", long, config) is None
    assert convert_tensor("rope_factors_short.weight", short, config) is None
    # No attn_factor key: llama.cpp scales by 1, not by mlx-lm's default for 131072 / 4096.
    config = config_from_metadata(_phi3_md(), tied=False, rope_factors=(long, None))
    assert config["rope_scaling"]["attention_factor"] == 1.0
    assert config["rope_scaling"]["short_factor"] == [1.0] * 8  # absent: no factors at all


def test_longrope_factors_are_refused_where_they_do_not_belong() -> None:
    factors = (mx.ones(8), mx.ones(8))
    with pytest.raises(UnsupportedModel, match="8 of them for 4 frequencies"):
        md = _phi3_md(**{"phi3.rope.dimension_count": 8})
        config_from_metadata(md, tied=False, rope_factors=factors)
    llama = {k.replace("phi3.", "llama."): v for k, v in _phi3_md().items()}
    llama["general.architecture"] = "llama"
    del llama["llama.rope.dimension_count"]
    with pytest.raises(UnsupportedModel, match="llama with LongRoPE factors"):
        config_from_metadata(llama, tied=False, rope_factors=factors)


@pytest.mark.parametrize(("ctx", "which"), [(256, "short"), (512, "long"), (0, "long")])
def test_loaded_phi3_rotates_with_the_factors_for_its_context(
    ctx: int, which: str, tmp_path: Path
) -> None:
    """The tiny LongRoPE Phi-3 (original context 256, its own 4096): each attention's rope
    divides by the chosen factors and scales by the file's attention factor."""
    from gguf import GGUFReader
    from mlx_lm.models.rope_utils import SuScaledRoPE

    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model
    from tests.support.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf("phi3-longrope", tmp_path / "phi3-longrope.gguf")
    reader = GGUFReader(str(gguf))
    tensors = {t.name: mx.array(t.data) for t in reader.tensors}
    want = tensors[f"rope_factors_{which}.weight"]
    other = tensors[f"rope_factors_{'short' if which == 'long' else 'long'}.weight"]
    attn_factor = float(reader.fields["phi3.rope.scaling.attn_factor"].contents())
    loaded = load_model(resolve_model(str(gguf), tmp_path / "cache"), ctx_size=ctx)
    ropes = [m for _, m in loaded.model.named_modules() if isinstance(m, SuScaledRoPE)]
    assert len(ropes) == 2  # one per layer
    base = 10000.0 ** (mx.arange(0, 16, 2, dtype=mx.float32) / 16)
    for rope in ropes:
        assert mx.array_equal(rope._freqs, want * base)
        assert not mx.allclose(rope._freqs, other * base)
        assert rope._scale == pytest.approx(attn_factor, rel=1e-6)


def test_the_server_loads_for_its_context_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """--ctx-size reaches the loader: a LongRoPE model's factors depend on it."""
    from mlxcel import server
    from mlxcel.models import loader, resolve
    from mlxcel.runtime.settings import Settings

    class Loaded(Exception):
        pass

    seen: list[int] = []

    def load_model(resolved: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("ctx_size", 0))
        raise Loaded

    monkeypatch.setattr(resolve, "resolve_model", lambda *args: None)
    monkeypatch.setattr(loader, "load_model", load_model)
    with pytest.raises(Loaded):
        server.build_mlx_backend(Settings(model="tiny.gguf", ctx_size=256))
    assert seen == [256]

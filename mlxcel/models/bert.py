"""BERT-family encoders in mlx.nn: BERT, RoBERTa / XLM-RoBERTa, and their sequence classifiers.

Parameter names follow the Hugging Face checkpoints after ``sanitize`` (which only renames the
``attention.self`` scope, a Python keyword-like name, and drops buffers), so safetensors load
strictly: a wrong name or shape fails loudly. Everything runs in float32. On the CPU, GELU,
LayerNorm and attention go through ``fast_math`` (mlx's own are scalar loops there); on a GPU
through mlx's own kernels, which are fused there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.nn as nn

from mlxcel.models import device, fast_math
from mlxcel.models.mlx_setup import mx

__all__ = ["BertConfig", "BertModel", "BertForSequenceClassification", "sanitize"]

_ROBERTA = {"roberta", "xlm-roberta", "camembert"}


class BertConfig:
    def __init__(self, config: dict[str, Any]) -> None:
        self.model_type = str(config.get("model_type", "bert"))
        self.vocab_size = int(config["vocab_size"])
        self.hidden_size = int(config["hidden_size"])
        self.num_hidden_layers = int(config["num_hidden_layers"])
        self.num_attention_heads = int(config["num_attention_heads"])
        self.intermediate_size = int(config["intermediate_size"])
        self.max_position_embeddings = int(config.get("max_position_embeddings", 512))
        self.type_vocab_size = int(config.get("type_vocab_size", 2))
        self.layer_norm_eps = float(config.get("layer_norm_eps", 1e-12))
        self.hidden_act = str(config.get("hidden_act", "gelu"))
        self.pad_token_id = int(config.get("pad_token_id") or 0)
        labels = config.get("id2label")
        self.num_labels = int(config.get("num_labels") or (len(labels) if labels else 1))
        # RoBERTa counts positions from pad_token_id + 1 (padding positions sit at pad id).
        self.position_offset = self.pad_token_id + 1 if self.model_type in _ROBERTA else 0


def _act(name: str) -> Callable[[mx.array], mx.array]:
    if name in ("gelu", "gelu_python"):
        return fast_math.gelu if device.on_cpu() else nn.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return nn.gelu_approx
    if name == "relu":
        return nn.relu
    if name in ("silu", "swish"):
        return nn.silu
    raise ValueError(f"unsupported hidden_act {name!r}")


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters) computed by ``fast_math.layer_norm`` (BLAS means) on
    the CPU, by mlx's fused kernel elsewhere."""

    def __call__(self, x: mx.array) -> mx.array:
        if not device.on_cpu():
            return mx.fast.layer_norm(x, self.weight, self.bias, self.eps)
        return fast_math.layer_norm(x, self.weight, self.bias, self.eps)


class Embeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self._offset = c.position_offset

    def __call__(self, ids: mx.array, types: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None, :] + self._offset
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings(types)
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, d = x.shape
        h = self.heads

        def split(t: mx.array) -> mx.array:
            return t.reshape(b, n, h, d // h).transpose(0, 2, 1, 3)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        attend = fast_math.attention if device.on_cpu() else mx.fast.scaled_dot_product_attention
        out = attend(q, k, v, scale=(d // h) ** -0.5, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(b, n, d)


class DenseNorm(nn.Module):
    """``dense`` then dropout (a no-op here) then ``LayerNorm(x + residual)``."""

    def __init__(self, c: BertConfig, dims_in: int) -> None:
        super().__init__()
        self.dense = nn.Linear(dims_in, c.hidden_size)
        self.LayerNorm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(c)
        self.output = DenseNorm(c, c.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        return self.output(self.attn(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self._act = _act(c.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self._act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attention = Attention(c)
        self.intermediate = Intermediate(c)
        self.output = DenseNorm(c, c.intermediate_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = [Layer(c) for _ in range(c.num_hidden_layers)]

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class Pooler(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)

    def __call__(self, hidden: mx.array) -> mx.array:
        return mx.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    """The encoder: token ids -> last hidden states ``[batch, tokens, hidden]``."""

    def __init__(self, config: BertConfig, *, pooler: bool = False) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        if pooler:
            self.pooler = Pooler(config)

    def __call__(self, ids: mx.array, types: mx.array, attention_mask: mx.array) -> mx.array:
        # Additive mask over keys: padding gets a large negative, so softmax ignores it.
        mask = mx.where(attention_mask[:, None, None, :] > 0, 0.0, -1e9).astype(mx.float32)
        return self.encoder(self.embeddings(ids, types), mask)


class ClassificationHead(nn.Module):
    """RoBERTa's head: dense + tanh on the first token, then out_proj."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.out_proj = nn.Linear(c.hidden_size, c.num_labels)

    def __call__(self, hidden: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(hidden[:, 0])))


class BertForSequenceClassification(nn.Module):
    """A cross-encoder: (query, document) pairs -> logits ``[batch, num_labels]``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.roberta_head = config.model_type in _ROBERTA
        self.bert = BertModel(config, pooler=not self.roberta_head)
        self.classifier: ClassificationHead | nn.Linear
        if self.roberta_head:
            self.classifier = ClassificationHead(config)
        else:
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def __call__(self, ids: mx.array, types: mx.array, attention_mask: mx.array) -> mx.array:
        hidden = self.bert(ids, types, attention_mask)
        if self.roberta_head:
            return self.classifier(hidden)
        return self.classifier(self.bert.pooler(hidden))


def sanitize(weights: dict[str, mx.array], *, classifier: bool) -> dict[str, mx.array]:
    """Map checkpoint names onto ours: ``attention.self`` -> ``attention.attn``, drop buffers.

    Encoder checkpoints come bare (``embeddings.*``) or prefixed (``bert.*``, ``roberta.*``);
    classifiers keep the backbone under ``bert.`` and the head as ``classifier.*``.
    """
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.endswith(("position_ids", "token_type_ids")):
            continue
        name = name.replace(".attention.self.", ".attention.attn.")
        for prefix in ("bert.", "roberta.", "model."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if classifier:
            if not name.startswith("classifier."):
                name = "bert." + name
        elif name.startswith(("pooler.", "classifier.", "cls.", "lm_head.")):
            continue
        out[name] = value
    return out

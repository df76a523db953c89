"""Gemma 2's attention masks as llama.cpp applies them, which mlx-lm's ``gemma2`` gets wrong.

- The sliding window: Gemma 2 attends over the last ``sliding_window`` tokens (4,096) on every
  other layer, the even ones (0, 2, ...), and over the whole context on the odd ones; HF's
  ``Gemma2Attention`` and llama.cpp (``set_swa_pattern(2)``, standard SWA: a query at
  position p sees keys at p - window + 1 .. p) agree. mlx-lm's ``gemma2`` gives every layer
  the full causal mask, the same only while a sequence is shorter than the window.
- A batch's mask: with grouped heads mlx-lm's gemma2 attention computes its scores as
  [batch, kv heads, group, queries, keys], but a batch cache's mask is [batch, 1, queries,
  keys]; broadcast from the right, its batch axis lands on the kv heads, so a left-padded row
  got another row's padding (or, batch and kv heads of unequal size, an error).

``install`` turns each layer of a loaded gemma2 model into a ``Gemma2Block``: a sliding layer
builds its own windowed mask from its own cache (``create_attention_mask`` with
``window_size``: a plain, batched or quantised KV cache, left padding included), and every
layer gives a batch mask its group axis. The caches stay plain KV caches, so the prompt
cache, row reuse and speculation (which take tokens back, as a rotating cache cannot) work as
for any model; keys beyond the window are kept and masked, as before, rather than bounded as
gemma3's rotating caches are.
"""

from __future__ import annotations

from typing import Any

__all__ = ["install", "sliding_layers"]


def sliding_layers(n_layers: int) -> list[int]:
    """The layers of a Gemma 2 model that attend over a window: the even ones."""
    return [i for i in range(n_layers) if i % 2 == 0]


def install(model: Any, config: dict[str, Any]) -> int:
    """Make the layers of ``model`` (mlx-lm's gemma2 ``Model``; anything else is left alone)
    ``Gemma2Block``s, the sliding ones with the window ``config["sliding_window"]``; how many
    layers slide."""
    from mlx_lm.models import gemma2

    if config.get("model_type") != "gemma2" or not isinstance(model, gemma2.Model):
        return 0
    window = config.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise ValueError(f"gemma2 config has no usable sliding_window ({window!r})")
    cls = _block_class()
    layers = model.layers
    sliding = set(sliding_layers(len(layers)))
    for i, layer in enumerate(layers):
        if type(layer) is not gemma2.TransformerBlock:
            raise TypeError(f"gemma2 layer {i} is a {type(layer).__name__}, not mlx-lm's block")
        layer.__class__ = cls
        layer.sliding_window = window if i in sliding else None
    return len(sliding)


_BLOCK: Any = None


def _block_class() -> Any:
    # Defined on first use: importing mlx_lm's model modules at import time would load mlx.
    global _BLOCK
    if _BLOCK is None:
        from mlx_lm.models.base import create_attention_mask
        from mlx_lm.models.gemma2 import TransformerBlock

        class Gemma2Block(TransformerBlock):
            """mlx-lm's gemma2 block with llama.cpp's mask: over the last ``sliding_window``
            tokens (None: all of them), per row of a batch."""

            sliding_window: int | None

            def __call__(self, x: Any, mask: Any = None, cache: Any = None) -> Any:
                if self.sliding_window is not None:
                    # The model hands every layer the full causal mask; this layer's own
                    # cache knows its offset and left padding (before this call adds x).
                    mask = create_attention_mask(
                        x, cache, window_size=self.sliding_window, return_array=True
                    )
                if mask is not None and mask.ndim == 4 and self.self_attn.repeats > 1:
                    mask = mask[:, :, None]  # [batch, 1, 1, queries, keys]: per row
                return super().__call__(x, mask, cache)

        _BLOCK = Gemma2Block
    return _BLOCK

"""The vision cache (``--vision-cache-size``): an image sent again is not encoded again.

A multi-turn chat about one screenshot sends the same image with every turn. The vision tower
(a ViT: for a real VLM most of an image request's compute before its first token) gives the
same features for the same pixels, so its outputs are kept, keyed by a digest of its inputs
(the processor's pixels and the family's grid or patch mask: identical flattened patches can
sit in different layouts), least recently used dropped first.

It wraps the model's tower module itself (``vision_tower`` or ``vision_model``, the attribute
each mlx-vlm family calls), so it works for every family without knowing how each merges the
features into the prompt. mlx-vlm's own ``VisionFeatureCache`` needs a family to offer
``encode_image(s)``, which Qwen2-VL and Idefics3 do not.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import numpy as np

from mlxcel.models.mlx_setup import mx

# The attributes mlx-vlm's families keep their vision tower under.
TOWER_NAMES = ("vision_tower", "vision_model")


class CachedTower:
    """Calls the wrapped tower, or answers from the cache when its inputs were seen."""

    def __init__(self, tower: Any, size: int) -> None:
        self.tower = tower
        self.size = size
        self.hits = 0
        self.misses = 0
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = _digest(args, kwargs)
        if key in self._cache:
            self._cache.move_to_end(key)
            self.hits += 1
            return self._cache[key]
        self.misses += 1
        out = self.tower(*args, **kwargs)
        mx.eval(out)  # kept evaluated: a lazy graph would hold the inputs alive
        self._cache[key] = out
        while len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return out

    def __getattr__(self, name: str) -> Any:
        # Families read the tower's own attributes (its dtype through a weight, its config).
        if name == "tower":  # not set yet (a copy being built): no recursion through it
            raise AttributeError(name)
        return getattr(self.tower, name)


def install(model: Any, size: int) -> CachedTower | None:
    """Wrap ``model``'s vision tower in a cache of ``size`` entries (0: no cache)."""
    if size <= 0:
        return None
    for name in TOWER_NAMES:
        tower = getattr(model, name, None)
        if tower is not None:
            cached = CachedTower(tower, size)
            # An instance attribute is found before the module's child of the same name (mlx
            # modules keep children in their dict), and parameters() still walk the tower.
            object.__setattr__(model, name, cached)
            return cached
    return None


def _digest(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name, value in [("", a) for a in args] + sorted(kwargs.items()):
        h.update(name.encode())
        if isinstance(value, mx.array):
            data = np.asarray(value)
            h.update(f"{data.dtype}{data.shape}".encode())
            h.update(np.ascontiguousarray(data).tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()

"""Slots on the compute thread: what each slot last cached, and context shifts.

Our slots are positions in the batch (``/slots``), not KV buffers of their own: a sequence's KV
lives in the batch while it runs, and when it ends it is donated to the shared prompt cache
(keyed by tenant and tokens). So "a slot's cache" is that donation: ``SlotCaches`` remembers,
per slot, the tenant and tokens of the last sequence that ended in it. Saving copies that
prompt-cache entry out of mlx (numpy arrays: the file is written off this thread); restoring
installs a file's entry into the prompt cache as the slot's; erasing drops the slot's entry.
A later request whose prompt starts with those tokens is served from the entry, in whichever
slot it runs, as every prompt-cache hit is.

Context shift (``--context-shift``): a row that fills its context leaves the batch and joins
again with its first ``n_keep`` tokens and its newest ones, read again from scratch. llama.cpp
instead moves the kept keys to their new positions (its K cache can be re-rotated in place);
mlx-lm's caches hold keys already rotated by RoPE at their old positions, and re-rotating them
is model-specific (RoPE variants, scaling), so reading the kept tokens again is the general
and exact way. It costs one prefill of at most ``n_ctx`` tokens per shift (docs/reference/
http-api.md, "Context shift", has the figure).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxcel.actors.model_runner.eager_start import PrimedGenerationBatch
from mlxcel.actors.model_runner.prompt_cache import PromptCache
from mlxcel.models.lora import LORA_TAG
from mlxcel.runtime.lora import UNSAVABLE_SLOT
from mlxcel.runtime.messages import SlotAction, SlotState

log = logging.getLogger(__name__)


@attrs.frozen
class _Held:
    key: str
    tokens: tuple[int, ...]


class SlotCaches:
    def __init__(self, parallel: int, cache: PromptCache | None, n_layers: int) -> None:
        self._held: list[_Held | None] = [None] * parallel
        self._cache = cache
        self._n_layers = n_layers

    def donated(self, slot: int, key: str | None, tokens: list[int]) -> None:
        """A sequence that ran in ``slot`` ended and left these tokens' cache (or none)."""
        if 0 <= slot < len(self._held):
            self._held[slot] = _Held(key, tuple(tokens)) if key is not None else None

    def apply(self, action: SlotAction) -> None:
        reply = action.reply
        tic = time.perf_counter()
        try:
            if action.kind == "save":
                self._save(action)
            elif action.kind == "restore":
                self._restore(action)
            else:
                held = self._held[action.slot]
                if held is not None and self._cache is not None:
                    self._cache.remove(held.key, list(held.tokens))
                reply.n_tokens = len(held.tokens) if held is not None else 0
                self._held[action.slot] = None
        except Exception as error:  # a bad file or an unexpected cache kind: this action only
            reply.error = f"{type(error).__name__}: {error}"
        log.info(
            "slot %d %s: %d tokens, %.1f ms on the model runner's thread",
            action.slot,
            action.kind,
            reply.n_tokens,
            (time.perf_counter() - tic) * 1000,
        )

    def _save(self, action: SlotAction) -> None:
        held = self._held[action.slot]
        if held is not None and LORA_TAG in held.key:
            raise ValueError(UNSAVABLE_SLOT)
        entry, n_held = None, 0
        if held is not None and self._cache is not None:
            entry, n_held = self._cache.entry(held.key, list(held.tokens))
        if held is None or entry is None or n_held == 0:  # never used, erased, or evicted
            action.reply.state = SlotState((), (), ())
            return
        keys, values = [], []
        for layer in entry:
            if type(layer) is not KVCache:
                raise ValueError(f"slot save supports plain KV caches, not {type(layer).__name__}")
            n = layer.offset
            assert layer.keys is not None and layer.values is not None  # stored entries hold KV
            k = layer.keys if layer.keys.shape[2] == n else layer.keys[..., :n, :]
            v = layer.values if layer.values.shape[2] == n else layer.values[..., :n, :]
            mx.eval(k, v)
            # Views, not copies: each holds its mlx array (immutable, never donated while
            # referenced), so the file is written from them off this thread. Copying here
            # stalled every slot's decoding ~0.1 s per 1000 tokens of the default model.
            keys.append(np.asarray(k))
            values.append(np.asarray(v))
        action.reply.state = SlotState(held.tokens[:n_held], tuple(keys), tuple(values))
        action.reply.n_tokens = n_held

    def _restore(self, action: SlotAction) -> None:
        state = action.state
        assert state is not None
        if self._cache is None:
            raise ValueError("the prompt cache is off (--cache-ram 0): nothing can hold a slot")
        if not state.tokens:  # a slot saved empty restores to empty
            self._held[action.slot] = None
            return
        if len(state.keys) != self._n_layers:
            raise ValueError(f"{len(state.keys)} layers saved; this model has {self._n_layers}")
        layers = []
        for k, v in zip(state.keys, state.values, strict=True):
            layer = KVCache()
            layer.keys, layer.values = mx.array(k), mx.array(v)
            layer.offset = int(k.shape[2])
            layers.append(layer)
        self._cache.store("", list(state.tokens), layers)
        self._held[action.slot] = _Held("", state.tokens)
        action.reply.n_tokens = len(state.tokens)


def shifted(tokens: list[int], n_ctx: int, n_keep: int, n_discard: int, n_prompt: int) -> list[int]:
    """The tokens a full row goes on with: llama-server's shift (the first ``n_keep``, then
    all but the ``n_discard`` after them; by default half of what follows ``n_keep``)."""
    keep = n_prompt if n_keep < 0 else n_keep
    keep = max(0, min(n_ctx - 4, keep))
    left = len(tokens) - keep
    discard = n_discard if n_discard > 0 else left // 2
    discard = max(1, min(discard, left - 1))
    return tokens[:keep] + tokens[keep + discard :]


def row_state(batch: Any, uid: int, reported: int) -> tuple[int, list[int], bool] | None:
    """Where ``uid`` sits in the generation batch, every token of its sequence (the one just
    reported included), and whether that one was reported early (None: not there)."""
    try:
        i = batch.uids.index(uid)
    except ValueError:
        return None
    tokens = list(batch.tokens[i])
    # A token reported early (eager start) is not in the row's tokens yet.
    early = isinstance(batch, PrimedGenerationBatch) and batch.reported_early(i)
    if early:
        tokens.append(reported)
    return i, tokens, early

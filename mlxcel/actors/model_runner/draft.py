"""Draft-model proposals (``--model-draft``): a smaller model with the same tokenizer guesses the
next tokens of a row, greedily, and the batch step checks them like n-gram proposals.

Each row keeps its own cache in the draft model, holding the row's tokens as the draft last
saw them: on the next proposal only what changed since (the tokens the target accepted, its
correction) is read, after trimming what the target rejected. A row's first proposal reads
its whole prompt in the draft (chunks of 512), so a long prompt costs one draft prefill.

Greedy drafting makes each proposal a fixed token sequence, so the verification rule is the
same as for n-grams (``speculative_batch``); drafting stops early where the draft's own top
probability falls under ``--draft-p-min`` (llama-server's rule: an unsure draft is usually
wrong, and each drafted token costs a draft pass).
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

_CHUNK = 512


class DraftModel:
    def __init__(self, model: Any, *, p_min: float, min_tokens: int) -> None:
        if not can_trim_prompt_cache(make_prompt_cache(model)):
            raise ValueError("its cache cannot take tokens back (a sliding window or state)")
        self.model = model
        self.p_min = p_min
        self.min_tokens = min_tokens

    def row(self) -> DraftRow:
        return DraftRow(make_prompt_cache(self.model))


class DraftRow:
    """One row's cache in the draft model, and the tokens it holds."""

    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache
        self.tokens: list[int] = []

    def propose(self, draft: DraftModel, history: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens the draft expects after ``history`` (the row's tokens and its
        pending one); none when fewer than ``--draft-min`` would come."""
        if limit <= 0 or limit < draft.min_tokens:
            return []
        same = 0
        for a, b in zip(self.tokens, history, strict=False):
            if a != b:
                break
            same += 1
        same = min(same, len(history) - 1)  # the last token is read again for its logits
        if len(self.tokens) > same:
            trim_prompt_cache(self.cache, len(self.tokens) - same)
        fresh = history[same:]
        self.tokens = list(history)
        logits = None
        for start in range(0, len(fresh), _CHUNK):
            logits = draft.model(mx.array([fresh[start : start + _CHUNK]]), cache=self.cache)
        assert logits is not None
        out: list[int] = []
        while True:
            probs = mx.softmax(logits[0, -1].astype(mx.float32))
            token = mx.argmax(probs)
            top = probs[token]
            mx.eval(token, top)
            if cast(float, top.item()) < draft.p_min:
                break
            out.append(cast(int, token.item()))
            if len(out) == limit:
                break
            logits = draft.model(mx.array([[out[-1]]]), cache=self.cache)
            self.tokens.append(out[-1])
        return out if len(out) >= draft.min_tokens else []

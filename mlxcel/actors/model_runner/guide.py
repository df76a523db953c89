"""Per-sequence guidance inside the batch: grammar masks and the thinking budget.

A ``Guide`` is one more mlx-lm logits processor on the rows that need it (a grammar, or a
thinking budget on a template that thinks); every other row has none and pays nothing. mlx-lm
calls it with the row's context (prompt + generated tokens, the last one being the token this
step reads) and its ``[1, V]`` logits. The guide first submits the forward pass, then reads the
tokens it has not seen yet (a host sync on the previous step's draw), advances its state and
computes its mask while the device runs the forward pass, and returns the logits masked:

- thinking budget: while inside a thinking block, count tokens; once the budget is spent, force
  the end-of-thinking marker's tokens one per step (everything else -inf);
- grammar: an llguidance matcher's token bitmask. With a prompt that leaves thinking open, the
  grammar starts after the end-of-thinking marker. When the grammar is complete the matcher
  allows only end-of-sequence.

A matcher error never raises into the batch step (that would fail every row): the guide
records it and forces end-of-sequence, and the backend reports the sequence as failed.

Markers are matched as token sequences; real thinking models emit them as single special
tokens, so a marker spelled out in other pieces is not recognised.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any, cast

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import fill_next_token_bitmask

log = logging.getLogger(__name__)

_NEG_INF = float("-inf")


class GuideKit:
    """What every guide of one model shares: the llguidance tokenizer (built once, in the
    background at load, since it takes about a second), bit-unpacking tables, the markers."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        vocab_size: int,
        eos_token_ids: list[int],
        think: tuple[tuple[int, ...], tuple[int, ...]] | None,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos = eos_token_ids[0] if eos_token_ids else 0
        self.think = think
        ids = mx.arange(vocab_size, dtype=mx.uint32)
        self._ids = ids
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llguidance-tok")
        self._ll = pool.submit(_ll_tokenizer, hf_tokenizer, vocab_size, eos_token_ids)
        pool.shutdown(wait=False)

    @property
    def ll_tokenizer(self) -> LLTokenizer:
        return self._ll.result()

    def unpack(self, bitmask: np.ndarray) -> mx.array:
        """[W] int32 words -> [V] bool allowed (numpy's unpackbits on the host is ~5x faster
        than gathering and shifting the words on the device here)."""
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: self.vocab_size]
        return mx.array(bits.astype(np.bool_))

    def only(self, token: int) -> mx.array:
        return self._ids == token

    def guide(
        self,
        *,
        grammar: str | None,
        budget: int | None,
        reasoning_open: bool,
        controllable: bool = False,
    ) -> Guide | None:
        """A guide for one sequence, or None when nothing needs guiding. ``controllable``:
        the reasoning may be ended on request (``Guide.end_thinking``), budget or not."""
        # A budget means nothing for a template without thinking markers: nothing to close.
        limited = budget is not None and budget >= 0
        thinking = self.think if limited or controllable else None
        if grammar is None and thinking is None:
            return None
        try:
            matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0) if grammar else None
            error = matcher.get_error() if matcher is not None and matcher.is_error() else None
        except Exception as exc:  # a failed tokenizer build: this sequence fails, not the batch
            matcher, error = None, f"{type(exc).__name__}: {exc}"
        guide = Guide(
            self,
            matcher=matcher,
            budget=budget if thinking is not None and limited else None,
            reasoning_open=reasoning_open and self.think is not None,
        )
        if error is not None:
            guide.fail(error)
        return guide


def _ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos: list[int]) -> LLTokenizer:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)


class Guide:
    """One sequence's guidance state; called by mlx-lm on the compute thread only."""

    def __init__(
        self, kit: GuideKit, *, matcher: LLMatcher | None, budget: int | None, reasoning_open: bool
    ) -> None:
        self._kit = kit
        self._matcher = matcher
        self._budget = budget
        self._thinking = reasoning_open
        self._used = 0
        self._forcing: list[int] = []  # marker tokens still to force, next first
        # A grammar waits for thinking to end when the prompt leaves it open.
        self._armed = not reasoning_open
        self._tail: list[int] = []
        self._base: int | None = None
        self._bitmask = np.full((1, (kit.vocab_size + 31) // 32), -1, dtype=np.int32)
        self.error: str | None = None
        if budget == 0 and reasoning_open and kit.think is not None:
            self._forcing = list(kit.think[1])

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        try:
            return self._guided(context, logits)
        except Exception as error:  # never into the batch step: that would fail every row
            self.fail(f"{type(error).__name__}: {error}")
            return self._force(logits, self._kit.eos)

    def _guided(self, context: mx.array, logits: mx.array) -> mx.array:
        n = int(context.shape[0])
        if self._base is None:
            self._base = n  # the first call reads the prompt's last token: nothing generated
        elif n > self._base:
            # Start this step's forward pass before waiting for last step's token, so the
            # device computes it while this thread computes the mask (as vLLM overlaps them).
            mx.async_eval(logits)
            new = cast(list[int], context[self._base :].tolist())  # a 1-d int array
            for token in new:
                self._observe(int(token))
            self._base = n
        if self.error is not None:
            return self._force(logits, self._kit.eos)
        if self._forcing:
            return self._force(logits, self._forcing[0])
        if self._matcher is None or not self._armed:
            return logits
        fill_next_token_bitmask(self._matcher, self._bitmask)
        if self._matcher.is_error():
            self.fail(self._matcher.get_error())
            return self._force(logits, self._kit.eos)
        allowed = self._kit.unpack(self._bitmask[0])
        return mx.where(allowed, logits, _NEG_INF)

    def _force(self, logits: mx.array, token: int) -> mx.array:
        return mx.where(self._kit.only(token), logits, _NEG_INF)

    def rebase(self, unseen: int | None) -> None:
        """The row goes on from a shorter context (a context shift): the next call's context
        ends with the last token sampled. ``unseen``: that token, when this guide has not
        read it yet (a row that reported it early)."""
        self._base = None
        if unseen is not None and self.error is None:
            self._observe(unseen)

    def end_thinking(self) -> None:
        """Close the thinking block now: its end marker is forced from the next token on.
        Before the block has opened, it will be closed as soon as it does."""
        end = self._kit.think[1] if self._kit.think is not None else None
        if end is None:
            return
        if self._thinking:
            if not self._forcing:
                self._forcing = list(end)
        else:
            self._budget = 0

    def fail(self, why: str) -> None:
        if self.error is None:
            self.error = f"Constrained decoding failed: {why}"
            log.warning("%s", self.error)

    def _observe(self, token: int) -> None:
        if self._forcing and token == self._forcing[0]:
            self._forcing.pop(0)
        think = self._kit.think
        if think is not None:
            start, end = think
            self._tail = (self._tail + [token])[-max(len(start), len(end)) :]
            if self._thinking:
                if self._tail[-len(end) :] == list(end):
                    self._thinking = False
                    self._forcing = []
                    if not self._armed:
                        self._armed = True
                        return  # the marker itself is not part of the constrained output
                else:
                    self._used += 1
                    if (
                        self._budget is not None
                        and self._used >= self._budget
                        and not self._forcing
                    ):
                        self._forcing = list(end)
            elif self._tail[-len(start) :] == list(start) and not self._armed_matcher_started():
                self._thinking = True
                if self._budget == 0:
                    self._forcing = list(end)
                return
        if self._matcher is not None and self._armed and self.error is None:
            if self._matcher.is_stopped():
                return  # end-of-sequence after a complete grammar
            if not self._matcher.consume_token(token):
                self.fail(self._matcher.get_error() or f"token {token} was not allowed")

    def _armed_matcher_started(self) -> bool:
        # Under a grammar the output is the grammar's from its first token: a marker that
        # appears inside it (a JSON string saying "<think>") is content, not thinking.
        return self._matcher is not None and self._armed

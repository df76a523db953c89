"""How much of the model runner's time reading prompts may take while rows are decoding.

mlx-lm's generator reads one chunk of every waiting prompt in each step, after the decode: on
this CPU a 512-token chunk takes 1-2 s, so while a 2,000-token prompt was read, 16 running
streams got 0.22x of their speed for ~9 s (docs/performance.md, "Engine speed"). Here prompt
reading runs on credit: decode time earns ``share / (1 - share)`` seconds of credit per second
(so reading takes at most ``share`` of the time while anything decodes), reading spends it,
and a step reads prompts only while the credit is positive. Credit is capped at ``burst``
seconds, which an idle spell fills: a short prompt arriving now and then (a chat turn) starts
at once; only a long prompt, or a flood of them, is spread out. While rows decode, a chunk is
also cut to about ``slice_s`` seconds of reading (from the measured prompt rate), so no step
holds the running streams for long. With nothing decoding, prompts are read at full speed.

A prompt marked urgent (a live voice turn, ``X-Priority: 0``) is read at once regardless, and
so is a short one (what is left of it fits in one such chunk): the budget is for long prompts,
since holding back a steady flow of ordinary turns would leave rows idle and lower everyone's
throughput.

Pure bookkeeping with the caller's clock readings: unit-tested without a model.
"""

from __future__ import annotations

import attrs

__all__ = ["PrefillBudget"]

# Chunks while rows decode: no fewer tokens per row than this (below it each pass is mostly
# reading the weights: a 16-token chunk costs ~0.15 s here, a 64-token one ~0.25 s).
MIN_CHUNK = 32


@attrs.define
class PrefillBudget:
    # Of the runner's time while rows decode; 1.0 (or more) turns the budget off.
    share: float = 0.2
    burst: float = 1.0
    slice_s: float = 0.5
    credit: float = attrs.field(init=False)
    # Prompt tokens read per second, smoothed; None until a chunk has been timed.
    rate: float | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self.credit = self.burst

    @property
    def off(self) -> bool:
        return self.share >= 1.0

    def may_read(self, decoding: bool, urgent: bool) -> bool:
        """Whether this step may read prompts (``urgent``: one waiting is exempt)."""
        if not decoding:
            self.credit = self.burst  # nobody to protect: an idle spell refills it
            return True
        return self.off or urgent or self.credit > 0

    def chunk(self, decoding: bool, rows: int, full: int) -> int:
        """Tokens per prompt row to read this step (``full`` is ``--prefill-chunk-size``)."""
        if not decoding or self.off or self.rate is None:
            return full
        per_row = int(self.rate * self.slice_s) // max(rows, 1)
        return max(min(full, MIN_CHUNK), min(full, per_row))

    def decoded(self, seconds: float) -> None:
        if not self.off:
            self.credit = min(self.burst, self.credit + seconds * self.share / (1 - self.share))

    def read(self, seconds: float, tokens: int, decoding: bool) -> None:
        """A step read ``tokens`` prompt tokens in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.rate = rate if self.rate is None else 0.7 * self.rate + 0.3 * rate
        if decoding and not self.off:
            self.credit -= seconds

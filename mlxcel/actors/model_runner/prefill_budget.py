"""How much of the model runner's time reading prompts may take while rows are decoding.

mlx-lm's generator reads one chunk of every waiting prompt in each step, after the decode: on
this CPU a 512-token chunk takes 1-2 s, so while a 2,000-token prompt was read, 16 running
streams got 0.22x of their speed for ~9 s (docs/performance.md, "Engine speed"). Here prompt
reading runs on credit: decode time earns ``s / (1 - s)`` seconds of credit per second (so
reading takes at most the share ``s`` of the time while anything decodes), reading spends it,
and a step reads prompts only while the credit is positive. Credit is capped at ``burst``
seconds, which an idle spell fills: a short prompt arriving now and then (a chat turn) starts
at once; only a long prompt, or a flood of them, is spread out. While rows decode, a chunk is
also cut to about ``slice_s`` seconds of reading (from the measured prompt rate), so no step
holds the running streams for long.

The share ``s`` is ``share`` (``--prefill-share``) or, when more rows wait to be read than that
gives them, each row's equal part of the time: with 1 row decoding and 15 prompts waiting,
reading gets 15/16. The configured share protects many running streams from a few long
prompts; held to it, a wave of arrivals beside a few running rows was read at a fifth of the
speed while the batch ran nearly empty (the 1B at 16 streams: 23 tok/s against 36 with no
budget, TTFT p50 15 s against 9.6 s; docs/performance.md, 2026-12-06). Chunks then grow so
that one decode step and one chunk keep that ratio.

With nothing decoding, prompts are read at full speed. A prompt marked urgent (a live voice
turn, ``X-Priority: 0``) is read at once regardless, and so is a short one (what is left of it
reads in ``burst`` seconds): the budget is for long prompts, since holding back a steady flow of
ordinary turns would leave rows idle and lower everyone's throughput. Short means read in
``burst`` seconds (~90 tokens of a 1B model here, ~600 of the 135M default): a chat turn of
60 tokens on the 1B, held to the share, waited ~4 s beside 15 running rows.

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
    # Seconds of one decode step, smoothed; None until one has been timed.
    step_s: float | None = attrs.field(default=None, init=False)
    # The share of this step (``rows``): the configured one or the rows' fair part.
    now: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.credit = self.burst
        self.now = self.share

    @property
    def off(self) -> bool:
        return self.share >= 1.0

    def rows(self, waiting: int, decoding: int) -> float:
        """Set this step's share from the rows whose prompts wait to be read and the rows
        decoding; return it."""
        fair = waiting / (waiting + decoding) if decoding > 0 else 1.0
        self.now = max(self.share, fair)
        return self.now

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
        seconds = self.slice_s
        if self.step_s is not None and self.now < 1.0:
            # One decode step and one chunk in the ratio of the share.
            seconds = max(seconds, self.step_s * self.now / (1 - self.now))
        per_row = int(self.rate * seconds) // max(rows, 1)
        return max(min(full, MIN_CHUNK), min(full, per_row))

    def short(self, decoding: bool, full: int) -> int:
        """Prompt tokens left that make a prompt short, read at once past the budget: what
        ``burst`` seconds read (the credit an idle spell gives), at most ``full``."""
        if not decoding or self.off or self.rate is None:
            return full
        return max(min(full, MIN_CHUNK), min(full, int(self.rate * self.burst)))

    def decoded(self, seconds: float) -> None:
        if seconds <= 0:
            return  # nothing decoded this step
        self.step_s = seconds if self.step_s is None else 0.7 * self.step_s + 0.3 * seconds
        if self.off or self.now >= 1.0:
            self.credit = self.burst
        else:
            self.credit = min(self.burst, self.credit + seconds * self.now / (1 - self.now))

    def read(self, seconds: float, tokens: int, decoding: bool) -> None:
        """A step read ``tokens`` prompt tokens in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.rate = rate if self.rate is None else 0.7 * self.rate + 0.3 * rate
        if decoding and not self.off:
            self.credit -= seconds

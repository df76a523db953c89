"""N-gram speculation's proposer and its adaptive policy (pure Python, no mlx).

A row proposes the continuation of the most recent earlier occurrence of its last few tokens
in its own prompt and output (prompt lookup): the longest suffix, 4 tokens down to 1, that
occurred before wins. The batch step then feeds each row its pending token plus its proposal,
and keeps what the model would have produced anyway (``speculative_batch``).

Whether a step speculates, and how far, is decided from two things measured as the server
runs, never from constants tuned on one machine:

- per row, how often its proposals are right (``RowStats``): a row that copies text accepts
  nearly everything; free writing accepts little, and such a row stops paying for checks;
- per batch shape, what a step costs (``StepCosts``): the time from one step's start to the
  next one's, for ``rows`` rows feeding ``width`` tokens each. On this CPU one row feeding 9
  tokens costs ~1.4x one feeding 1 (the weights are read once either way), while 4 rows
  feeding 5 cost ~1.5x 4 rows feeding 1 (the matmuls start to count): so the same acceptance
  pays for a long proposal at one row and a short one, or none, at several.

``Policy.width`` picks the proposal length with the most expected tokens per second, counting
each row's expected accepted tokens (``sum(a**m)`` for an acceptance rate ``a``), against the
step without speculation.

Looking costs too: a proposal needs the pending token on the host, and that sync loses the
overlap of the next step's graph building with the current one's compute (at one row of the
default model a step that looked and then decoded plainly costs ~1.2x one that did not look).
So whether to look at all is priced on its own (``Policy.gain_of_looking``): how often a look
finds a proposal (``RowStats.found_rate``; in free writing about half the looks find none),
what a looked-at plain step costs (width 0 in ``StepCosts``), against the plain step.
"""

from __future__ import annotations

import attrs

# Longest and shortest suffix looked up; a longer match predicts better and is tried first.
NGRAM_MAX = 4
NGRAM_MIN = 1
# Proposal lengths a step may use (capped by --spec-ngram-max). Few widths, so the step
# costs are learned after a few steps of each.
WIDTHS = (1, 2, 4, 8, 16)
# Never speculate with more rows than this: past it a step is compute-bound here, and each
# proposed token costs about what a decoded one does.
MAX_ROWS = 8
# A row whose expected gain is below this does not even look at its pending token (that
# costs a host sync, ~5% of a one-row step here); it looks again every PROBE_EVERY steps.
MIN_GAIN = 1.05
PROBE_EVERY = 8
# What a look at the pending token is guessed to add to a plain step until one is timed.
LOOK_GUESS = 0.1
# A step shape's first timings: the fastest of them is its cost (see StepCosts._learn).
FIRST_SAMPLES = 3


class NgramIndex:
    """Where each short n-gram of a row's tokens last ended, kept as tokens arrive.

    ``prev[n]`` is where the n-gram ending at the newest token ended the time before (the
    newest occurrence is recorded after that lookup), so a proposal is O(1) whatever the
    length of the prompt.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        self._prev: list[int | None] = [None] * (NGRAM_MAX + 1)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end < n:
                    self._prev[n] = None
                    continue
                key = tuple(self.tokens[end - n : end])
                self._prev[n] = self._last.get(key)
                self._last[key] = end

    def propose(self, limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the longest earlier match of the suffix, and
        that match's length (0 with nothing to propose)."""
        if limit <= 0:
            return [], 0
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            start = self._prev[n]
            if start is not None:
                follow = self.tokens[start : start + limit]
                if follow:
                    return follow, n
        return [], 0


@attrs.define
class RowStats:
    """A row's recent proposals: tokens checked and accepted, each proposal's evidence
    weighing 3/4 of the one after it (a row that stops copying is found out in a few steps;
    one wrong word in a copy costs it little)."""

    accepted: float = 0.0
    checked: float = 0.0
    # Steps since the row last looked at its pending token (see PROBE_EVERY).
    idle: int = 0
    # Recent looks at the row's pending token, and those that found a proposal (weighted as
    # the checks are; the prior, even odds, counts as two looks).
    looks: float = 0.0
    found: float = 0.0
    # Lifetime counts, for the request's timings.
    proposed_n: int = 0
    accepted_n: int = 0
    # What the rate is before any evidence, worth two checks: a new row starts from what
    # such proposals have scored across the server lately (a row's answer is often too
    # short to learn its own before it ends, and each new row trying its luck at 0.5
    # cost running batches of 4 ~10% in free writing).
    prior: float = 0.5
    decay: float = 0.75

    @property
    def rate(self) -> float:
        """The chance that the next proposed token is accepted, given those before it were
        (the weighted evidence, with the prior counting as two checks)."""
        return (self.accepted + 2.0 * self.prior) / (self.checked + 2.0)

    def record(self, proposed: int, accepted: int) -> None:
        """``accepted`` of ``proposed`` tokens were right: each accepted one is a success,
        and the first wrong one, if any, a failure."""
        self.proposed_n += proposed
        self.accepted_n += accepted
        self.accepted = self.accepted * self.decay + accepted
        self.checked = self.checked * self.decay + accepted + (1 if accepted < proposed else 0)

    @property
    def found_rate(self) -> float:
        """The chance that a look at the pending token finds something to propose."""
        return (self.found + 1.0) / (self.looks + 2.0)

    def looked(self, found: bool) -> None:
        self.looks = self.looks * self.decay + 1.0
        self.found = self.found * self.decay + (1.0 if found else 0.0)

    def expected(self, width: int) -> float:
        """Tokens expected beyond the one every step gives, from a proposal of ``width``."""
        a = self.rate
        return sum(a**m for m in range(1, width + 1))


class StepCosts:
    """Seconds per step, per (rows, tokens fed per row), learned from the steps taken.

    The time from one step's start to the next one's is charged to the first: it covers the
    step's share of everything between (the scheduler's turn, the streamer), as the steps
    compared against it do. Samples far from the estimate (a pause, a prompt read in the
    same call) move it only a little.
    """

    def __init__(self) -> None:
        self._ema: dict[tuple[int, int], float] = {}
        self._seen: dict[tuple[int, int], int] = {}
        self._last: tuple[tuple[int, int], float] | None = None

    def started(self, rows: int, width: int, now: float) -> None:
        """A step of ``rows`` rows feeding ``width`` tokens each starts at ``now``."""
        if self._last is not None:
            key, then = self._last
            self._learn(key, now - then)
        self._last = ((rows, width), now)

    def idle(self) -> None:
        """The batch emptied: the next start is not the end of the last step."""
        self._last = None

    def _learn(self, key: tuple[int, int], seconds: float) -> None:
        old = self._ema.get(key)
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if old is None or seen <= FIRST_SAMPLES:
            # The first steps of a shape are the likeliest outliers, and only ever slow ones
            # (a prompt's lazy evaluation, a first allocation): the fastest of them stands.
            # Taken as it came, one first plain step of 0.42 s against 0.02 s later made
            # every proposal look cheap, and since every step then looked at its pending
            # token, no plain step was timed again to correct it.
            self._ema[key] = seconds if old is None else min(old, seconds)
            return
        sample = min(max(seconds, 0.5 * old), 2.0 * old)
        self._ema[key] = 0.8 * old + 0.2 * sample

    def estimate(self, rows: int, width: int) -> float | None:
        """What such a step costs; None while nothing is known of ``rows`` rows. Width 0 is
        a step that looked at its pending token and then decoded plainly.

        Before a width has been tried, it is priced from the plain step: each extra token a
        row feeds adds 5% per row (about what one row pays here for 8 extra tokens), and a
        look alone LOOK_GUESS; the measured cost replaces that after one step.
        """
        base = self._ema.get((rows, 1))
        if base is None:
            return None
        known = self._ema.get((rows, width))
        if known is not None:
            return known
        if width == 0:
            return base * (1.0 + LOOK_GUESS)
        return base * (1.0 + 0.05 * (width - 1) * rows)


@attrs.frozen
class Choice:
    """Proposal length for this step (0: decode plainly)."""

    width: int
    gain: float


class Policy:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.widths = tuple(w for w in WIDTHS if w <= max_tokens) or (max_tokens,)
        self.costs = StepCosts()

    def worth_looking(self, rows: int, stats: list[RowStats | None]) -> bool:
        """Whether looking at the rows' pending tokens (a host sync) is expected to pay.

        ``stats`` has None for rows that cannot speculate (grammar, penalties, ...). A row
        for which it does not still looks every PROBE_EVERY steps, to notice a change (a
        copy starting).
        """
        if rows > MAX_ROWS or self.max_tokens <= 0:
            return False
        live = [s for s in stats if s is not None]
        if self.gain_of_looking(rows, live) >= MIN_GAIN:
            return True
        probe = False
        for s in live:
            s.idle += 1
            if s.idle >= PROBE_EVERY:
                probe = True
        return probe

    def gain_of_looking(self, rows: int, stats: list[RowStats]) -> float:
        """Expected tokens per second of a step that looks, against one that does not.

        A look finds a proposal for each row with its ``found_rate``; if any row has one the
        step verifies at the best width, else it decodes plainly having paid for the look.
        One stream of free writing here: half the looks find nothing, the rest are right a
        quarter of the time, and a look costs ~3 ms of a ~19 ms step: it does not pay, where
        pricing only the proposals that were found said it did (0.85x the plain speed).
        """
        plain = self.costs.estimate(rows, 1)
        looked = self.costs.estimate(rows, 0)
        if plain is None or looked is None or not stats:
            return 0.0
        none = 1.0
        for s in stats:
            none *= 1.0 - s.found_rate
        best = 0.0
        for width in self.widths:
            cost = self.costs.estimate(rows, width + 1)
            if cost is None:
                continue
            tokens = rows + sum(s.found_rate * s.expected(width) for s in stats)
            seconds = (1.0 - none) * cost + none * looked
            best = max(best, (tokens / seconds) / (rows / plain))
        return best

    def choose(self, rows: int, proposals: list[tuple[RowStats, int]]) -> Choice:
        """The width with the most expected tokens per second once the pending tokens have
        been looked at; ``proposals`` pairs each row that has one with its length (rows
        without one just decode). The look is paid by then: the alternative is a plain step
        after a look (width 0), not one without."""
        plain = self.costs.estimate(rows, 0)
        if plain is None or not proposals or rows > MAX_ROWS:
            return Choice(0, 1.0)
        # A width must promise MIN_GAIN, not just more than 1: the estimates are noisy, and
        # taking every width that merely looks better picks the overestimated ones (a batch
        # of 4 writing freely lost 8% that way).
        best = Choice(0, MIN_GAIN)
        for width in self.widths:
            cost = self.costs.estimate(rows, width + 1)
            if cost is None:
                continue
            tokens = rows + sum(s.expected(min(width, n)) for s, n in proposals)
            gain = (tokens / cost) / (rows / plain)
            if gain > best.gain:
                best = Choice(width, gain)
        return best if best.width else Choice(0, 1.0)

"""The generation batch with speculation: rows that have a proposal (an n-gram of their own
text, or a draft model's guess: ``draft``) check it in the same batched model pass as the rows
that decode one token.

A step that speculates feeds every row ``width + 1`` tokens: its pending token (sampled last
step, as mlx-lm's pipeline has it) and then its proposal, padded with repeats of the pending
token where it is shorter (or absent: a row that only decodes). Each position is sampled with
the row's own sampler, as if the tokens before it had been decoded one by one, and the
proposal is kept up to its first token that differs from that sample; the sample at that point
becomes the row's pending token. So:

- at temperature 0 every token is the argmax the plain step would take;
- with sampling, a proposed token is kept exactly when a draw from the model's (filtered)
  distribution gives it, and otherwise that draw is used instead: with a proposal that is one
  fixed token (no draft distribution), this is the standard rejection rule, and the output
  follows the model's distribution as without speculation.

The KV cache keeps only accepted tokens: what every row rejected is trimmed off the end, and a
row that rejected more is rolled right and padded (``mlx_lm_compat.rewind_rows``).

Rows that do not speculate (they still ride along in a speculative step, decoding one token):
rows with logits processors (penalties, logit bias, DRY, grammars and forced tools, thinking
budgets: each processor sees one token at a time), seeded rows with a random sampler (their
draws must not depend on how far a proposal got), rows at their first token (eager start), and
rows too close to their token or context limit. ``--batch-invariant`` and ``--context-shift``
turn speculation off (their row bookkeeping is one token a step).

Not pipelined: a step that speculates must know each row's pending token before it proposes
(a host sync, ~4 ms on this CPU), and its outcome before the next step. ``speculation.Policy``
counts that in the costs it measures.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import attrs
import mlx.core as mx

from mlxcel import native
from mlxcel.actors.model_runner.draft import DraftModel, DraftRow
from mlxcel.actors.model_runner.eager_start import NORMAL, PrimedGenerationBatch
from mlxcel.actors.model_runner.sampler_chain import SeededSampler
from mlxcel.actors.model_runner.speculation import MAX_ROWS, NgramIndex, Policy, RowStats
from mlxcel.models import mlx_lm_compat as compat


@attrs.define
class _RowState:
    index: NgramIndex = attrs.field(factory=NgramIndex)
    stats: RowStats = attrs.field(factory=RowStats)
    # Per n-gram order (the suffix length that matched): a 4-token match is right far more
    # often than a 1-token one (measured on a copy: ~65% against ~15% of proposed tokens),
    # so each is priced on its own record.
    orders: dict[int, RowStats] = attrs.field(factory=dict)
    # The record the current proposal is judged by and adds to, and its order.
    current: RowStats | None = None
    order: int = 0
    # How many of the batch's tokens for this row the index holds (it may hold one more:
    # the pending token, which the step about to run appends).
    fed: int = 0
    # The row's cache in the draft model (--model-draft).
    draft: DraftRow | None = None


class Speculation:
    """What the generation batch needs to speculate, and what it reports per step."""

    def __init__(
        self, max_tokens: int, context_length: int, draft: DraftModel | None = None
    ) -> None:
        self.policy = Policy(max_tokens)
        self.context_length = context_length
        # Proposals from a draft model instead of n-grams.
        self.draft = draft
        self.proposer = "draft" if draft is not None else "ngram"
        self.rows: dict[int, _RowState] = {}
        # Per n-gram order, every row's proposals lately: a new row's prior.
        self.orders: dict[int, RowStats] = {}
        # uid -> (tokens proposed, tokens accepted) in the last step; read by the backend.
        self.last_step: dict[int, tuple[int, int]] = {}

    def forget(self, live: set[int]) -> None:
        for uid in [u for u in self.rows if u not in live]:
            del self.rows[uid]


class SpeculativeGenerationBatch(PrimedGenerationBatch):
    speculation: Speculation | None = None

    @classmethod
    def speculating(cls, model: Any, sampler: Any, speculation: Speculation) -> Any:
        batch = cls.empty(model, sampler)
        batch.speculation = speculation
        return batch

    # mlx-lm types both lists as optional; a generator's batch always has one entry per row.
    @property
    def _samplers(self) -> list[Any]:
        return cast(list[Any], self.samplers)

    @property
    def _processors(self) -> list[list[Any]]:
        return cast(list[list[Any]], self.logits_processors)

    def interrupted(self) -> None:
        # A step's cost is the time to the next step's start: one with a prompt read in it
        # is not what a step costs. The first plain step of a row timed its whole prompt
        # (421 ms for the default model's 22 ms step) and, every later step looking at its
        # pending token and so never timed as plain, it made every proposal look cheap: one
        # stream speculated at every step and ran at ~0.8x its plain speed.
        if self.speculation is not None:
            self.speculation.policy.costs.idle()

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        if self.speculation is not None:
            self.speculation.forget(set(self.uids))
            if not self.uids:  # the next step starts after a pause, not after this one
                self.speculation.policy.costs.idle()

    # -- the step -------------------------------------------------------------------------

    def _emit(self) -> list[list[tuple[int, Any]]]:
        spec = self.speculation
        if spec is None or self._priming or not self.uids:
            return super()._emit()
        spec.last_step = {}
        rows = len(self.uids)
        now = time.perf_counter()
        policy = spec.policy
        eligible: list[_RowState | None] = []
        if rows <= MAX_ROWS and compat.rewindable(self.prompt_cache):
            eligible = [self._state(i) if self._may_speculate(i) else None for i in range(rows)]
        stats = [s.stats if s is not None else None for s in eligible]
        if not any(eligible) or not policy.worth_looking(rows, stats):
            policy.costs.started(rows, 1, now)
            return super()._emit()
        for s in eligible:
            if s is not None:
                s.stats.idle = 0
        self.settle()  # a look is a host sync
        pending_array = compat.next_tokens(self)
        mx.eval(pending_array)
        pending = cast(list[int], pending_array.tolist())
        proposals = (
            self._drafts(eligible, pending)
            if spec.draft is not None
            else self._ngrams(eligible, pending)
        )
        choice = policy.choose(
            rows,
            [
                (s.current or s.stats, len(p))
                for s, p in zip(eligible, proposals, strict=True)
                if s and p
            ],
        )
        if choice.width == 0:
            # A plain step after a host sync: priced on its own (what looking costs).
            policy.costs.started(rows, 0, now)
            return super()._emit()
        policy.costs.started(rows, choice.width + 1, now)
        proposals = [p[: choice.width] for p in proposals]
        return self._verify(pending_array, pending, proposals, choice.width)

    def _ngrams(self, eligible: list[_RowState | None], pending: list[int]) -> list[list[int]]:
        assert self.speculation is not None
        spec = self.speculation
        proposals: list[list[int]] = []
        for i, state in enumerate(eligible):
            if state is None:
                proposals.append([])
                continue
            tokens = self.tokens[i]
            state.index.extend(tokens[state.fed :] + [pending[i]])
            state.fed = len(tokens) + 1
            proposal, order = state.index.propose(self._room(i))
            state.stats.looked(bool(proposal))
            state.current, state.order = None, order
            if proposal:
                state.current = state.orders.get(order)
                if state.current is None:
                    server = spec.orders.setdefault(order, RowStats(decay=0.95))
                    state.current = state.orders[order] = RowStats(prior=server.rate)
            proposals.append(proposal)
        return proposals

    def _drafts(self, eligible: list[_RowState | None], pending: list[int]) -> list[list[int]]:
        """Draft tokens cost a draft pass each: a row drafts only as far as the policy would
        use at best, given its acceptance so far."""
        assert self.speculation is not None and self.speculation.draft is not None
        draft = self.speculation.draft
        rooms = [self._room(i) if s is not None else 0 for i, s in enumerate(eligible)]
        rows = [(s.stats, room) for s, room in zip(eligible, rooms, strict=True) if s and room]
        width = self.speculation.policy.choose(len(self.uids), rows).width
        proposals: list[list[int]] = []
        for i, state in enumerate(eligible):
            if state is None or not width or not rooms[i]:
                proposals.append([])
                continue
            # A draft model always has something to propose.
            state.stats.looked(True)
            if state.draft is None:
                state.draft = draft.row()
            history = [*self.tokens[i], pending[i]]
            proposals.append(state.draft.propose(draft, history, min(width, rooms[i])))
        return proposals

    def _may_speculate(self, i: int) -> bool:
        sampler = self._samplers[i]
        return (
            self._starts[i] == NORMAL
            and not self.is_hole(i)
            and not self._processors[i]
            and not isinstance(sampler, SeededSampler)
        )

    def _as_plain_step(self) -> AbstractContextManager[None]:
        """With a seeded row in the batch, the verifying pass computes its activations as a
        plain step of as many rows would (float32 below 12 rows, int8 from 12): a seeded row
        never speculates, and its token must not depend on how far a neighbour's proposal
        reaches (``rows x (width + 1)`` inputs took int8 from 2 rows and a 5-token proposal
        on). Without one, the pass keeps the kernels' own choice, faster at its row count."""
        if any(isinstance(s, SeededSampler) for s in self._samplers):
            return native.int8_like_rows(len(self.uids))
        return nullcontext()

    def _state(self, i: int) -> _RowState:
        assert self.speculation is not None
        uid = self.uids[i]
        state = self.speculation.rows.get(uid)
        if state is None:
            state = self.speculation.rows[uid] = _RowState()
        return state

    def _room(self, i: int) -> int:
        """How many tokens row ``i`` may be proposed: it ends at its token limit or at the
        context's end, and the pending token and the sample after the proposal count."""
        assert self.speculation is not None
        counts, _ = compat.row_counters(self)
        left = self.max_tokens[i] - counts[i] - 1
        context = self.speculation.context_length - len(self.tokens[i]) - 2
        return min(self.speculation.policy.max_tokens, left, context)

    def _verify(
        self, pending_array: mx.array, pending: list[int], proposals: list[list[int]], width: int
    ) -> list[list[tuple[int, Any]]]:
        assert self.speculation is not None
        rows = len(self.uids)
        fed = [[t, *p, *([t] * (width - len(p)))] for t, p in zip(pending, proposals, strict=True)]
        with self._as_plain_step():
            logits = self.model(mx.array(fed), cache=self.prompt_cache)  # [rows, width + 1, V]
        dists: list[mx.array] = []
        draws: list[mx.array] = []
        contexts = []
        for i in range(rows):
            processors = self._processors[i]
            if processors:
                # Never proposing: position 0 only, through its processors as mlx-lm does.
                row = logits[i : i + 1, 0]
                context = compat.token_context(self, i).update_and_fetch(pending_array[i : i + 1])
                contexts.append(context)
                for processor in processors:
                    row = processor(context, row)
            else:
                row = logits[i, : len(proposals[i]) + 1]
            dist = row - mx.logsumexp(row, axis=-1, keepdims=True)
            sampler = self._samplers[i] or self.fallback_sampler
            dists.append(dist)
            draws.append(sampler(dist))
        mx.eval(draws, dists, contexts)
        drawn = [cast(list[int], d.tolist()) for d in draws]
        previous = compat.next_logprobs(self)
        emitted: list[list[tuple[int, Any]]] = []
        rejected: list[int] = []
        bonus: list[int] = []
        for i, uid in enumerate(self.uids):
            proposal, sample = proposals[i], drawn[i]
            kept = 0
            while kept < len(proposal) and sample[kept] == proposal[kept]:
                kept += 1
            out = [(pending[i], previous[i])]
            out += [(proposal[m], dists[i][m]) for m in range(kept)]
            emitted.append(out)
            self.tokens[i].extend([pending[i], *proposal[:kept]])
            rejected.append(width - kept)
            bonus.append(sample[kept])
            if proposal:
                state = self.speculation.rows[uid]
                state.stats.record(len(proposal), kept)
                if state.current is not None:
                    state.current.record(len(proposal), kept)
                    self.speculation.orders[state.order].record(len(proposal), kept)
                self.speculation.last_step[uid] = (len(proposal), kept)
        compat.rewind_rows(self.prompt_cache, rejected)
        compat.set_current(self, pending_array, previous)
        compat.set_next_tokens(self, mx.array(bonus))
        compat.set_next_logprobs(self, [dists[i][len(emitted[i]) - 1] for i in range(rows)])
        return emitted

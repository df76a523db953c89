"""mlx-lm's ``BatchGenerator``, where a joining row costs no model pass of its own beyond its
prompt, and its first token still comes out one step sooner.

mlx-lm reads a prompt (all but its last token) in one step. In the next, after that step's
decode of the batch, it runs the row alone through the model on the last prompt token to
sample its first token, and copies the row into the generation batch; the first token comes
out of the step after that. On this CPU every model pass costs ~0.1 s whatever its rows (the
weights are read from memory each time), and a step with 8 rows decoding is ~0.25 s, so each
arrival cost everyone an extra ~0.1 s pass, and itself two whole steps before its first token.

Here, in the step that reads the rest of its prompt, the row joins the generation batch with
its last prompt token as its next input, "primed": the next batch step reads that token along
with every other row's (no pass of its own) and samples its first token, which is handed out
at the end of that same step instead of a step later. The step after, the row's first token
is read as usual but not handed out again. Samplers, logits processors (they see the whole
prompt, as in mlx-lm) and stop sequences are mlx-lm's own, and every token is the same as
mlx-lm's generator gives (tests/unit/test_eager_start.py).

Rows the caller holds back (``hold``) keep mlx-lm's pace: the backend's forking of n choices
extracts a row's cache right after its prompt, before the last token is read.

Every private name of mlx-lm used here (the overridden ``_next`` and ``_step``, the queues,
a batch's per-row state) goes through ``mlxcel.models.mlx_lm_compat``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.sample_utils import greedy_sampler

from mlxcel import native
from mlxcel.actors.model_runner import row_reuse
from mlxcel.actors.model_runner.encoding import Encoder
from mlxcel.actors.model_runner.prefill_budget import PrefillBudget
from mlxcel.models import mlx_lm_compat as compat

# Where a row stands with its first token.
NORMAL = 0
# Its input this step is its last prompt token: it reports the token sampled from it now.
PRIMED = 1
# Its input this step is the first token, already reported: report nothing.
REPORTED = 2


class PrimedGenerationBatch(GenerationBatch):
    # Queues each step's graph from a thread of its own (``encoding``); None: this thread
    # queues it (``mx.async_eval``). Set on the generator's batch, which lives as long.
    encoder: Encoder | None = None

    def __init__(self, *args: Any, primed: bool = False, **kwargs: Any) -> None:
        self._priming = primed
        # Rows that finished and stay as holes until a joining row takes their place
        # (``row_reuse``); ``len()`` counts the others.
        self._holes: set[int] = set()
        self._counting_holes = False
        self._next_hole_uid = -1
        # Rows that joined into a hole (tests and benchmarks read it).
        self.reused_rows = 0
        super().__init__(*args, **kwargs)
        self._starts = [PRIMED if primed else NORMAL] * len(self.uids)
        if primed:
            # A placeholder: a primed row's current token is a prompt token, never reported.
            # (Made here, on the model runner's thread: mlx arrays are bound to a stream.)
            compat.set_next_logprobs(self, [mx.zeros((1,))] * len(self.uids))

    @classmethod
    def joining(cls, source: PromptProcessingBatch, last: list[list[int]]) -> Any:
        """The rows of ``source`` (prompts read but their last token), primed with it."""
        batch = cls(
            source.model,
            source.uids,
            mx.array([t[-1] for t in last]),
            source.prompt_cache,
            source.tokens,
            source.samplers,
            source.fallback_sampler,
            source.logits_processors,
            source.stop_sequences,
            source.max_tokens,
            primed=True,
        )
        source.uids, source.prompt_cache, source.tokens = [], [], []
        source.samplers, source.logits_processors, source.max_tokens = [], [], []
        return batch

    def interrupted(self) -> None:
        """The time between this step and the next is not all decoding: prompts are read in
        it. Nothing here; a speculating batch stops timing that interval as a step."""

    def settle(self) -> None:
        """Before anything that evaluates on this thread (``encoding``'s rule)."""
        if self.encoder is not None:
            self.encoder.settle()

    @contextmanager
    def synchronous(self) -> Iterator[None]:
        """Steps queue their graphs from this thread (the caller settled first)."""
        encoder, self.encoder = self.encoder, None
        try:
            yield
        finally:
            self.encoder = encoder

    def reported_early(self, i: int) -> bool:
        """Whether row ``i``'s current input is a token already reported (eager start): it is
        not in the row's tokens yet, nor has the row's logits processors' context seen it."""
        return self._starts[i] == REPORTED

    def _step(self) -> Any:
        if self._priming:  # the constructor's own pass: skipped, the batch step does it
            self._priming = False
            return [], []
        return self._decode()

    def _decode(self) -> tuple[list[int], list[mx.array]]:
        """mlx-lm's ``GenerationBatch._step`` (0.32), except that the rows' scores are not
        normalised into log-probabilities over the whole batch.

        mlx-lm subtracts a log-sum-exp over every row's vocabulary each step (at 64 rows,
        3.1 M exponentials on one core: ~12 ms of a ~290 ms step here). Every sampler we build
        is shift-invariant (argmax, top-k, min-p, a categorical draw; top-p, typical and XTC
        normalise for themselves), so a row's scores are only shifted by their maximum, and
        not even that when every row is greedy. What reads a distribution as log-probabilities
        normalises it itself: the backend's ``_score`` for requests that asked for them, and
        speculation's verification per row.
        """
        inputs = compat.next_tokens(self)
        compat.set_current(self, inputs, compat.next_logprobs(self))
        processors_of = cast(list[Any], self.logits_processors)
        if any(processors_of):
            self.settle()  # a processor may read tokens on the host
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        token_context = []
        if any(processors_of):
            rows = []
            for e in range(len(self.uids)):
                row = logits[e : e + 1]
                if processors_of[e]:
                    context = compat.token_context(self, e).update_and_fetch(inputs[e : e + 1])
                    token_context.append(context)
                    for processor in processors_of[e]:
                        row = processor(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        given: list[Any] = self.samplers or [None] * len(self.uids)
        samplers = [self.fallback_sampler if s is None else s for s in given]
        if not all(s is greedy_sampler for s in samplers):
            logits = logits - logits.max(axis=-1, keepdims=True)
        if not samplers or all(s is samplers[0] for s in samplers):
            sampled = (samplers[0] if samplers else self.fallback_sampler)(logits)
        else:
            sampled = mx.concatenate([s(logits[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
        compat.set_next_tokens(self, sampled)
        compat.set_next_logprobs(self, list(logits))
        previous = compat.current_logprobs(self)
        if self.encoder is None:
            mx.async_eval(sampled, compat.next_logprobs(self), token_context)
        else:
            # This step's graph was built while the previous one was being queued; once that
            # is done, what this thread reads below is queued here if still lazy (a verifying
            # step's leftovers), then the encoder queues this step while the runner goes on.
            self.encoder.settle()
            mx.async_eval(inputs, previous)
            self.encoder.submit(sampled, compat.next_logprobs(self), token_context)
        mx.eval(inputs, previous)  # queued already: waits for the results only
        said = cast(list[int], inputs.tolist())
        for tokens, t in zip(self.tokens, said, strict=True):
            tokens.append(t)
        return said, previous

    # -- rows joining and leaving (row_reuse explains the holes) --------------------------

    def __len__(self) -> int:
        """Live rows: what the generator's capacity checks count (holes are free places)."""
        return len(self.uids) - (0 if self._counting_holes else len(self._holes))

    @contextmanager
    def counting_holes(self) -> Iterator[None]:
        """``len()`` counts every row, holes too (mlx-lm's ``remove`` indexes rows by it)."""
        self._counting_holes = True
        try:
            yield
        finally:
            self._counting_holes = False

    def is_hole(self, i: int) -> bool:
        return i in self._holes

    def extend(self, batch: Any) -> None:
        self.settle()
        n = len(batch.uids)
        starts = list(getattr(batch, "_starts", [NORMAL] * n))
        if n and self.uids and self._holes:
            if compat.kv_rows_fit(self.prompt_cache, batch.prompt_cache):
                rows = sorted(self._holes)[:n]
                compat.place_rows(self, rows, batch)
                for cache, theirs in zip(self.prompt_cache, batch.prompt_cache, strict=True):
                    compat.write_kv_rows(cache, rows, theirs)
                for row, start in zip(rows, starts, strict=False):
                    self._starts[row] = start
                self._holes.difference_update(rows)
                self.reused_rows += len(rows)
                self._settle_hole_samplers()
                if len(rows) == n:
                    return
                # More joined than there were holes: the rest go on the end (mlx-lm's way,
                # one copy of the batch), taken out of the joining batch first.
                GenerationBatch.filter(batch, list(range(len(rows), n)))
                starts = starts[len(rows) :]
        super().extend(batch)
        self._starts.extend(starts)
        self._settle_hole_samplers()

    def _finished_cache(self, i: int) -> list[Any]:
        self.settle()  # mlx-lm's extraction reads the row's padding on the host
        return self.extract_cache(i)

    def filter(self, keep: list[int]) -> None:
        self.settle()
        kept = set(keep)
        live = [i for i in keep if i not in self._holes]
        ended = [i for i in range(len(self.uids)) if i not in kept and i not in self._holes]
        if not ended:
            return
        if row_reuse.may_leave_holes(
            reusable=compat.rewindable(self.prompt_cache),
            physical=len(self.uids),
            holes=len(self._holes),
            live=len(live),
            ended=len(ended),
            live_padding=compat.live_left_padding(self.prompt_cache, live),
        ):
            for i in ended:
                self._vacate(i)
            self._settle_hole_samplers()
            return
        super().filter(live)
        self._starts = [self._starts[i] for i in live]
        self._holes = set()

    def _vacate(self, i: int) -> None:
        """Row ``i`` becomes a hole: computed with the others, reporting nothing, asking
        nothing of processors or stop sequences, holding no request's state."""
        self.uids[i] = self._next_hole_uid  # never a real uid (those count up from 0)
        self._next_hole_uid -= 1
        processors = cast(list[Any], self.logits_processors)
        processors[i] = ()
        self.tokens[i] = []
        self._starts[i] = NORMAL
        self._holes.add(i)

    def _settle_hole_samplers(self) -> None:
        """Holes sample with the live rows' sampler when they all share one (the step then
        samples every row in one call), else with the fallback. Never with one live row's
        own sampler: a seeded one would be drawn from twice a step."""
        if not self._holes or not self.samplers:
            return
        samplers = cast(list[Any], self.samplers)
        live = [s for i, s in enumerate(samplers) if i not in self._holes]
        shared = live[0] if live and all(s is live[0] for s in live) else self.fallback_sampler
        for i in self._holes:
            samplers[i] = shared

    def _emit(self) -> list[list[tuple[int, Any]]]:
        """Take one step; per row, the tokens it reports with the distribution each was drawn
        from (one here; a speculative step may report several)."""
        tokens, logprobs = self._step()
        return [[(t, lp)] for t, lp in zip(tokens, logprobs, strict=True)]

    def next(self) -> list[Any]:
        """mlx-lm's ``next``, but primed rows report the token sampled in this step, and
        rows that reported it already report nothing."""
        if not self.uids:
            return []
        emitted = self._emit()
        starts = self._starts
        first: list[int] = []
        dists: list[Any] = []
        if PRIMED in starts:
            self.settle()
            sampled, dists = compat.next_tokens(self), compat.next_logprobs(self)
            mx.eval(sampled, [dists[i] for i, s in enumerate(starts) if s == PRIMED])
            first = cast(list[int], sampled.tolist())  # a 1-d int array
        counts, matchers = compat.row_counters(self)
        keep = []
        responses = []
        for i, uid in enumerate(self.uids):
            if i in self._holes:
                keep.append(i)
                continue
            if starts[i] == REPORTED:
                starts[i] = NORMAL
                keep.append(i)
                continue
            if starts[i] == PRIMED:
                starts[i] = REPORTED
                items = [(first[i], dists[i])]
            else:
                items = emitted[i]
            done = False
            for token, dist in items:
                finish_reason = None
                counts[i] += 1
                if counts[i] >= self.max_tokens[i]:
                    finish_reason = "length"
                if matchers[i].advance(token):
                    finish_reason = "stop"
                done = finish_reason is not None
                responses.append(
                    self.Response(
                        uid=uid,
                        token=token,
                        logprobs=dist,
                        finish_reason=finish_reason,
                        # The cache and its tokens agree: a token reported early is in
                        # neither (tokens a row read past its end are in both).
                        prompt_cache=self._finished_cache(i) if done else None,
                        all_tokens=self.tokens[i] if done else None,
                    )
                )
                if done:
                    break
            if not done:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


class ReadingBatch(PromptProcessingBatch):
    """mlx-lm's batch of prompts being read, whose every chunk is a prompt pass
    (``native.prompt_pass``): a prompt token's KV does not depend on the chunk it was read in,
    the prompts beside it or how much of it came from the prompt cache, so a seeded answer is
    the same from a cached prefix as from a fresh read. (The pass mlx-lm makes on a held
    row's last prompt token is a decode step's, as that token's is for every other row.)"""

    def prompt(self, tokens: list[list[int]]) -> None:
        with native.prompt_pass():
            super().prompt(tokens)


class EagerStartBatchGenerator(BatchGenerator):
    def __init__(
        self,
        *args: Any,
        hold: Callable[[int], bool],
        batch: Callable[[Any, Any], PrimedGenerationBatch] | None = None,
        budget: PrefillBudget | None = None,
        urgent: Callable[[int], bool] = lambda uid: False,
        encoder: Encoder | None = None,
        **kwargs: Any,
    ) -> None:
        """``batch(model, fallback_sampler)`` makes the (empty) generation batch every row
        joins: a ``PrimedGenerationBatch`` by default, a speculating one when asked.
        ``budget`` limits prompt reading while rows decode, except for ``urgent`` rows.
        ``encoder``: decode steps are queued from its thread, on its stream (``encoding``)."""
        if encoder is not None:
            kwargs["stream"] = encoder.stream
        super().__init__(*args, **kwargs)
        compat.check_generator(self)
        self._hold = hold
        make = batch if batch is not None else PrimedGenerationBatch.empty
        generating = make(self.model, self.sampler)
        generating.encoder = encoder
        compat.set_generation_batch(self, generating)
        compat.set_prompt_batch(
            self,
            ReadingBatch.empty(self.model, self.sampler, prefill_step_size=self.prefill_step_size),
        )
        self._budget = budget if budget is not None else PrefillBudget(share=1.0)
        self._urgent = urgent
        self._full_chunk = self.prefill_step_size
        # Rows joined the generation batch in the last step (see ``_next``).
        self._joined = False

    def remove(self, uids: Any, return_prompt_caches: bool = False) -> Any:
        # mlx-lm's remove lists the generation batch's rows as range(len(batch)).
        generating = compat.generation_batch(self)
        if not isinstance(generating, PrimedGenerationBatch):
            return super().remove(uids, return_prompt_caches)
        with generating.counting_holes():
            return super().remove(uids, return_prompt_caches)

    def settle(self) -> None:
        """Before anything that evaluates on this thread outside a step (``encoding``)."""
        compat.generation_batch(self).settle()

    def _next(self) -> tuple[list[Any], list[Any]]:
        generating = compat.generation_batch(self)
        if compat.waiting(self) or len(compat.prompt_batch(self)):
            # Prompts may be read (evaluated) in this step, after its decode: that decode is
            # queued from this thread, and nothing is being queued from the encoder's.
            generating.settle()
            with generating.synchronous():
                return self._step_reading()
        return self._step_reading()

    def _step_reading(self) -> tuple[list[Any], list[Any]]:
        started = self._start_unread_rows()
        budget = self._budget
        decoding_rows = len(compat.generation_batch(self))
        decoding = decoding_rows > 0
        waiting = len(compat.prompt_batch(self)) + len(compat.waiting(self))
        budget.rows(waiting, decoding_rows)
        rows = min(waiting, self.prefill_batch_size)
        # A short prompt is exempt, and read whole (with the others being read, in full
        # chunks): holding back a steady flow of ordinary chat turns would leave rows idle
        # and lower everyone's throughput.
        exempt = self._exempt_waiting(budget.short(decoding, self._full_chunk))
        if not budget.may_read(decoding, exempt):
            return started, self._decode_only()
        self.prefill_step_size = (
            self._full_chunk if exempt else budget.chunk(decoding, rows, self._full_chunk)
        )
        counters = compat.counters(self)
        decode0, tokens0 = counters.decode_time, counters.prompt_tokens
        generating = compat.generation_batch(self)
        if waiting:
            generating.interrupted()  # prompts may be read before this step's decode
        tic = time.perf_counter()
        prompt_responses, generation_responses = super()._next()
        if counters.prompt_tokens > tokens0 or self._joined:
            # ... or were read after it, or joined just before it (the first step of a
            # joined row also evaluates what its prompt left lazy).
            generating.interrupted()
        self._joined = bool(started) or bool(prompt_responses)
        self._start_read_rows(prompt_responses)
        decode = counters.decode_time - decode0
        budget.decoded(decode)
        budget.read(time.perf_counter() - tic - decode, counters.prompt_tokens - tokens0, decoding)
        return started + prompt_responses, generation_responses

    def _exempt_waiting(self, chunk: int) -> bool:
        """Whether a row read past the budget is being read or waits to be: an urgent one,
        or a short one (what is left of its prompt is at most ``chunk``)."""
        rows = zip(compat.prompt_batch(self).uids, compat.reading(self), strict=True)
        left = [(uid, segments) for uid, (segments, _) in rows]
        left += [compat.waiting_prompt(row) for row in compat.waiting(self)]
        return any(self._urgent(uid) or sum(map(len, segments)) <= chunk for uid, segments in left)

    def _decode_only(self) -> list[Any]:
        """mlx-lm's decode half of a step, leaving prompts unread (their budget is spent)."""
        generating = compat.generation_batch(self)
        counters = compat.counters(self)
        tic = time.perf_counter()
        responses: list[Any] = generating.next()
        elapsed = time.perf_counter() - tic
        self._budget.decoded(elapsed)
        counters.decode_time += elapsed
        counters.generation_tokens += len(responses)
        counters.generation_steps += 1
        if counters.generation_steps % 512 == 0:
            self.settle()
            mx.clear_cache()
        return responses

    def _start_unread_rows(self) -> list[Any]:
        """Rows waiting with nothing to read but their last token (forked choices, exact
        prompt-cache hits) join primed before this step's decode: their first token comes
        out of this very step (mlx-lm: a pass each now, the token a step later)."""
        generating = compat.generation_batch(self)
        room = self.completion_batch_size - len(generating) - len(compat.prompt_batch(self))
        queue = compat.waiting(self)
        rows: list[tuple[Any, ...]] = []
        last: list[list[int]] = []
        while queue and len(rows) < room:
            uid, segments = compat.waiting_prompt(queue[0])
            if len(segments) != 1 or len(segments[0]) != 1 or self._hold(uid):
                break
            rows.append(queue.popleft())
            last.append(segments[0])
        if not rows:
            return []
        source = compat.prompt_batch_of(self, rows)
        uids = list(source.uids)
        generating.extend(PrimedGenerationBatch.joining(source, last))
        return [PromptProcessingBatch.Response(uid, (1, 1), True, True) for uid in uids]

    def _start_read_rows(self, prompt_responses: list[Any]) -> None:
        """Move the rows left with only their last token to read into the generation batch,
        primed with it (mlx-lm moves them at the start of its next call, with a pass each)."""
        generating = compat.generation_batch(self)
        prompts = compat.prompt_batch(self)
        rows = compat.reading(self)  # per row being read: (segments left, prompt length)
        ready = [
            i
            for i, (segments, _) in enumerate(rows)
            if len(segments) == 1 and len(segments[0]) == 1 and not self._hold(prompts.uids[i])
        ]
        if not ready or len(generating) + len(ready) > self.completion_batch_size:
            return
        chosen = set(ready)
        last = [rows[i][0][0] for i in ready]
        sizes = [rows[i][1] for i in ready]
        compat.set_reading(self, (i for i in range(len(rows)) if i not in chosen))
        if len(ready) == len(prompts):
            # All of it moves: hand the batch over instead of copying its KV cache to split.
            source = prompts
            compat.set_prompt_batch(
                self,
                ReadingBatch.empty(
                    self.model, self.sampler, prefill_step_size=self.prefill_step_size
                ),
            )
        else:
            source = prompts.split(ready)
        batch = PrimedGenerationBatch.joining(source, last)
        for uid, size in zip(batch.uids, sizes, strict=True):
            prompt_responses.append(PromptProcessingBatch.Response(uid, (size, size), True, True))
        generating.extend(batch)

"""The production Backend: mlx-lm's BatchGenerator on the model runner's thread.

Each batch row is one choice of one request (``uid`` -> request id and choice). A request with
n choices is inserted as one row that reads the prompt; the moment that row has read all but
the prompt's last token, its cache is extracted and the other n - 1 rows start from it
(``choices`` explains the arithmetic).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, cast

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import StopSequences

from mlxcel import native
from mlxcel.actors.model_runner import invariance, sampler_chain
from mlxcel.actors.model_runner.backend import ModelInfo
from mlxcel.actors.model_runner.choices import choice_sampling
from mlxcel.actors.model_runner.draft import DraftModel
from mlxcel.actors.model_runner.eager_start import EagerStartBatchGenerator
from mlxcel.actors.model_runner.encoding import Encoder
from mlxcel.actors.model_runner.guide import Guide, GuideKit
from mlxcel.actors.model_runner.memory import release_idle_memory
from mlxcel.actors.model_runner.prefill_budget import PrefillBudget
from mlxcel.actors.model_runner.prompt_cache import PromptCache
from mlxcel.actors.model_runner.slots import SlotCaches, row_state, shifted
from mlxcel.actors.model_runner.speculative_batch import Speculation, SpeculativeGenerationBatch
from mlxcel.actors.reasoning import detect_reasoning
from mlxcel.models import device, fast_lm, lora, mlx_lm_compat, vision_cache, vlm
from mlxcel.models.errors import AdapterError
from mlxcel.models.loader import LoadedModel, model_meta, release_thread_streams
from mlxcel.runtime.messages import (
    CacheStats,
    InsertSequence,
    PrefillProgress,
    SamplingParams,
    StepOutput,
    StepPlan,
    TokenOut,
)
from mlxcel.runtime.settings import Settings

log = logging.getLogger(__name__)

# A step with nothing to change: the runner's steady decode, whose graph may still be queued
# by the encoder's thread when the step returns (``encoding``).
_PLAIN = StepPlan()


def _encoder_wanted(settings: Settings) -> bool:
    """Decode steps are queued from a thread of their own on the CPU (``encoding``: mlx's
    encoding keeps the caller until the step is nearly computed); ``MLXCEL_ENCODER_THREAD=0``
    queues them from the runner's thread. Not under --distributed, whose collectives run on
    mlx-lm's own stream."""
    return (
        device.on_cpu()
        and not settings.distributed
        and os.environ.get("MLXCEL_ENCODER_THREAD", "1") != "0"
    )


@attrs.frozen
class _Donation:
    """Where a request's cache goes when it ends: its prompt-cache key, and how many of its
    first tokens hold what a fresh read computes (``prompt_cache.EXACT``)."""

    key: str
    exact: int


@attrs.frozen
class _Row:
    """One batch row to start: a choice of a request, from this prompt suffix and cache."""

    seq: InsertSequence
    choice: int
    prompt: list[int]
    cache: list[Any] | None
    # The prompt tokens the cache already holds.
    known: list[int]


class MlxBackend:
    def __init__(
        self, loaded: LoadedModel, settings: Settings, draft: LoadedModel | None = None
    ) -> None:
        """``draft``: the ``--model-draft`` model, loaded (its tokenizer must be the model's)."""
        self._encoder = Encoder() if _encoder_wanted(settings) else None
        if self._encoder is not None:
            # A graph the encoder queues must not reach a node it cannot queue: one left lazy
            # on this thread's own stream ("There is no Stream(cpu, N) in current thread").
            # So what building the model left lazy is computed now (mlx's global random key,
            # which the layers' random initialisation advanced; private arrays such as a
            # RoPE's frequencies), and what this backend computes goes on the encoder's
            # stream (``_on_stream``).
            mx.eval(mx.random.state, _held_arrays(loaded))
        try:
            with self._on_stream():
                self._build(loaded, settings, draft)
        except BaseException:
            # A refused start (an adapter that does not fit): no thread of ours may outlive
            # it, or mlx aborts the process at exit instead of the error line being the last.
            if self._encoder is not None:
                self._encoder.close()
            raise

    def _build(self, loaded: LoadedModel, settings: Settings, draft: LoadedModel | None) -> None:
        self._loaded = loaded
        self._vision = loaded.vision
        self._vlm_prefix = settings.vlm_prefix_cache
        # Per image request (M-RoPE): how far its positions are from its length.
        self._shifts: dict[str, int] = {}
        self._tower = (
            vision_cache.install(loaded.vision.model, settings.vision_cache_size)
            if loaded.vision is not None
            else None
        )
        ctx = settings.ctx_size or loaded.context_length
        self.info = ModelInfo(
            model_id=settings.alias or loaded.model_id,
            path=loaded.path,
            tokenizer=loaded.tokenizer,
            eos_token_ids=frozenset(loaded.eos_token_ids),
            context_length=ctx,
            chat_template=loaded.chat_template,
            description=f"{loaded.model_id} ({loaded.dtype})",
            device=device.describe().label,
            meta=model_meta(loaded),
            media=loaded.vision.media if loaded.vision is not None else None,
            max_rows=1 if loaded.vision is not None and not loaded.vision.batchable else None,
            lora_paths=tuple(path for path, _ in settings.lora),
            lora_scales=tuple(scale for _, scale in settings.lora),
        )
        # Per row using an adapter: its scales (one per adapter), for every forward pass.
        self._lora_of: dict[int, tuple[float, ...]] = {}
        model = self._with_adapters(loaded, settings)
        mlx_lm_compat.install()  # once per process; the loader did it already
        # Process-wide too: int8 activations at every row count give a row the same bits
        # whatever the batch (mlxcel.native), so quantised layers need no padding.
        native.set_int8_activations("every-row" if settings.batch_invariant else None)
        if settings.batch_invariant:
            problem = invariance.prepare(loaded.model, settings.parallel)
            if problem is not None:
                raise RuntimeError(f"--batch-invariant: {problem}")
        # Process-wide (mlx-lm's attention function is a module name): set by every backend,
        # so the one built last (the only one, when serving) decides.
        fast_lm.set_batch_invariant(settings.batch_invariant)
        if settings.batch_invariant:
            fast_lm.install(loaded.model)  # on a GPU, fast_lm installed nothing at load
        self._invariant = settings.batch_invariant
        # Rows reading a prompt for a request with more choices to fork once it is read.
        self._forks: dict[int, InsertSequence] = {}
        # Rows of high-priority requests (X-Priority: 0): read past the prefill budget.
        self._urgent: set[int] = set()
        # N-gram speculation (speculative_batch says which rows and modes do without it).
        self._spec = (
            Speculation(settings.spec_max, ctx, _draft_model(loaded, draft, settings))
            if settings.speculating
            else None
        )
        spec = self._spec
        self._gen = EagerStartBatchGenerator(
            model,
            # A row whose choices fork from its prompt cache keeps mlx-lm's pace (see _fork).
            hold=self._forks.__contains__,
            batch=(
                None
                if spec is None
                else lambda model, sampler: SpeculativeGenerationBatch.speculating(
                    model, sampler, spec
                )
            ),
            max_tokens=ctx,
            stop_tokens=[[t] for t in sorted(loaded.eos_token_ids)],
            completion_batch_size=settings.parallel,
            # Prompts are read in waves of at most 8 (mlx_lm.server's default): a wave of 16
            # would hold every first token until the whole wave is read. Batch-invariant: one
            # at a time, so no prompt is padded to another's length.
            prefill_batch_size=1 if settings.batch_invariant else min(settings.parallel, 8),
            prefill_step_size=settings.prefill_chunk_size,
            # Batch-invariant prompts are read in the chunks a lone request reads them in.
            budget=PrefillBudget(share=1.0 if settings.batch_invariant else settings.prefill_share),
            urgent=self._urgent.__contains__,
            encoder=self._encoder,
        )
        self._vocab_size = int(loaded.vocab_size)
        tok = loaded.tokenizer
        self._encode = lambda s: list(tok.encode(s, add_special_tokens=False))
        self._eos_stop = StopSequences([[t] for t in sorted(loaded.eos_token_ids)])
        self._no_stop = StopSequences()
        self._rid_by_uid: dict[int, str] = {}
        self._choice_by_uid: dict[int, int] = {}
        self._uids_by_rid: dict[str, list[int]] = {}
        self._donation: dict[str, _Donation] = {}
        # Top-k asked for, per row that wants log-probabilities.
        self._logprobs: dict[int, int] = {}
        # Per row with a grammar or a thinking budget (each choice has its own).
        self._guides: dict[int, Guide] = {}
        self._kit = _guide_kit(loaded, self._encode, self._vocab_size)
        self._cache = PromptCache(settings.cache_ram_mib << 20) if settings.cache_enabled else None
        self._ctx = ctx
        self._slots = SlotCaches(settings.parallel, self._cache, len(loaded.model.layers))
        # The slot each request's first choice runs in (its donation is that slot's cache).
        self._slot_of: dict[str, int] = {}
        # --context-shift: per row, (n_keep, n_discard, prompt length); rows reading a shift's
        # kept tokens again report no prefill progress (their request read its prompt once).
        self._shift: dict[int, tuple[int, int, int]] | None = {} if settings.context_shift else None
        self._rereading: set[int] = set()
        # Process-wide (the embedder's thread allocates through the same mlx allocator).
        mx.set_cache_limit(settings.mlx_cache_limit_mib << 20)
        self._busy = False

    def _on_stream(self) -> AbstractContextManager[Any]:
        """What this backend computes goes on the encoder's stream (the runner's thread keeps
        its own default stream for anything else)."""
        if self._encoder is None:
            return nullcontext()
        return mx.stream(self._encoder.stream)

    def warmup(self) -> float:
        """Run one tiny generation so the first request pays no first-call costs."""
        tic = time.perf_counter()
        bos = min(self.info.eos_token_ids) if self.info.eos_token_ids else 0
        plan = StepPlan(
            inserts=(InsertSequence("warmup", (bos, bos, bos), 2, SamplingParams(temperature=0.0)),)
        )
        while True:
            out = self.apply(plan)
            plan = StepPlan()
            if any(t.finish_reason for t in out.tokens):
                break
        return time.perf_counter() - tic

    def apply(self, plan: StepPlan) -> StepOutput:
        with self._on_stream():
            return self._apply(plan)

    def _apply(self, plan: StepPlan) -> StepOutput:
        if plan != _PLAIN:
            self._gen.settle()  # what a plan changes may evaluate (``encoding``)
        if plan.reset_cache and self._cache is not None:
            self._cache.reset()
        for action in plan.slot_actions:
            self._slots.apply(action)
        if plan.removes or plan.stop_choices:
            self._remove(plan.removes, plan.stop_choices)
        for ending in plan.end_reasoning:
            for uid in self._uids_by_rid.get(ending, ()):
                if (guide := self._guides.get(uid)) is not None:
                    guide.end_thinking()
        cached = self._insert(plan.inserts) if plan.inserts else ()
        if not self._rid_by_uid:
            if self._busy:
                # Idle: hand every freed buffer back, so a quiet server sits at its floor
                # (model, prompt cache) whatever sizes the last burst needed.
                self._busy = False
                self._gen.settle()
                release_idle_memory()
            return StepOutput(cached=cached, cache=self._stats())
        self._busy = True

        prompt_responses, generation_responses = self._gen.next()
        if (
            prompt_responses
            or self._logprobs
            or self._guides
            or self._forks
            or self._shift
            or any(r.finish_reason is not None for r in generation_responses)
        ):
            # Scores, grammars, forks, context shifts and the prompt cache evaluate; a plain
            # step returns while its own graph is still being queued (``encoding``).
            self._gen.settle()
        drafts = self._drafts(bool(prompt_responses))
        errors = self._failed_guides(generation_responses) if self._guides else ()
        scored = self._score(generation_responses) if self._logprobs else {}
        tokens = []
        for n, r in enumerate(generation_responses):
            rid = self._rid_by_uid.get(r.uid)
            if rid is None:  # its request failed by a guide (or finished) just now
                continue
            lp, top = scored.get(n, (None, ()))
            choice = self._choice_by_uid[r.uid]
            tokens.append(TokenOut(rid, r.token, r.finish_reason, lp, top, choice))
            if r.finish_reason is not None:
                # The first choice to finish donates its cache; one entry per prompt is enough.
                gift = self._donation.pop(rid, None)
                if gift is not None and self._cache is not None and r.prompt_cache is not None:
                    self._store(rid, gift, list(r.all_tokens or ()), r.prompt_cache)
                    self._slots.donated(
                        self._slot_of.get(rid, -1), gift.key, list(r.all_tokens or ())
                    )
                self._forget(r.uid)
        shifted_rids: tuple[str, ...] = ()
        if self._shift is not None:
            shifted_rids = self._shift_full_rows(generation_responses)
        # Progress is the prompt's, read once by choice 0; the forked rows read nothing.
        prefill = tuple(
            PrefillProgress(self._rid_by_uid[p.uid], int(p.progress[0]), int(p.progress[1]))
            for p in prompt_responses
            if self._choice_by_uid.get(p.uid) == 0 and p.uid not in self._rereading
        )
        if self._forks:
            self._fork(prompt_responses)
        if not self._rid_by_uid:
            # The last row finished in this step, and the scheduler sends no step to an empty
            # batch: give the memory back now, not when the next request arrives.
            self._busy = False
            release_idle_memory()
        return StepOutput(
            tokens=tuple(tokens),
            prefill=prefill,
            errors=errors,
            cached=cached,
            cache=self._stats(),
            shifted=shifted_rids,
            drafts=drafts,
            proposer=self._spec.proposer if drafts and self._spec is not None else "",
        )

    def _drafts(self, read_prompts: bool) -> tuple[tuple[str, int, int], ...]:
        """Per request, the tokens proposed and accepted in this step."""
        if self._spec is None:
            return ()
        if read_prompts:
            # The step also read prompt chunks: its time says nothing of the decode's cost.
            self._spec.policy.costs.idle()
        if not self._spec.last_step:
            return ()
        out: dict[str, tuple[int, int]] = {}
        for uid, (proposed, accepted) in self._spec.last_step.items():
            rid = self._rid_by_uid.get(uid)
            if rid is not None:
                p, a = out.get(rid, (0, 0))
                out[rid] = (p + proposed, a + accepted)
        self._spec.last_step = {}
        return tuple((rid, p, a) for rid, (p, a) in out.items())

    def _shift_full_rows(self, responses: list[Any]) -> tuple[str, ...]:
        """Rows whose context is full leave the batch and join again with their kept tokens
        (``slots`` explains why they are read again rather than moved)."""
        assert self._shift is not None
        batch = mlx_lm_compat.generation_batch(self._gen)
        moves = []
        for r in responses:
            if r.finish_reason is not None or r.uid not in self._shift:
                continue
            found = row_state(batch, r.uid, r.token)
            if found is None or len(found[1]) + 1 < self._ctx:
                continue
            i, tokens, early = found
            n_keep, n_discard, n_prompt = self._shift[r.uid]
            moves.append(
                (
                    r.uid,
                    r.token if early else None,
                    shifted(tokens, self._ctx, n_keep, n_discard, n_prompt),
                    mlx_lm_compat.tokens_left(batch, i),
                    batch.samplers[i],
                    batch.logits_processors[i],
                    batch.stop_sequences[i],
                )
            )
        if not moves:
            return ()
        self._gen.remove([m[0] for m in moves])
        rids = []
        for old, unseen, tokens, left, sampler, processors, stops in moves:
            (new,) = self._gen.insert(
                [tokens],
                max_tokens=[max(left, 1)],
                all_tokens=[[]],
                samplers=[sampler],
                logits_processors=[processors],
                stop_sequences=[stops],
            )
            self._rename(old, new)
            self._rereading.add(new)
            rid = self._rid_by_uid[new]
            if (gift := self._donation.get(rid)) is not None:
                # Its cache no longer starts as its prompt did: none of it counts as exact.
                self._donation[rid] = attrs.evolve(gift, exact=0)
            if (guide := self._guides.get(new)) is not None:
                guide.rebase(unseen)
            rids.append(self._rid_by_uid[new])
        return tuple(dict.fromkeys(rids))

    def _rename(self, old: int, new: int) -> None:
        """A row that joined again under a new uid keeps everything it had."""
        rid = self._rid_by_uid.pop(old)
        self._rid_by_uid[new] = rid
        self._choice_by_uid[new] = self._choice_by_uid.pop(old)
        if old in self._logprobs:
            self._logprobs[new] = self._logprobs.pop(old)
        if old in self._guides:
            self._guides[new] = self._guides.pop(old)
        if old in self._lora_of:
            self._lora_of[new] = self._lora_of.pop(old)
        assert self._shift is not None
        self._shift[new] = self._shift.pop(old)
        self._rereading.discard(old)
        uids = self._uids_by_rid[rid]
        uids[uids.index(old)] = new

    def _failed_guides(self, responses: list[Any]) -> tuple[tuple[str, str], ...]:
        """Requests with a row whose matcher failed: every row of theirs leaves the batch, and
        the request is reported as failed."""
        failed: dict[str, str] = {}
        for r in responses:
            guide = self._guides.get(r.uid)
            if guide is not None and guide.error is not None:
                failed.setdefault(self._rid_by_uid[r.uid], guide.error)
        if failed:
            done = {r.uid for r in responses if r.finish_reason is not None}
            live = [u for rid in failed for u in self._uids_by_rid[rid] if u not in done]
            for rid in failed:
                for uid in list(self._uids_by_rid[rid]):
                    self._forget(uid)
            self._gen.remove(live)
        return tuple(failed.items())

    def _score(
        self, responses: list[Any]
    ) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
        """Log-probabilities for the tokens of rows that asked, in one evaluation for the whole
        step, by the token's place in ``responses`` (a speculating row reports several)."""
        rows = [
            (n, r, self._logprobs[r.uid])
            for n, r in enumerate(responses)
            if r.uid in self._logprobs
        ]
        if not rows:
            return {}
        # The batch hands out scores, not log-probabilities (eager_start's _decode).
        dist = mx.stack([r.logprobs for _, r, _ in rows])
        dist = dist - mx.logsumexp(dist, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(dist, mx.array([[r.token] for _, r, _ in rows]), axis=-1)
        k = max(k for _, _, k in rows)
        ids_list: list[list[int]]
        vals_list: list[list[float]]
        if k > 0:
            top_ids = mx.argpartition(-dist, kth=k - 1, axis=-1)[:, :k]
            top_vals = mx.take_along_axis(dist, top_ids, axis=-1)
            mx.eval(chosen, top_ids, top_vals)
            ids_list = cast(list[list[int]], top_ids.tolist())
            vals_list = cast(list[list[float]], top_vals.tolist())
        else:
            mx.eval(chosen)
            ids_list, vals_list = [[] for _ in rows], [[] for _ in rows]
        out = {}
        chosen_list = cast(list[list[float]], chosen.tolist())
        for (n, _, want), c, ids, vals in zip(rows, chosen_list, ids_list, vals_list, strict=True):
            top = sorted(zip(ids, vals, strict=True), key=lambda p: -p[1])[:want]
            out[n] = (float(c[0]), tuple((int(i), float(v)) for i, v in top))
        return out

    def _stats(self) -> CacheStats:
        stats = self._cache.stats() if self._cache is not None else CacheStats()
        tower = self._tower
        return attrs.evolve(
            stats,
            mlx_active=mx.get_active_memory(),
            mlx_cached=mx.get_cache_memory(),
            vision_hits=tower.hits if tower is not None else 0,
            vision_misses=tower.misses if tower is not None else 0,
        )

    def _insert(self, inserts: tuple[InsertSequence, ...]) -> tuple[tuple[str, int], ...]:
        rows: list[_Row] = []
        leaders: list[int] = []  # rows whose request forks its other choices later
        cached: list[tuple[str, int]] = []
        for s in inserts:
            prompt = list(s.prompt_tokens)
            cache, n = None, 0
            if s.images is not None and self._vision is not None:
                rows.extend(self._image_rows(s, prompt, cached))
                continue
            if self._cache is not None and s.cache_key is not None:
                # KV read under other adapter scales is never served: the scales key it.
                key = s.cache_key + lora.scale_tag(s.lora)
                seeded = s.sampling.seed is not None
                # Batch-invariant: a seeded prompt is read whole, in the chunks a lone request
                # reads it in (a cached prefix was computed in other chunks, or token by
                # token, and so differs from them in its last bits). Otherwise a seeded
                # prompt reuses only what a fresh read computes alike (prompt_cache.EXACT):
                # what the cached request read as its prompt, not its last prompt token or
                # its answer, which decode steps computed.
                same = 0
                if not (self._invariant and seeded):
                    cache, n, same = self._cache.lookup(key, prompt, exact=seeded)
                # All but its last token is read in prompt passes: exact, from an exact start.
                exact = len(prompt) - 1 if same == n else same
                self._donation[s.request_id] = _Donation(key, exact)
            cached.append((s.request_id, n))
            # With more than the last token left to read, choice 0 reads it alone and the
            # others fork from its cache afterwards (_fork); else all start from this one.
            forks_later = s.n > 1 and len(prompt) - n > 1
            if forks_later:
                leaders.append(len(rows))
            for choice in range(1 if forks_later else s.n):
                rows.append(_Row(s, choice, prompt[n:], cache, prompt[:n]))
        uids = self._start(rows)
        for i in leaders:
            self._forks[uids[i]] = rows[i].seq
        return tuple(cached)

    def _with_adapters(self, loaded: LoadedModel, settings: Settings) -> Any:
        """The model the batches call: with --lora, wrapped so that each forward pass
        applies the scales of the rows making it (models/lora.py)."""
        if not settings.lora:
            return loaded.model
        if loaded.vision is not None:
            raise AdapterError("--lora: adapters are served on text models only")
        if settings.batch_invariant:
            # Their matmuls are not among those --batch-invariant has checked (invariance.py).
            raise AdapterError("--lora cannot be combined with --batch-invariant")
        adapters = [lora.load_adapter(Path(path)) for path, _ in settings.lora]
        rows = lora.RowScales()
        lora.install(loaded.model, adapters, rows)
        return lora.LoraModel(loaded.model, rows, self._row_scales)

    def _row_scales(self, caller: Any, cache: Any, n_rows: int) -> mx.array | None:
        """The scales of the batch making this forward pass (its caller, whose cache it
        uses), row by row (None when no row of it uses an adapter: the pass runs at the base
        model's speed)."""
        if not self._lora_of:
            return None
        for batch in (
            caller,
            mlx_lm_compat.generation_batch(self._gen),
            mlx_lm_compat.prompt_batch(self._gen),
        ):
            uids = getattr(batch, "uids", None)
            if getattr(batch, "prompt_cache", None) is cache and len(uids or ()) == n_rows:
                break
        else:
            # A pass on rows we cannot name would run them under the wrong adapters.
            raise RuntimeError("LoRA: a forward pass on rows outside the batch")
        zero = (0.0,) * len(self.info.lora_paths)
        scales = [self._lora_of.get(uid, zero) for uid in batch.uids]
        if not any(any(row) for row in scales):
            return None
        return mx.array(scales, dtype=mx.float32)

    def _store(self, rid: str, gift: _Donation, tokens: list[int], cache: list[Any]) -> None:
        """Donate a row's cache to the prompt cache; an M-RoPE image row's entry keeps its
        position shift (a batch row's extracted cache knows only its length)."""
        assert self._cache is not None
        shift = self._shifts.pop(rid, 0)
        if shift:
            for layer in cache:
                setattr(layer, vlm.POSITION_SHIFT, shift)
        self._cache.store(gift.key, tokens, cache, gift.exact)

    def _image_rows(
        self, s: InsertSequence, prompt: list[int], cached: list[tuple[str, int]]
    ) -> list[_Row]:
        """An image prompt's rows: its images encoded and all of it but its last token read,
        in this step (models/vlm.py), the rows then joining like a prompt-cache hit.

        Image prompts stay out of the prompt cache (their image tokens are the same ids
        whatever the picture) unless ``--enable-vlm-prefix-cache``: then their entries are
        keyed by the images' digest too, and a hit serves the prompt only when it covers
        every image token (what follows is text, read as any prompt is)."""
        assert self._vision is not None
        images = s.images
        if self._vlm_prefix and self._cache is not None and s.cache_key is not None:
            key = f"{s.cache_key}\x00vision:{images.digest}"
            # The tower's pass is no prompt pass: no token of it counts as exact.
            self._donation[s.request_id] = _Donation(key, 0)
            cache, n, _ = self._cache.lookup(key, prompt)
            if cache is not None and n > images.last_media_token:
                self._shifts[s.request_id] = int(getattr(cache[0], vlm.POSITION_SHIFT, 0))
                cached.append((s.request_id, n))
                return [_Row(s, c, prompt[n:], cache, prompt[:n]) for c in range(s.n)]
        cache = self._vision.prefill(images)
        self._shifts[s.request_id] = int(getattr(cache[0], vlm.POSITION_SHIFT, 0))
        cached.append((s.request_id, 0))
        return [_Row(s, c, prompt[-1:], cache, prompt[:-1]) for c in range(s.n)]

    def _start(self, rows: list[_Row]) -> list[int]:
        """Insert these rows into the batch; each choice gets its own sampler chain."""
        chains = [
            sampler_chain.build(
                choice_sampling(r.seq.sampling, r.choice),
                vocab_size=self._vocab_size,
                encode=self._encode,
            )
            for r in rows
        ]
        guides = [
            self._kit.guide(
                grammar=r.seq.grammar,
                budget=r.seq.thinking_budget,
                reasoning_open=r.seq.reasoning_open,
                controllable=r.seq.reasoning_control,
            )
            for r in rows
        ]
        for (processors, _), guide in zip(chains, guides, strict=True):
            if guide is not None:  # last: it masks what the other processors produced
                processors.append(guide)
        uids: list[int] = self._gen.insert(
            [r.prompt for r in rows],
            max_tokens=[r.seq.max_tokens for r in rows],
            # BatchGenerator merges (copies) the caches it is given into its batch cache, so
            # the rows of one request may share a source cache object.
            caches=[r.cache for r in rows],  # type: ignore[misc] # None: a fresh cache
            # Each row's token history grows on its own: a list of its own.
            all_tokens=[list(r.known) for r in rows],
            samplers=[sampler for _, sampler in chains],
            logits_processors=[processors for processors, _ in chains],
            stop_sequences=[self._no_stop if r.seq.ignore_eos else self._eos_stop for r in rows],
        )
        for uid, r, guide in zip(uids, rows, guides, strict=True):
            if guide is not None:
                self._guides[uid] = guide
            rid = r.seq.request_id
            self._rid_by_uid[uid] = rid
            self._choice_by_uid[uid] = r.choice
            self._uids_by_rid.setdefault(rid, []).append(uid)
            if r.seq.logprobs is not None:
                self._logprobs[uid] = r.seq.logprobs
            if r.seq.priority == 0:
                self._urgent.add(uid)
            if any(r.seq.lora):
                self._lora_of[uid] = r.seq.lora
            if self._shift is not None:
                self._shift[uid] = (r.seq.n_keep, r.seq.n_discard, len(r.seq.prompt_tokens))
            if r.choice == 0:
                # The slot now holds this sequence: what it cached before is no longer its own
                # (the entry stays in the prompt cache for any prompt that shares it).
                self._slots.donated(r.seq.slot, None, [])
            self._slot_of.setdefault(rid, r.seq.slot)
        return uids

    def _fork(self, prompt_responses: list[Any]) -> None:
        """Start the other choices of requests whose first row has just read all of its prompt
        but the last token (that row's first segment ended in this step)."""
        for p in prompt_responses:
            if not p.end_of_segment or p.end_of_prompt or p.uid not in self._forks:
                continue
            seq = self._forks.pop(p.uid)
            cache, known = self._gen.extract_cache([p.uid])[p.uid]
            last = list(seq.prompt_tokens[-1:])
            self._start([_Row(seq, c, last, cache, known) for c in range(1, seq.n)])

    def _forget(self, uid: int) -> None:
        rid = self._rid_by_uid.pop(uid)
        del self._choice_by_uid[uid]
        self._logprobs.pop(uid, None)
        self._guides.pop(uid, None)
        self._forks.pop(uid, None)
        self._urgent.discard(uid)
        self._lora_of.pop(uid, None)
        if self._shift is not None:
            self._shift.pop(uid, None)
            self._rereading.discard(uid)
        uids = self._uids_by_rid[rid]
        uids.remove(uid)
        if not uids:
            del self._uids_by_rid[rid]
            self._donation.pop(rid, None)
            self._slot_of.pop(rid, None)
            self._shifts.pop(rid, None)

    def _remove(self, requests: tuple[str, ...], choices: tuple[tuple[str, int], ...]) -> None:
        """Drop whole requests, and single choices of others."""
        uids = [u for rid in requests for u in self._uids_by_rid.get(rid, ())]
        stop = set(choices)
        uids += [
            u
            for rid, _ in choices
            for u in self._uids_by_rid.get(rid, ())
            if (rid, self._choice_by_uid[u]) in stop
        ]
        uids = list(dict.fromkeys(uids))
        donors = self._donors(requests)
        caches = self._gen.remove(uids, return_prompt_caches=bool(donors))
        for uid, gift in donors.items():
            cache, tokens = caches[uid]
            self._store(self._rid_by_uid[uid], gift, list(tokens), cache)
            self._slots.donated(
                self._slot_of.get(self._rid_by_uid[uid], -1), gift.key, list(tokens)
            )
        for uid in uids:
            self._forget(uid)

    def _donors(self, requests: tuple[str, ...]) -> dict[int, _Donation]:
        """Per cancelled request, one row that has read tokens since its cache lookup, and
        its cache key: it donates what it has read, as a finished row does.

        A realtime turn cut off by the next question is that question's prefix, and a
        request cancelled during its prompt would otherwise leave the next one the same
        prompt to read again. Without this, a voice session whose answers are cut off
        before they start carries an ever longer unread tail (measured here: 62 -> 362
        tokens a turn over 5 minutes at 8 sessions, until no answer got past its prompt).
        """
        if self._cache is None:
            return {}
        # Where each row is: 0 waiting (nothing read), 1 reading its prompt, 2 generating.
        stages = mlx_lm_compat.row_stages(
            self._gen, [u for rid in requests for u in self._uids_by_rid.get(rid, ())]
        )
        donors = {}
        for rid in requests:
            gift = self._donation.get(rid)
            uids = [u for u in self._uids_by_rid.get(rid, ()) if stages.get(u, 0) > 0]
            if gift is not None and uids:
                donors[uids[0]] = gift
        return donors

    def close(self) -> None:
        """Last call on the compute thread: mlx's per-thread streams must not outlive it.

        The model's memory goes back too (router mode unloads models): every array this
        backend holds is dropped, reference cycles are collected, and mlx's allocator
        returns the freed buffers instead of keeping them for reuse."""
        try:
            self._gen.settle()
            self._gen.close()
        finally:  # whatever the last step raised, the encoder's thread ends
            if self._encoder is not None:
                self._encoder.close()
        self.__dict__.clear()
        gc.collect()
        release_idle_memory()
        release_thread_streams()


def _held_arrays(loaded: LoadedModel) -> list[mx.array]:
    """Every array the model's modules hold, private ones too (``parameters()`` skips names
    that start with an underscore); a vision model's whole model."""
    roots = [loaded.model, loaded.vision.model if loaded.vision is not None else None]
    return [
        value
        for root in roots
        if isinstance(root, nn.Module)
        for _, module in root.named_modules()
        for value in (*module.values(), *vars(module).values())
        if isinstance(value, mx.array)
    ]


def _draft_model(
    loaded: LoadedModel, draft: LoadedModel | None, settings: Settings
) -> DraftModel | None:
    """The ``--model-draft`` proposer; refuses a draft that does not speak the model's
    tokens (its proposals would be other words under the same ids)."""
    if settings.spec_kind != "draft":
        return None
    if draft is None:
        raise RuntimeError("--model-draft: the draft model was not loaded")
    ours, theirs = loaded.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if ours != theirs:
        raise RuntimeError(
            f"--model-draft {settings.model_draft}: its tokenizer is not the model's "
            f"({len(theirs)} tokens against {len(ours)}, or the same count under other ids)"
        )
    try:
        return DraftModel(draft.model, p_min=settings.draft_p_min, min_tokens=settings.draft_min)
    except ValueError as e:
        raise RuntimeError(f"--model-draft {settings.model_draft}: {e}") from None


def _guide_kit(loaded: LoadedModel, encode: Any, vocab_size: int) -> GuideKit:
    fmt = detect_reasoning(loaded.chat_template)
    think = (tuple(encode(fmt.start)), tuple(encode(fmt.end))) if fmt is not None else None
    return GuideKit(
        loaded.tokenizer,
        vocab_size=vocab_size,
        eos_token_ids=sorted(loaded.eos_token_ids),
        think=think,
    )

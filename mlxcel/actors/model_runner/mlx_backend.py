"""The production Backend: mlx-lm's BatchGenerator on the model runner's thread."""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from mlxcel.actors.model_runner import sampler_chain
from mlxcel.actors.model_runner.backend import ModelInfo
from mlxcel.actors.model_runner.guide import Guide, GuideKit
from mlxcel.actors.model_runner.prompt_cache import PromptCache
from mlxcel.actors.reasoning import detect_reasoning
from mlxcel.models.loader import LoadedModel, release_thread_streams
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


class MlxBackend:
    def __init__(self, loaded: LoadedModel, settings: Settings) -> None:
        self._loaded = loaded
        ctx = settings.ctx_size or loaded.context_length
        self.info = ModelInfo(
            model_id=settings.alias or loaded.model_id,
            path=loaded.path,
            tokenizer=loaded.tokenizer,
            eos_token_ids=frozenset(loaded.eos_token_ids),
            context_length=ctx,
            chat_template=loaded.chat_template,
            description=f"{loaded.model_id} ({loaded.dtype})",
        )
        self._gen = BatchGenerator(
            loaded.model,
            max_tokens=ctx,
            stop_tokens=[[t] for t in sorted(loaded.eos_token_ids)],
            completion_batch_size=settings.parallel,
            # Prompts are read in waves of at most 8 (mlx_lm.server's default): a wave of 16
            # would hold every first token until the whole wave is read.
            prefill_batch_size=min(settings.parallel, 8),
            prefill_step_size=settings.prefill_chunk_size,
        )
        self._vocab_size = int(loaded.vocab_size)
        tok = loaded.tokenizer
        self._encode = lambda s: list(tok.encode(s, add_special_tokens=False))
        self._eos_stop = StopSequences([[t] for t in sorted(loaded.eos_token_ids)])
        self._no_stop = StopSequences()
        self._rid_by_uid: dict[int, str] = {}
        self._uid_by_rid: dict[str, int] = {}
        self._cache_key: dict[str, str] = {}
        self._logprobs: dict[str, int] = {}
        self._cache = PromptCache(settings.cache_ram_mib << 20) if settings.cache_enabled else None
        self._guides: dict[str, Guide] = {}
        self._kit = _guide_kit(loaded, self._encode, self._vocab_size)

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
        if plan.reset_cache and self._cache is not None:
            self._cache.reset()
        if plan.removes:
            uids = [self._uid_by_rid.pop(rid) for rid in plan.removes if rid in self._uid_by_rid]
            for rid in plan.removes:
                self._cache_key.pop(rid, None)
                self._logprobs.pop(rid, None)
                self._guides.pop(rid, None)
            for uid in uids:
                self._rid_by_uid.pop(uid, None)
            self._gen.remove(uids)
        cached = self._insert(plan.inserts) if plan.inserts else ()
        if not self._rid_by_uid:
            return StepOutput(cached=cached, cache=self._stats())

        prompt_responses, generation_responses = self._gen.next()
        errors = self._failed_guides(generation_responses) if self._guides else ()
        scored = self._score(generation_responses) if self._logprobs else {}
        tokens = []
        for r in generation_responses:
            if r.uid not in self._rid_by_uid:  # failed by its guide just now
                continue
            rid = self._rid_by_uid[r.uid]
            lp, top = scored.get(r.uid, (None, ()))
            tokens.append(TokenOut(rid, r.token, r.finish_reason, lp, top))  # type: ignore[arg-type]
            if r.finish_reason is not None:
                self._logprobs.pop(rid, None)
                self._guides.pop(rid, None)
                del self._rid_by_uid[r.uid]
                del self._uid_by_rid[rid]
                key = self._cache_key.pop(rid, None)
                if key is not None and self._cache is not None and r.prompt_cache is not None:
                    self._cache.store(key, list(r.all_tokens or ()), r.prompt_cache)
        prefill = tuple(
            PrefillProgress(self._rid_by_uid[p.uid], int(p.progress[0]), int(p.progress[1]))
            for p in prompt_responses
            if p.uid in self._rid_by_uid
        )
        return StepOutput(
            tokens=tuple(tokens), prefill=prefill, errors=errors, cached=cached, cache=self._stats()
        )

    def _failed_guides(self, responses: list[Any]) -> tuple[tuple[str, str], ...]:
        """Sequences whose matcher failed: dropped from the batch and reported as errors."""
        failed = []
        for r in responses:
            rid = self._rid_by_uid[r.uid]
            guide = self._guides.get(rid)
            if guide is None or guide.error is None:
                continue
            failed.append((rid, guide.error))
            del self._guides[rid], self._rid_by_uid[r.uid], self._uid_by_rid[rid]
            self._logprobs.pop(rid, None)
            self._cache_key.pop(rid, None)
            if r.finish_reason is None:
                self._gen.remove([r.uid])
        return tuple(failed)

    def _score(
        self, responses: list[Any]
    ) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
        """Log-probabilities for the rows that asked, in one evaluation for the whole step."""
        rows = [
            (r, self._logprobs[rid])
            for r in responses
            if (rid := self._rid_by_uid.get(r.uid)) in self._logprobs
        ]
        if not rows:
            return {}
        dist = mx.stack([r.logprobs for r, _ in rows])
        chosen = mx.take_along_axis(dist, mx.array([[r.token] for r, _ in rows]), axis=-1)
        k = max(k for _, k in rows)
        if k > 0:
            top_ids = mx.argpartition(-dist, kth=k - 1, axis=-1)[:, :k]
            top_vals = mx.take_along_axis(dist, top_ids, axis=-1)
            mx.eval(chosen, top_ids, top_vals)
            ids_list, vals_list = top_ids.tolist(), top_vals.tolist()
        else:
            mx.eval(chosen)
            ids_list = vals_list = [[] for _ in rows]
        out = {}
        for (r, want), c, ids, vals in zip(rows, chosen.tolist(), ids_list, vals_list, strict=True):
            top = sorted(zip(ids, vals, strict=True), key=lambda p: -p[1])[:want]
            out[r.uid] = (float(c[0]), tuple((int(i), float(v)) for i, v in top))
        return out

    def _stats(self) -> CacheStats | None:
        return self._cache.stats() if self._cache is not None else None

    def _insert(self, inserts: tuple[InsertSequence, ...]) -> tuple[tuple[str, int], ...]:
        prompts, caches, known, cached = [], [], [], []
        for s in inserts:
            prompt = list(s.prompt_tokens)
            cache, n = None, 0
            if s.logprobs is not None:
                self._logprobs[s.request_id] = s.logprobs
            if self._cache is not None and s.cache_key is not None:
                cache, n = self._cache.lookup(s.cache_key, prompt)
                self._cache_key[s.request_id] = s.cache_key
            prompts.append(prompt[n:])
            caches.append(cache)
            known.append(prompt[:n])
            cached.append((s.request_id, n))
        chains = [
            sampler_chain.build(s.sampling, vocab_size=self._vocab_size, encode=self._encode)
            for s in inserts
        ]
        for s, (processors, _) in zip(inserts, chains, strict=True):
            guide = self._kit.guide(
                grammar=s.grammar, budget=s.thinking_budget, reasoning_open=s.reasoning_open
            )
            if guide is not None:  # last: it masks what the other processors produced
                processors.append(guide)
                self._guides[s.request_id] = guide
        uids = self._gen.insert(
            prompts,
            max_tokens=[s.max_tokens for s in inserts],
            caches=caches,
            all_tokens=known,
            samplers=[sampler for _, sampler in chains],
            logits_processors=[processors for processors, _ in chains],
            stop_sequences=[self._no_stop if s.ignore_eos else self._eos_stop for s in inserts],
        )
        for uid, seq in zip(uids, inserts, strict=True):
            self._rid_by_uid[uid] = seq.request_id
            self._uid_by_rid[seq.request_id] = uid
        return tuple(cached)

    def close(self) -> None:
        """Last call on the compute thread: mlx's per-thread streams must not outlive it."""
        self._gen.close()
        mx.clear_cache()
        release_thread_streams()


def _guide_kit(loaded: LoadedModel, encode: Any, vocab_size: int) -> GuideKit:
    fmt = detect_reasoning(loaded.chat_template)
    think = (tuple(encode(fmt.start)), tuple(encode(fmt.end))) if fmt is not None else None
    return GuideKit(
        loaded.tokenizer,
        vocab_size=vocab_size,
        eos_token_ids=sorted(loaded.eos_token_ids),
        think=think,
    )

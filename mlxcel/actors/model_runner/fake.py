"""A deterministic backend for tests: no mlx, real token ids, scripted timing.

Each sequence first "prefills" its prompt in chunks of ``prefill_chunk`` tokens, one chunk per
step, then emits ``script`` tokens one per step (cycling), ending with ``eos`` after
``eos_after`` tokens when that is set, else at max_tokens. ``step_delay`` makes every step take
real time so tests can disconnect mid-prefill; ``chunks_done`` records prefill work per request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs

from mlxcel.actors.model_runner.backend import ModelInfo
from mlxcel.runtime.messages import PrefillProgress, StepOutput, StepPlan, TokenOut


@attrs.define
class _Seq:
    request_id: str
    prompt_len: int
    max_tokens: int
    ignore_eos: bool = False
    logprobs: int | None = None
    prefilled: int = 0
    generated: int = 0


class FakeBackend:
    def __init__(
        self,
        info: ModelInfo,
        *,
        script: Sequence[int],
        eos_after: int | None = None,
        prefill_chunk: int = 512,
        step_delay: float = 0.0,
    ) -> None:
        self.info = info
        self._script = list(script)
        self._eos = min(info.eos_token_ids) if info.eos_token_ids else 0
        self._eos_after = eos_after
        self._chunk = prefill_chunk
        self._delay = step_delay
        self._seqs: dict[str, _Seq] = {}
        self.chunks_done: dict[str, int] = {}
        self.steps = 0

    def apply(self, plan: StepPlan) -> StepOutput:
        for rid in plan.removes:
            self._seqs.pop(rid, None)
        for ins in plan.inserts:
            self._seqs[ins.request_id] = _Seq(
                ins.request_id, len(ins.prompt_tokens), ins.max_tokens, ins.ignore_eos, ins.logprobs
            )
        if not self._seqs:
            return StepOutput()
        self.steps += 1
        if self._delay:
            time.sleep(self._delay)
        tokens: list[TokenOut] = []
        prefill: list[PrefillProgress] = []
        for seq in list(self._seqs.values()):
            if seq.prefilled < seq.prompt_len:
                seq.prefilled = min(seq.prompt_len, seq.prefilled + self._chunk)
                self.chunks_done[seq.request_id] = self.chunks_done.get(seq.request_id, 0) + 1
                prefill.append(PrefillProgress(seq.request_id, seq.prefilled, seq.prompt_len))
                continue
            if (
                not seq.ignore_eos
                and self._eos_after is not None
                and seq.generated >= self._eos_after
            ):
                tokens.append(TokenOut(seq.request_id, self._eos, "stop"))
            else:
                token = self._script[seq.generated % len(self._script)]
                seq.generated += 1
                reason = "length" if seq.generated >= seq.max_tokens else None
                # Deterministic scores: the sampled token is the most likely one.
                top = tuple((token + i, -0.5 * (i + 1)) for i in range(seq.logprobs or 0))
                lp = -0.5 if seq.logprobs is not None else None
                tokens.append(TokenOut(seq.request_id, token, reason, lp, top))
            if tokens[-1].finish_reason is not None:
                del self._seqs[seq.request_id]
        return StepOutput(tokens=tuple(tokens), prefill=tuple(prefill))

    def close(self) -> None:
        self._seqs.clear()

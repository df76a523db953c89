"""A deterministic backend for tests: no mlx, real token ids, scripted timing.

Each sequence first "prefills" its prompt in chunks of ``prefill_chunk`` tokens, one chunk per
step, then emits ``script`` tokens one per step (cycling), ending with ``eos`` after
``eos_after`` tokens when that is set, else at max_tokens. ``step_delay`` makes every step take
real time so tests can disconnect mid-prefill; ``chunks_done`` records prefill work per request
and ``prompt_tokens_read`` every prompt token read.

A request with n choices reads its prompt once, then decodes n rows; choice i reads the script
shifted by ``i * choice_shift`` tokens, so choices differ as sampled ones would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs

from mlxcel.actors.model_runner.backend import ModelInfo
from mlxcel.runtime.messages import (
    FinishReason,
    PrefillProgress,
    StepOutput,
    StepPlan,
    TokenOut,
)


@attrs.define
class _Seq:
    request_id: str
    prompt_len: int
    max_tokens: int
    ignore_eos: bool = False
    logprobs: int | None = None
    prefilled: int = 0
    generated: int = 0
    choice: int = 0
    # The leader (choice 0) of an n-choice request forks n - 1 rows once its prompt is read.
    forks: int = 0


class FakeBackend:
    def __init__(
        self,
        info: ModelInfo,
        *,
        script: Sequence[int],
        eos_after: int | None = None,
        prefill_chunk: int = 512,
        step_delay: float = 0.0,
        choice_shift: int = 1,
    ) -> None:
        self.info = info
        self._script = list(script)
        self._eos = min(info.eos_token_ids) if info.eos_token_ids else 0
        self._eos_after = eos_after
        self._chunk = prefill_chunk
        self._delay = step_delay
        self._shift = choice_shift
        self._seqs: dict[tuple[str, int], _Seq] = {}
        self.chunks_done: dict[str, int] = {}
        self.prompt_tokens_read = 0
        self.steps = 0
        # Rows in the batch at each step (tests read it, rather than sampling ``rows``).
        self.rows_per_step: list[int] = []

    @property
    def rows(self) -> int:
        """Sequences in the batch (one per live choice)."""
        return len(self._seqs)

    def apply(self, plan: StepPlan) -> StepOutput:
        for action in plan.slot_actions:
            action.reply.error = "the fake backend keeps no slot caches"
        gone = set(plan.removes)
        for key in [k for k in self._seqs if k[0] in gone]:
            del self._seqs[key]
        for key in plan.stop_choices:
            self._seqs.pop(key, None)
        for ins in plan.inserts:
            self._seqs[ins.request_id, 0] = _Seq(
                ins.request_id,
                len(ins.prompt_tokens),
                ins.max_tokens,
                ins.ignore_eos,
                ins.logprobs,
                forks=ins.n - 1,
            )
        if not self._seqs:
            return StepOutput()
        self.steps += 1
        self.rows_per_step.append(len(self._seqs))
        if self._delay:
            time.sleep(self._delay)
        tokens: list[TokenOut] = []
        prefill: list[PrefillProgress] = []
        for seq in list(self._seqs.values()):
            if seq.prefilled < seq.prompt_len:
                read = min(seq.prompt_len, seq.prefilled + self._chunk) - seq.prefilled
                seq.prefilled += read
                self.prompt_tokens_read += read
                self.chunks_done[seq.request_id] = self.chunks_done.get(seq.request_id, 0) + 1
                prefill.append(PrefillProgress(seq.request_id, seq.prefilled, seq.prompt_len))
                if seq.prefilled == seq.prompt_len:
                    self._fork(seq)
                continue
            tokens.append(self._decode(seq))
            if tokens[-1].finish_reason is not None:
                del self._seqs[seq.request_id, seq.choice]
        return StepOutput(tokens=tuple(tokens), prefill=tuple(prefill))

    def _fork(self, leader: _Seq) -> None:
        """The prompt is read: its other choices start from the same state, reading nothing."""
        for choice in range(1, leader.forks + 1):
            self._seqs[leader.request_id, choice] = attrs.evolve(leader, choice=choice, forks=0)
        leader.forks = 0

    def _decode(self, seq: _Seq) -> TokenOut:
        if not seq.ignore_eos and self._eos_after is not None and seq.generated >= self._eos_after:
            return TokenOut(seq.request_id, self._eos, "stop", choice=seq.choice)
        token = self._script[(seq.generated + seq.choice * self._shift) % len(self._script)]
        seq.generated += 1
        reason: FinishReason | None = "length" if seq.generated >= seq.max_tokens else None
        # Deterministic scores: the sampled token is the most likely one.
        top = tuple((token + i, -0.5 * (i + 1)) for i in range(seq.logprobs or 0))
        lp = -0.5 if seq.logprobs is not None else None
        return TokenOut(seq.request_id, token, reason, lp, top, choice=seq.choice)

    def close(self) -> None:
        self._seqs.clear()

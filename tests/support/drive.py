"""Drive a real backend through a list of requests, as the scheduler would: the first starts
alone, the others join one at a time while rows decode; collect what each request got."""

from __future__ import annotations

from typing import Any

import attrs

from mlxcel.runtime.messages import InsertSequence, SamplingParams, StepPlan

GREEDY = SamplingParams(temperature=0.0)
LOOP = tuple([5, 6, 7, 8, 9] * 6)


def mixed_requests() -> list[InsertSequence]:
    """Requests that each take another path through a step: log-probabilities, two choices
    forked from one prompt, a logits processor (repetition penalty), a 3-token limit."""
    return [
        InsertSequence("lp", (3, 4, 3, 4, 3, 4, 3), 30, GREEDY, logprobs=3, ignore_eos=True),
        InsertSequence("two", tuple(range(20, 40)) * 2, 25, GREEDY, n=2, ignore_eos=True),
        InsertSequence(
            "pen",
            LOOP,
            20,
            SamplingParams(temperature=0.0, repetition_penalty=1.3),
            ignore_eos=True,
        ),
        InsertSequence("short", LOOP, 3, GREEDY, ignore_eos=True),
    ]


@attrs.define
class Run:
    # Per (request, choice): (token, log-probability, top log-probabilities) per step.
    tokens: dict[tuple[str, int], list[Any]] = attrs.Factory(dict)
    finish: dict[tuple[str, int], str] = attrs.Factory(dict)
    errors: list[tuple[str, str]] = attrs.Factory(list)
    proposed: int = 0  # speculation's tokens proposed and accepted over the run
    accepted: int = 0


def drive(backend: Any, inserts: list[InsertSequence], *, join_every: int) -> Run:
    """Apply steps until every request is done; a waiting request joins every
    ``join_every`` steps."""
    run = Run()
    plan = StepPlan(inserts=(inserts[0],))
    later = list(inserts[1:])
    for step in range(400):
        out = backend.apply(plan)
        joins = later and step % join_every == join_every - 1
        plan = StepPlan(inserts=(later.pop(0),)) if joins else StepPlan()
        for t in out.tokens:
            run.tokens.setdefault((t.request_id, t.choice), []).append(
                (t.token, t.logprob, t.top_logprobs)
            )
            if t.finish_reason is not None:
                run.finish[t.request_id, t.choice] = t.finish_reason
        run.errors.extend(out.errors)
        for _, p, a in out.drafts:
            run.proposed, run.accepted = run.proposed + p, run.accepted + a
        if not backend._rid_by_uid and not later:
            break
    return run


def drive_schedule(
    backend: Any, schedule: list[tuple[int, InsertSequence]]
) -> dict[str, list[Any]]:
    """Insert each sequence at its step (the step numbers of ``schedule``) and apply steps until
    every row is done: each request's (token, log-probability) in order."""
    out: dict[str, list[Any]] = {}
    step, pending = 0, sorted(schedule, key=lambda p: p[0])
    while pending or backend._rid_by_uid:
        inserts = tuple(s for at, s in pending if at <= step)
        pending = [(at, s) for at, s in pending if at > step]
        for t in backend.apply(StepPlan(inserts=inserts)).tokens:
            out.setdefault(t.request_id, []).append((t.token, t.logprob))
        step += 1
    return out

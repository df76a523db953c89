"""n choices from one prompt: what differs between the rows of one request (no mlx here).

The prompt is read once, by the request's first row (choice 0); the other n - 1 rows start
from a copy of its KV cache holding every prompt token but the last, and feed that last token
themselves (each row needs its own KV entry for it). So a prompt of P tokens costs P - 1 + n
token evaluations, not n * P.
"""

from __future__ import annotations

import attrs

from mlxcel.runtime.messages import SamplingParams

_SEEDS = 2**64


def choice_sampling(sampling: SamplingParams, choice: int) -> SamplingParams:
    """Choice i of a seeded request draws from seed + i (mod 2**64): each choice reproducible
    on its own, and the choices differ. Unseeded choices share the process-wide generator,
    which draws independently per row."""
    if choice == 0 or sampling.seed is None:
        return sampling
    return attrs.evolve(sampling, seed=(sampling.seed + choice) % _SEEDS)

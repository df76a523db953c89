"""N-gram speculation: the proposer, the policy, and the batched verification on a model whose
next-token distribution is known exactly (a Markov chain over a tiny vocabulary), so the
output's distribution can be checked against it."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import BatchKVCache

from mlxcel.actors.model_runner import sampler_chain
from mlxcel.actors.model_runner.speculation import (
    FIRST_SAMPLES,
    MAX_ROWS,
    PROBE_EVERY,
    Choice,
    NgramIndex,
    Policy,
    RowStats,
    StepCosts,
)
from mlxcel.actors.model_runner.speculative_batch import Speculation, SpeculativeGenerationBatch
from mlxcel.runtime.messages import SamplingParams

# -- the proposer -------------------------------------------------------------------------------


def test_proposes_what_followed_the_longest_earlier_match() -> None:
    index = NgramIndex()
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # "1 2 3" occurred at the start (followed by 4 5); "2 3" more recently (followed by 7 8):
    # the longer match wins.
    assert index.propose(2) == ([4, 5], 3)
    assert index.propose(10)[0][:3] == [4, 5, 9]


def test_prefers_the_most_recent_occurrence_and_respects_the_limit() -> None:
    index = NgramIndex()
    index.extend([5, 6, 1, 5, 6, 2, 5, 6])
    assert index.propose(1) == ([2], 2)
    assert index.propose(0) == ([], 0)


def test_nothing_to_propose_without_an_earlier_match() -> None:
    index = NgramIndex()
    index.extend([1, 2, 3, 4])
    assert index.propose(4) == ([], 0)


def test_grows_one_token_at_a_time_like_a_whole_extend() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    whole, steps = NgramIndex(), NgramIndex()
    whole.extend(tokens)
    for t in tokens:
        steps.extend([t])
    assert whole.propose(5) == steps.propose(5)


# -- the policy ---------------------------------------------------------------------------------


def _costs(policy: Policy, rows: int, width: int, seconds: float) -> None:
    """Teach ``policy`` that a step of this shape costs ``seconds``."""
    costs = policy.costs
    costs.idle()
    costs.started(rows, width, 0.0)
    costs.started(rows, width, seconds)
    costs.idle()


def _stats(accepted: int, checked: int) -> RowStats:
    s = RowStats()
    s.accepted, s.checked = float(accepted), float(checked)
    return s


def test_a_row_that_copies_speculates_far_at_one_row() -> None:
    policy = Policy(16)
    _costs(policy, 1, 1, 0.070)
    for width, seconds in ((2, 0.072), (3, 0.074), (5, 0.082), (9, 0.102), (17, 0.105)):
        _costs(policy, 1, width, seconds)
    choice = policy.choose(1, [(_stats(30, 31), 16)])
    assert choice.width == 16 and choice.gain > 5


def test_a_row_that_is_mostly_wrong_does_not_pay_for_long_proposals() -> None:
    policy = Policy(16)
    _costs(policy, 4, 1, 0.090)
    for width, seconds in ((2, 0.120), (3, 0.133), (5, 0.140), (9, 0.190), (17, 0.240)):
        _costs(policy, 4, width, seconds)
    poor = [(_stats(1, 30), 16)] * 4
    assert policy.choose(4, poor) == Choice(0, 1.0)


def test_never_with_more_rows_than_the_cap_or_without_a_plain_step_measured() -> None:
    policy = Policy(16)
    good = [(_stats(30, 31), 16)]
    assert policy.choose(1, good).width == 0  # nothing measured yet
    _costs(policy, MAX_ROWS + 1, 1, 0.2)
    assert policy.choose(MAX_ROWS + 1, good * (MAX_ROWS + 1)).width == 0


def test_a_step_cost_moves_little_on_an_outlier() -> None:
    costs = StepCosts()
    clock = 0.0
    for _ in range(FIRST_SAMPLES + 2):  # steps of 0.1 s, timed
        costs.started(1, 1, clock)
        clock += 0.1
    costs.started(1, 1, clock)
    costs.started(1, 1, clock + 10.0)  # a 10 s pause counts as at most twice the estimate
    estimate = costs.estimate(1, 1)
    assert estimate is not None and 0.1 < estimate < 0.121


def test_a_slow_first_step_does_not_price_the_shape() -> None:
    # The first plain step after a prompt timed the prompt's evaluation too (0.42 s against
    # 0.02 s): taken as the cost, it made every proposal look cheap for the rest of the row.
    costs = StepCosts()
    costs.started(1, 1, 0.0)
    costs.started(1, 1, 0.42)
    costs.started(1, 1, 0.44)
    assert costs.estimate(1, 1) == pytest.approx(0.02)
    # Time in which prompts were read is not a step's (the batch calls idle for it).
    costs.idle()
    costs.started(1, 1, 5.0)
    assert costs.estimate(1, 1) == pytest.approx(0.02)


def test_acceptance_forgets_old_evidence() -> None:
    stats = RowStats()
    for _ in range(20):
        stats.record(8, 8)
    assert stats.rate > 0.9
    for _ in range(20):
        stats.record(8, 0)
    assert stats.rate < 0.3
    assert (stats.proposed_n, stats.accepted_n) == (320, 160)


# -- verification in the batch, on a Markov chain ----------------------------------------------

VOCAB = 5


class Markov:
    """Logits that depend on the last token only (``table[token]``). Every token it reads is
    written to the batch cache as its own key, so the cache can be checked afterwards."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = mx.array(table)

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        kv = x.astype(mx.float32)[:, None, :, None]
        cache[0].update_and_fetch(kv, kv)
        return self.table[x]


class Always:
    """A policy that speculates every step, as far as asked (to test the verification)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.max_tokens = width
        self.costs = StepCosts()

    def worth_looking(self, rows: int, stats: list[Any]) -> bool:
        return True

    def choose(self, rows: int, proposals: list[Any]) -> Choice:
        return Choice(self.width if proposals else 0, 2.0)


def _batch(model: Markov, prompts: list[list[int]], sampler: Any, limit: int, width: int) -> Any:
    longest = max(len(p) for p in prompts) - 1
    pads = [longest - (len(p) - 1) for p in prompts]
    cache = [BatchKVCache(pads)]
    model(mx.array([[0] * pad + p[:-1] for p, pad in zip(prompts, pads, strict=True)]), cache)
    batch = SpeculativeGenerationBatch(
        model,
        list(range(len(prompts))),
        mx.array([p[-1] for p in prompts]),
        cache,
        [list(p[:-1]) for p in prompts],
        [sampler] * len(prompts),
        sampler,
        [[] for _ in prompts],
        [StopSequences() for _ in prompts],
        [limit] * len(prompts),
    )
    spec = Speculation(width, 100_000)
    spec.policy = Always(width)  # type: ignore[assignment]  # a test double with its interface
    batch.speculation = spec
    return batch


def _generate(batch: Any) -> tuple[dict[int, list[int]], int, int]:
    """Run to the end; per row its tokens, and the tokens proposed and accepted."""
    out: dict[int, list[int]] = {uid: [] for uid in batch.uids}
    proposed = accepted = 0
    while batch.uids:
        for r in batch.next():
            out[r.uid].append(r.token)
        for p, a in batch.speculation.last_step.values():
            proposed, accepted = proposed + p, accepted + a
    return out, proposed, accepted


def _table(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, 1.2, size=(VOCAB, VOCAB)).astype(np.float32)


def test_greedy_tokens_are_the_chain_s_argmax_whatever_is_proposed() -> None:
    table = _table(1)
    model = Markov(table)
    greedy = sampler_chain.build(SamplingParams(temperature=0.0), vocab_size=VOCAB, encode=list)[1]
    prompts = [[0, 1, 2, 3, 4, 0, 1], [3, 3, 2], [4, 1, 4, 1, 4]]
    out, proposed, accepted = _generate(_batch(model, prompts, greedy, 40, 4))
    assert proposed > 0 and accepted > 0
    for uid, prompt in enumerate(prompts):
        expect, last = [], prompt[-1]
        for _ in range(40):
            last = int(np.argmax(table[last]))
            expect.append(last)
        assert out[uid] == expect


def test_sampled_tokens_follow_the_model_s_distribution() -> None:
    """8 rows x 800 tokens at temperature 1, proposals checked every step: the transition
    frequencies match the chain's probabilities (chi-square, 20 degrees of freedom)."""
    mx.random.seed(7)
    table = _table(2)
    probs = np.exp(table) / np.exp(table).sum(axis=1, keepdims=True)
    model = Markov(table)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    sampler = sampler_chain.build(params, vocab_size=VOCAB, encode=list)[1]
    prompts = [[i % VOCAB, (i * 3) % VOCAB, i % VOCAB, (i * 3) % VOCAB] for i in range(8)]
    out, proposed, accepted = _generate(_batch(model, prompts, sampler, 800, 3))
    # Both outcomes of a check happened many times.
    assert accepted > 1000 and proposed - accepted > 1000
    counts = np.zeros((VOCAB, VOCAB))
    for uid, prompt in enumerate(prompts):
        seq = [prompt[-1], *out[uid]]
        for a, b in zip(seq, seq[1:], strict=False):
            counts[a, b] += 1
    expected = counts.sum(axis=1, keepdims=True) * probs
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 20 degrees of freedom: P(chi2 > 45.3) = 0.001.
    assert chi2 < 45.3, (chi2, counts, expected)


@pytest.mark.parametrize("width", [1, 4])
def test_the_cache_keeps_only_accepted_tokens_row_by_row(width: int) -> None:
    """Rows reject different numbers of tokens each step; afterwards each row's cached keys
    are exactly its tokens (the cache writes each token id as its key)."""
    mx.random.seed(3)
    table = _table(3)
    model = Markov(table)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    sampler = sampler_chain.build(params, vocab_size=VOCAB, encode=list)[1]
    prompts = [[0, 1, 0, 1], [2, 2, 2, 2, 2, 2], [3, 4]]
    batch = _batch(model, prompts, sampler, 10_000, width)
    for _ in range(30):
        batch.next()
    cache = batch.prompt_cache[0]
    pads = cache.left_padding.tolist()
    for i, pad in enumerate(pads):
        keys = cache.keys[i, 0, pad : cache._idx, 0].tolist()
        assert [int(k) for k in keys] == batch.tokens[i]
        assert int(cache.offset[i].item()) == len(batch.tokens[i])


def test_a_new_row_starts_from_the_server_s_recent_record() -> None:
    """Free writing's proposals have been mostly wrong lately: a new row does not pay to try
    its luck at even odds in a batch of 4."""
    policy = Policy(16)
    _costs(policy, 4, 1, 0.093)
    for width, seconds in ((2, 0.120), (3, 0.133), (5, 0.141)):
        _costs(policy, 4, width, seconds)
    assert policy.choose(4, [(RowStats(), 8)] * 4).width > 0  # even odds: worth a try
    assert policy.choose(4, [(RowStats(prior=0.2), 8)] * 4).width == 0
    assert RowStats(prior=0.2).rate == pytest.approx(0.2)


# -- whether looking pays -----------------------------------------------------------------------


def _looking(found: float, accepted: int, checked: int) -> RowStats:
    s = _stats(accepted, checked)
    s.looks, s.found = 10.0, 10.0 * found
    return s


def _one_row_costs(policy: Policy) -> None:
    # One row of the default model here: a plain step 19 ms, one that looked and decoded
    # plainly 22 ms (the host sync loses the overlap), verifying 1 / 3 / 7 extra tokens more.
    _costs(policy, 1, 1, 0.019)
    _costs(policy, 1, 0, 0.022)
    for width, seconds in ((2, 0.024), (3, 0.030), (5, 0.045), (9, 0.075), (17, 0.085)):
        _costs(policy, 1, width, seconds)


def test_free_writing_does_not_look_at_its_pending_token() -> None:
    """Half the looks find nothing and a quarter of what is proposed is right: a look costs
    more than it brings, so the row decodes plainly (probing every PROBE_EVERY steps)."""
    policy = Policy(16)
    _one_row_costs(policy)
    free = _looking(found=0.5, accepted=10, checked=40)
    assert policy.gain_of_looking(1, [free]) < 1.0
    looks = []
    for _ in range(2 * PROBE_EVERY):
        looks.append(policy.worth_looking(1, [free]))
        if looks[-1]:
            free.idle = 0  # as the batch does when it looks
    assert looks.count(True) == 2 and looks[PROBE_EVERY - 1]


def test_a_copying_row_looks_every_step() -> None:
    policy = Policy(16)
    _one_row_costs(policy)
    copy = _looking(found=1.0, accepted=60, checked=62)
    assert policy.gain_of_looking(1, [copy]) > 2
    assert all(policy.worth_looking(1, [copy]) for _ in range(2 * PROBE_EVERY))


def test_looks_are_counted_and_forgotten() -> None:
    stats = RowStats()
    assert stats.found_rate == pytest.approx(0.5)  # even odds before any look
    for _ in range(20):
        stats.looked(found=False)
    assert stats.found_rate < 0.2
    for _ in range(20):
        stats.looked(found=True)
    assert stats.found_rate > 0.8


def test_after_a_look_the_plain_step_compared_is_the_looked_one() -> None:
    """Once the pending token has been fetched, the sync is paid: a proposal is weighed
    against a plain step after a look (width 0), which costs more than one without."""
    row = [(_stats(0, 3), 1)]  # right a fifth of the time (the prior counted)
    for looked, width in ((0.019, 0), (0.023, 1)):
        policy = Policy(1)  # proposals of one token
        _costs(policy, 1, 1, 0.019)
        _costs(policy, 1, 2, 0.024)
        _costs(policy, 1, 0, looked)
        # 1.2 tokens for 24 ms: not against 1 for 19 ms, but against 1 for 23
        assert policy.choose(1, row).width == width

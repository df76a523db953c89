"""The llama.cpp-ordered sampling chain: each stage on hand-made logits, DRY against a literal
port of llama.cpp's algorithm, seeded determinism inside a batch, the shared-sampler cache."""

from __future__ import annotations

import math
import random

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import greedy_sampler

from mlxcel.actors.model_runner import sampler_chain as sc
from mlxcel.actors.model_runner.dry import Breakers, breakers_from_strings, make_dry

NEG_INF = float("-inf")
PROBS = [0.5, 0.25, 0.15, 0.1]


def logp(probs: list[float]) -> mx.array:
    return mx.log(mx.array([probs]))


def kept(x: mx.array) -> list[int]:
    return [i for i, v in enumerate(x[0].tolist()) if v != NEG_INF]


def no_encode(text: str) -> list[int]:
    raise AssertionError(f"unexpected encode({text!r})")


def run(processors: list[sc.Processor], context: list[int], logits: list[float]) -> list[float]:
    tokens = mx.array(context, dtype=mx.int32)
    x = mx.array([logits])
    for processor in processors:
        x = processor(tokens, x)
    return [round(v, 5) for v in x[0].tolist()]


# -- filters ------------------------------------------------------------------------------------


def test_top_k_keeps_the_k_most_likely() -> None:
    assert kept(sc.top_k(logp(PROBS), 2)) == [0, 1]
    assert kept(sc.top_k(logp(PROBS), 0)) == [0, 1, 2, 3]
    assert kept(sc.top_k(logp(PROBS), 9)) == [0, 1, 2, 3]


def test_min_p_keeps_tokens_at_least_p_times_the_top() -> None:
    assert kept(sc.min_p(logp(PROBS), 0.3)) == [0, 1, 2]  # 0.15 >= 0.3 * 0.5
    assert kept(sc.min_p(logp(PROBS), 0.31)) == [0, 1]


def test_top_p_includes_the_token_that_crosses_p() -> None:
    assert kept(sc.top_p(logp(PROBS), 0.5)) == [0]
    assert kept(sc.top_p(logp(PROBS), 0.6)) == [0, 1]
    assert kept(sc.top_p(logp(PROBS), 0.0)) == [0]


def test_typical_keeps_tokens_nearest_the_entropy() -> None:
    # Entropy 1.208 nats; surprises 0.69, 1.39, 1.90, 2.30: token 1 is the most typical,
    # then token 0 (cumulative 0.75 > 0.5 stops there).
    assert kept(sc.typical(logp(PROBS), 0.5)) == [0, 1]
    assert kept(sc.typical(logp(PROBS), 0.2)) == [1]
    masked = mx.array([[math.log(0.5), math.log(0.5), NEG_INF]])
    assert kept(sc.typical(masked, 0.99)) == [0, 1]


def test_top_n_sigma_keeps_logits_within_n_std_of_the_max() -> None:
    x = mx.array([[4.0, 3.0, 1.0, 0.0]])  # mean 2, std sqrt(2.5) = 1.58
    assert kept(sc.top_n_sigma(x, 1.0)) == [0, 1]
    assert kept(sc.top_n_sigma(x, 2.0)) == [0, 1, 2]
    assert kept(sc.top_n_sigma(mx.array([[4.0, 3.0, NEG_INF, 0.0]]), 1.0)) == [0, 1]


def test_xtc_removes_all_top_choices_but_the_least_likely() -> None:
    fire, skip = mx.array([[0.0]]), mx.array([[0.9]])
    assert kept(sc.xtc(logp(PROBS), 0.5, 0.15, fire)) == [2, 3]
    assert kept(sc.xtc(logp(PROBS), 0.5, 0.15, skip)) == [0, 1, 2, 3]
    assert kept(sc.xtc(logp(PROBS), 1.0, 0.3, fire)) == [0, 1, 2, 3]  # only one above


def test_seeded_xtc_never_draws_an_excluded_token() -> None:
    config = sc.SamplerConfig(xtc_probability=1.0, xtc_threshold=0.2, seed=7)
    _, sampler = sc.build(config, vocab_size=4, encode=no_encode)
    draws = {sampler(logp(PROBS)).item() for _ in range(200)}
    assert 0 not in draws and 1 in draws


def test_filters_renormalise_in_chain_order_and_ignore_temperature() -> None:
    # top-k leaves {0.5, 0.25} -> {0.67, 0.33}; top-p 0.6 then keeps token 0 alone. A high
    # temperature must not widen the set: filters run on untempered log-probabilities.
    config = sc.SamplerConfig(temperature=5.0, top_k=2, top_p=0.6, seed=1)
    _, sampler = sc.build(config, vocab_size=4, encode=no_encode)
    assert {sampler(logp(PROBS)).item() for _ in range(50)} == {0}


def test_greedy_is_argmax_over_what_typical_kept() -> None:
    _, sampler = sc.build(
        sc.SamplerConfig(temperature=0.0, typical_p=0.2), vocab_size=4, encode=no_encode
    )
    assert sampler(logp(PROBS)).item() == 1


# -- processors ---------------------------------------------------------------------------------


def test_logit_bias_bans_and_boosts() -> None:
    config = sc.SamplerConfig(temperature=0.0, logit_bias=((0, NEG_INF), (3, 1.0)))
    processors, sampler = sc.build(config, vocab_size=4, encode=no_encode)
    out = run(processors, [1], [2.0, 1.0, 0.5, 0.0])
    assert out == [NEG_INF, 1.0, 0.5, 1.0]
    x = mx.array([out])
    assert sampler(x - mx.logsumexp(x, axis=-1, keepdims=True)).item() == 1


def test_penalties_follow_llama_cpp() -> None:
    config = sc.SamplerConfig(
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_context_size=4,
    )
    processors, _ = sc.build(config, vocab_size=5, encode=no_encode)
    # Window [2, 1, 1, 3]: token 0 is outside it. Positive logits divide, others multiply.
    out = run(processors, [0, 2, 1, 1, 3], [1.0, 2.0, -1.0, 0.0, 3.0])
    assert out == [1.0, 2.0 / 2 - 0.5 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.0 - 0.25 - 0.5, 3.0]
    whole = sc.build(
        attrs_evolve(config, repetition_context_size=-1), vocab_size=5, encode=no_encode
    )[0]
    assert run(whole, [0, 2, 1, 1, 3], [1.0, 2.0, -1.0, 0.0, 3.0])[0] == 1.0 / 2 - 0.25 - 0.5
    off = sc.build(attrs_evolve(config, repetition_context_size=0), vocab_size=5, encode=no_encode)[
        0
    ]
    assert off == []


def attrs_evolve(config: sc.SamplerConfig, **changes: object) -> sc.SamplerConfig:
    import attrs

    return attrs.evolve(config, **changes)


def dry_config(**changes: object) -> sc.SamplerConfig:
    base = sc.SamplerConfig(
        dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2, dry_sequence_breakers=()
    )
    return attrs_evolve(base, **changes)


def test_dry_penalises_exactly_the_repeating_continuation() -> None:
    processors, _ = sc.build(dry_config(), vocab_size=8, encode=no_encode)
    # "1 2 3" repeats as "1 2 3 ... 1 2 3": the match has length 3 and was followed by 4,
    # so 4 gets 1 * 2^(3-2); "2 3" also preceded 5 (length 2: 2^0).
    out = run(processors, [1, 2, 3, 4, 7, 2, 3, 5, 1, 2, 3], [0.0] * 8)
    assert out == [0.0, 0.0, 0.0, 0.0, -2.0, -1.0, 0.0, 0.0]
    # Matches shorter than the allowed length are free.
    assert run(processors, [1, 2, 5, 6, 2], [0.0] * 8) == [0.0] * 8


def test_dry_sequence_breakers_stop_matches() -> None:
    codes = {"\n": [6], "ab": [0, 7]}

    def encode(text: str) -> list[int]:
        return codes[text]

    context = [1, 2, 3, 4, 1, 2, 6, 3]  # after the breaker 6 only "3" can match
    plain, _ = sc.build(dry_config(dry_allowed_length=1), vocab_size=8, encode=encode)
    broken, _ = sc.build(
        dry_config(dry_allowed_length=1, dry_sequence_breakers=("\n",)), vocab_size=8, encode=encode
    )
    assert run(plain, context, [0.0] * 8)[4] == -1.0
    assert run(broken, context, [0.0] * 8) == [0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0]
    # A breaker is never penalised itself, even when it would continue a repeat.
    assert run(broken, [1, 6, 5, 1], [0.0] * 8)[6] == 0.0
    assert run(plain, [1, 6, 5, 1], [0.0] * 8)[6] == -1.0
    # A two-token breaker "0 7" caps the match "7 3" at the one token after it.
    multi, _ = sc.build(dry_config(dry_sequence_breakers=("ab",)), vocab_size=8, encode=encode)
    assert run(multi, [7, 3, 5, 2, 0, 7, 3], [0.0] * 8)[5] == 0.0
    assert run(multi, [7, 3, 5, 2, 1, 7, 3], [0.0] * 8)[5] == -1.0


def test_breakers_follow_llama_cpp_token_overlap() -> None:
    texts = ["a", "\n", ".\n", "b", "x#", "#", "##"]
    found = breakers_from_strings(
        ["\n", "##"], encode=lambda s: {"#": [5], "\n": [1]}[s], token_texts=texts
    )
    assert found.single == {1, 2, 6}
    assert found.multi == {(4, (5,)), (5, (5,))}


def dry_reference(
    context: list[int], mult: float, base: float, allowed: int, last_n: int, breakers: Breakers
) -> dict[int, float]:
    """A literal port of llama.cpp's llama_sampler_dry_apply (reversed Z-algorithm)."""
    n = len(context) if last_n < 0 else min(len(context), last_n)
    if n <= allowed:
        return {}
    rat = lambda i: context[len(context) - 1 - i]  # noqa: E731 - a lambda, as in llama.cpp
    heads: dict[int, list[tuple[int, ...]]] = {t: [()] for t in breakers.single}
    for head, tail in breakers.multi:
        heads.setdefault(head, []).append(tail)
    rep_limit = n
    for i in range(n):
        longest = -1
        for tail in heads.get(rat(i), []):
            if longest < len(tail) <= i and all(
                tail[o] == rat(i - o - 1) for o in range(len(tail))
            ):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return {}
    count = [0] * n
    last, lt, rt = n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            count[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p = k - lt
            right = rt - k + 1
            if count[last - p] < right:
                count[last - k] = min(count[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    best: dict[int, int] = {}
    for i in range(n - 1):
        if count[i] >= allowed:
            token = rat(n - 2 - i)
            best[token] = max(best.get(token, 0), count[i])
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    out = {}
    for token, length in best.items():
        if token in breakers.single:
            continue
        exp = length - allowed
        if max_exp > 0:
            exp = min(exp, max_exp)
        out[token] = mult * base**exp
    return out


def test_dry_matches_llama_cpp_on_random_contexts() -> None:
    rng = random.Random(0)
    vocab = 6
    for trial in range(60):
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        breakers = Breakers(
            single=frozenset(rng.sample(range(vocab), rng.randrange(0, 2))),
            multi=frozenset(
                {(rng.randrange(vocab), (rng.randrange(vocab),))} if trial % 3 == 0 else set()
            ),
        )
        allowed, last_n = rng.randrange(0, 4), rng.choice([-1, 8, 16, 64])
        base = rng.choice([1.0, 1.75, 3.0])
        dry = make_dry(
            multiplier=0.5,
            base=base,
            allowed_length=allowed,
            penalty_last_n=last_n,
            breakers=breakers,
            vocab_size=vocab,
        )
        assert dry is not None
        got = dry(mx.array(context, dtype=mx.int32), mx.zeros((1, vocab)))[0].tolist()
        want = dry_reference(context, 0.5, base, allowed, last_n, breakers)
        expected = [-want.get(t, 0.0) for t in range(vocab)]
        assert got == pytest.approx(expected, rel=1e-5), (context, breakers, allowed, last_n, base)


# -- seeds and sharing --------------------------------------------------------------------------


def test_same_seed_same_draws_alone_or_in_a_batch() -> None:
    config = sc.SamplerConfig(
        temperature=1.0, top_k=50, xtc_probability=0.5, xtc_threshold=0.01, seed=42
    )
    rows = mx.random.normal((3, 20, 64), key=mx.random.key(0))
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)

    _, alone = sc.build(config, vocab_size=64, encode=no_encode)
    solo = [alone(logprobs[1, step][None]).item() for step in range(20)]

    # In a batch, mlx-lm calls each distinct sampler on its own row; the neighbours use the
    # global generator and another seed, interleaved with this row's draws.
    samplers = [
        sc.build(attrs_evolve(config, seed=None), vocab_size=64, encode=no_encode)[1],
        sc.build(config, vocab_size=64, encode=no_encode)[1],
        sc.build(attrs_evolve(config, seed=43), vocab_size=64, encode=no_encode)[1],
    ]
    batched = []
    for step in range(20):
        drawn = mx.concatenate([s(logprobs[e, step][None]) for e, s in enumerate(samplers)])
        batched.append(drawn[1].item())
    assert batched == solo
    other = sc.build(attrs_evolve(config, seed=43), vocab_size=64, encode=no_encode)[1]
    assert [other(logprobs[1, step][None]).item() for step in range(20)] != solo


def test_unseeded_configs_share_one_sampler_object() -> None:
    a = sc.SamplerConfig(temperature=0.7, top_k=40, min_p=0.05)
    _, first = sc.build(a, vocab_size=10, encode=no_encode)
    processors, second = sc.build(
        attrs_evolve(a, repetition_penalty=1.1), vocab_size=10, encode=no_encode
    )
    assert processors and second is first  # penalties are per row; the draw stays batched
    assert sc.build(attrs_evolve(a, top_k=41), vocab_size=10, encode=no_encode)[1] is not first
    assert (
        sc.build(sc.SamplerConfig(temperature=0.0, top_k=3), vocab_size=10, encode=no_encode)[1]
        is greedy_sampler
    )
    seeded = [
        sc.build(attrs_evolve(a, seed=1), vocab_size=10, encode=no_encode)[1] for _ in range(2)
    ]
    assert seeded[0] is not seeded[1] and seeded[0] is not first
    # The shared sampler draws a whole batch in one call.
    assert sc.build(a, vocab_size=10, encode=no_encode)[1](mx.zeros((5, 10))).shape == (5,)


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 1.01),
        ("typical_p", 0.0),
        ("typical_p", 1.1),
        ("top_n_sigma", -1.0),
        ("xtc_probability", 1.2),
        ("xtc_threshold", 0.6),
        ("repetition_penalty", 0.0),
        ("repetition_context_size", -2),
        ("presence_penalty", math.inf),
        ("frequency_penalty", math.nan),
        ("dry_multiplier", -1.0),
        ("dry_base", -0.5),
        ("dry_allowed_length", -1),
        ("dry_penalty_last_n", -2),
        ("seed", -1),
        ("logit_bias", ((10, 1.0),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logit_bias", ((1, math.nan),)),
        ("logit_bias", ((1, math.inf),)),
    ],
)
def test_validate_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        sc.validate(attrs_evolve(sc.SamplerConfig(), **{field: value}), vocab_size=10)


def test_validate_accepts_edges() -> None:
    sc.validate(sc.SamplerConfig(), vocab_size=10)
    sc.validate(
        sc.SamplerConfig(
            temperature=0.0,
            top_p=0.0,
            min_p=1.0,
            typical_p=1.0,
            xtc_probability=1.0,
            xtc_threshold=0.5,
            repetition_context_size=-1,
            dry_penalty_last_n=-1,
            logit_bias=((9, NEG_INF),),
            seed=0,
        ),
        vocab_size=10,
    )


def test_seeded_top_k_draw_ignores_last_bit_differences_in_the_logits() -> None:
    # A row's logits differ in their last bits with the batch around it (matmul blocking);
    # the seeded draw over the top-k candidates must not follow their argpartition order.
    rng = random.Random(0)
    # Rounded, so that many tail logits tie and the nudge decides how the partition goes.
    logits = [round(rng.gauss(0.0, 2.0), 2) for _ in range(4096)]
    row = mx.array([logits])
    x = row - mx.logsumexp(row, axis=-1, keepdims=True)
    nudged = x + mx.array([[rng.uniform(-1e-6, 1e-6) for _ in logits]])
    same = 0
    for seed in range(40):
        config = sc.SamplerConfig(temperature=1.0, top_k=40, seed=seed)
        _, a = sc.build(config, vocab_size=4096, encode=no_encode)
        _, b = sc.build(config, vocab_size=4096, encode=no_encode)
        same += a(x).item() == b(nudged).item()
    assert same == 40

"""Per-step cost of the llama.cpp-ordered sampling chain against plain sampling, on a [16, V]
batch of random logits (not a test; no model, so this is the sampling overhead alone).

    .venv/bin/python tools/bench/sampling.py [--batch 16] [--vocab 49152] [--context 512]

Each case replays what mlx-lm's GenerationBatch._step does after the forward pass: the per-row
logits processors on (context, logits[1, V]), the log-softmax, then one sampler call for the
batch when every row shares a sampler object, else one call per row; then mx.eval. Cases:

  plain      temperature only, one shared sampler (mlx-lm's categorical draw)
  filters    top-n-sigma, top-k, typical, top-p, min-p, XTC, shared sampler
  penalties  filters + logit bias, repetition/presence/frequency, DRY (window 64) per row
  seeded     penalties with a distinct seed per row (one sampler call per row)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlxcel.models  # noqa: F401  isort: skip  (OpenBLAS before mlx)

import mlx.core as mx

from mlxcel.actors.model_runner.sampler_chain import SamplerConfig, build

Processor = Callable[[mx.array, mx.array], mx.array]
Sampler = Callable[[mx.array], mx.array]

FILTERS = SamplerConfig(
    temperature=0.8,
    top_k=40,
    top_p=0.95,
    min_p=0.05,
    typical_p=0.95,
    top_n_sigma=2.0,
    xtc_probability=0.5,
    xtc_threshold=0.1,
)
PENALTIES = SamplerConfig(
    temperature=0.8,
    top_k=40,
    top_p=0.95,
    min_p=0.05,
    typical_p=0.95,
    top_n_sigma=2.0,
    xtc_probability=0.5,
    xtc_threshold=0.1,
    logit_bias=((11, -100.0), (12, 5.0)),
    repetition_penalty=1.1,
    repetition_context_size=64,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    dry_multiplier=0.8,
    dry_penalty_last_n=64,
)


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # stand-in tokenizer: one token per character


def step(
    logits: mx.array,
    contexts: list[mx.array],
    processors: list[list[Processor]],
    samplers: list[Sampler],
) -> mx.array:
    if any(processors):
        rows = []
        for e, procs in enumerate(processors):
            row = logits[e : e + 1]
            for p in procs:
                row = p(contexts[e], row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if all(s is samplers[0] for s in samplers):
        sampled = samplers[0](logprobs)
    else:
        sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)])
    mx.eval(sampled, logprobs)
    return sampled


def measure(
    name: str,
    configs: list[SamplerConfig],
    vocab: int,
    context: int,
    steps: int,
) -> float:
    built = [build(c, vocab_size=vocab, encode=encode) for c in configs]
    processors = [b[0] for b in built]
    samplers = [b[1] for b in built]
    key = mx.random.key(0)
    # Repetitive contexts so DRY and the penalties have work to do.
    contexts = [
        mx.random.randint(0, 64, (context,), key=mx.random.key(e)).astype(mx.int32)
        for e in range(len(configs))
    ]
    logits = mx.random.normal((len(configs), vocab), key=key) * 3.0
    mx.eval(logits, *contexts)
    for _ in range(5):
        step(logits, contexts, processors, samplers)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(logits, contexts, processors, samplers)
        times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1000
    print(f"{name:10s} {ms:8.3f} ms/step")
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    b, v, c, n = args.batch, args.vocab, args.context, args.steps
    print(f"batch {b}, vocab {v}, context {c}, device {mx.default_device()}")
    plain = measure("plain", [SamplerConfig(temperature=0.8)] * b, v, c, n)
    for name, configs in [
        ("filters", [FILTERS] * b),
        ("penalties", [PENALTIES] * b),
        ("seeded", [SamplerConfig(**{**_fields(PENALTIES), "seed": e}) for e in range(b)]),
    ]:
        ms = measure(name, configs, v, c, n)
        print(f"{'':10s} {ms / plain:8.2f}x plain, +{(ms - plain) / b:.3f} ms per row")


def _fields(config: SamplerConfig) -> dict[str, object]:
    import attrs

    return attrs.asdict(config, recurse=False)


if __name__ == "__main__":
    main()

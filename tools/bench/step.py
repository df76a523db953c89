"""Where a decode step's time goes, driving the model runner's backend directly (no HTTP, no
Trio): issue 22's first measurements.

    .venv/bin/python tools/bench/step.py steps [--rows 1 16 32 64] [--model DIR] [--dtype D]
    .venv/bin/python tools/bench/step.py admit [--rows 16] [--prompt 2000] [--chunk 512]
        [--after 20] [--share 0.2]
    .venv/bin/python tools/bench/step.py churn [--rows 64] [--steps 30]

``steps``: for each row count, rows decoding greedily (the embedded SmolLM2, float32): ms per
step, tokens/s, and the FLOP rate that step reaches (2 x parameters x rows per step), with the
forward pass alone (graph building and evaluation) beside it, so what the backend adds on top
(sampling, bookkeeping) shows.

``admit``: rows decoding, then one long prompt arrives: each step's time while the prompt is
read (until its first token) and after it joins the batch, the running rows' tokens/s in both
spells against before, and the long prompt's time to its first token (issue 22, item 3:
running streams should lose at most 20% while it is admitted; ``--share`` is
``--prefill-share``).

``churn``: the closed-loop load of many streams: rows decoding, and every step one row ends
and a new ~57-token prompt joins. ms per step with row reuse (a joining row takes a finished
one's place in the batch) and without it (``MLXCEL_ROW_REUSE=0``: every join and leave copies
the batch's KV cache, as mlx-lm does), against the same rows with no churn, in one run.
"""

from __future__ import annotations

import argparse
import time

import mlxcel.models  # noqa: F401  isort: skip  (OpenBLAS before mlx)

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxcel.actors.model_runner.mlx_backend import MlxBackend
from mlxcel.models.loader import LoadedModel, load_model
from mlxcel.models.resolve import resolve_model
from mlxcel.runtime.messages import InsertSequence, SamplingParams, StepPlan
from mlxcel.runtime.settings import Settings

GREEDY = SamplingParams(temperature=0.0)


def decoding(loaded: LoadedModel, rows: int, settings: Settings) -> MlxBackend:
    """A backend with ``rows`` rows past their prompts, decoding without end."""
    backend = MlxBackend(loaded, settings)
    tok = loaded.tokenizer
    inserts = tuple(
        InsertSequence(
            f"r{i}",
            tuple(tok.encode(f"Tell me a long story number {i} about")),
            100_000,
            GREEDY,
            ignore_eos=True,
        )
        for i in range(rows)
    )
    backend.apply(StepPlan(inserts=inserts))
    for _ in range(8):
        backend.apply(StepPlan())
    return backend


def forward_ms(loaded: LoadedModel, rows: int, n: int = 20) -> float:
    """The model's decode pass alone over ``rows`` rows (20 cached tokens each)."""
    model = loaded.model
    cache = [BatchKVCache([0] * rows) for _ in model.layers]
    mx.eval(model(mx.array([[5] * 20] * rows), cache=cache))
    token = mx.array([[7]] * rows)
    for _ in range(3):
        mx.eval(model(token, cache=cache))
    tic = time.perf_counter()
    for _ in range(n):
        mx.eval(model(token, cache=cache))
    return (time.perf_counter() - tic) / n * 1000


def steps(loaded: LoadedModel, counts: list[int]) -> None:
    params = loaded.n_params  # multiply-adds per row and token (quantised weights unpacked)
    size = f"2 x {params / 1e6:.0f}M x rows"
    print(f"| rows | ms/step | tok/s | GFLOP/s ({size}) | forward alone ms |")
    print("|---:|---:|---:|---:|---:|")
    for rows in counts:
        backend = decoding(loaded, rows, Settings(parallel=rows, cache_ram_mib=0))
        n = 20
        tic = time.perf_counter()
        for _ in range(n):
            backend.apply(StepPlan())
        dt = (time.perf_counter() - tic) / n
        flops = 2 * params * rows / dt / 1e9
        fwd = forward_ms(loaded, rows)
        print(f"| {rows} | {dt * 1000:.1f} | {rows / dt:.1f} | {flops:.1f} | {fwd:.1f} |")


def admit(
    loaded: LoadedModel, rows: int, prompt: int, chunk: int, after: int, share: float
) -> None:
    """Rows decoding, a long prompt arriving; then the same rows for as many steps with no
    arrival (the control: their contexts grow the same way), so the ratio is the arrival's."""
    settings = Settings(
        parallel=rows + 1,
        cache_ram_mib=0,
        ctx_size=prompt + 1024,
        prefill_chunk_size=chunk,
        prefill_share=share,
    )
    text = "The history of the world is long. " * (prompt // 6 + 1)
    ids = tuple(loaded.tokenizer.encode(text)[:prompt])
    long = InsertSequence("long", ids, after + 8, GREEDY)

    def step(backend: MlxBackend, plan: StepPlan) -> tuple[float, int, bool]:
        tic = time.perf_counter()
        out = backend.apply(plan)
        took = time.perf_counter() - tic
        running = sum(1 for t in out.tokens if t.request_id.startswith("r"))
        return took, running, any(t.request_id == "long" for t in out.tokens)

    def rate(spell: list[tuple[float, int, bool]]) -> float:
        return sum(n for _, n, _ in spell) / sum(t for t, _, _ in spell)

    backend = decoding(loaded, rows, settings)
    during = [step(backend, StepPlan(inserts=(long,)))]
    while not during[-1][2]:
        during.append(step(backend, StepPlan()))
    joined = [step(backend, StepPlan()) for _ in range(after)]
    del backend
    control = decoding(loaded, rows, settings)
    alone = [step(control, StepPlan()) for _ in range(len(during))]
    alone_after = [step(control, StepPlan()) for _ in range(after)]
    ttft = sum(t for t, _, _ in during)
    print(
        f"{rows} rows decoding, a {prompt}-token prompt arrives (chunk {chunk}, "
        f"--prefill-share {share}): its first token after {ttft:.2f} s ({len(during)} "
        f"steps). Running rows meanwhile {rate(during):.1f} tok/s against {rate(alone):.1f} "
        f"with no arrival ({rate(during) / rate(alone):.2f}x); over the {after} steps after "
        f"it joined {rate(joined):.1f} against {rate(alone_after):.1f} "
        f"({rate(joined) / rate(alone_after):.2f}x)"
    )
    print("step ms while admitted:", [round(t * 1000) for t, _, _ in during])
    print("step ms after:", [round(t * 1000) for t, _, _ in joined])


def churn(loaded: LoadedModel, rows: int, n: int) -> None:
    from mlxcel.actors.model_runner import row_reuse

    tok = loaded.tokenizer
    question = "Write a detailed answer about the history of the city, its people and its food"
    settings = Settings(parallel=rows + 1, cache_ram_mib=0)
    warm = 56

    def run(reuse: bool, joins: bool) -> float:
        row_reuse.enabled = reuse
        backend = decoding(loaded, rows, settings)
        for _ in range(warm):  # the rows' answers under way, longer than a new prompt
            backend.apply(StepPlan())
        took = []
        for k in range(n):
            plan = StepPlan()
            if joins:
                ids = tuple(tok.encode(f"{question} number {k}. " * 3))
                new = InsertSequence(f"j{k}", ids, 100_000, GREEDY, ignore_eos=True)
                plan = StepPlan(removes=(f"r{k}",), inserts=(new,))
            tic = time.perf_counter()
            backend.apply(plan)
            took.append(time.perf_counter() - tic)
        took.sort()
        return took[len(took) // 2] * 1000

    steady = run(True, False)
    copying = run(False, True)
    reusing = run(True, True)
    row_reuse.enabled = True
    print(f"{rows} rows, every step one leaves and a ~57-token prompt joins; median ms/step:")
    print("| no churn | churn, copies (mlx-lm) | churn, row reuse | copies / reuse |")
    print("|---:|---:|---:|---:|")
    print(f"| {steady:.1f} | {copying:.1f} | {reusing:.1f} | {copying / reusing:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("steps")
    s.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64])
    a = sub.add_parser("admit")
    a.add_argument("--rows", type=int, default=16)
    a.add_argument("--prompt", type=int, default=2000)
    a.add_argument("--chunk", type=int, default=512)
    a.add_argument("--after", type=int, default=20, help="steps measured after it joins")
    a.add_argument("--share", type=float, default=Settings().prefill_share)
    c = sub.add_parser("churn")
    c.add_argument("--rows", type=int, default=64)
    c.add_argument("--steps", type=int, default=30)
    for p in (s, a, c):
        p.add_argument("--model", help="model folder or GGUF (default: the embedded SmolLM2)")
        p.add_argument(
            "--dtype",
            choices=["float32", "bfloat16", "float16"],
            help="convert every weight to this (default: as the server loads it)",
        )
    args = ap.parse_args()
    loaded = load_model(resolve_model(args.model), dtype=args.dtype)
    if args.what == "steps":
        steps(loaded, args.rows)
    elif args.what == "churn":
        churn(loaded, args.rows, args.steps)
    else:
        admit(loaded, args.rows, args.prompt, args.chunk, args.after, args.share)


if __name__ == "__main__":
    main()

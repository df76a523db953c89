"""Does a seeded answer depend on where its prompt's KV came from? (issue 40, item 4)

Drives the model runner's backend directly (``MlxBackend.apply``, the embedded default model,
the server's default flags with ``--parallel 16``) and compares one seeded request's tokens
and log-probabilities (temperature 1, 24 tokens) read fresh and alone against the same request
with its prompt from other places: a prefix cached by a grammar-less request sharing the
system prompt, three at once or one step apart after it, a follow-up turn from its cached
first turn, a short prompt read beside a longer one, a long prompt partly cached or read in the
prefill budget's chunks, beside a speculating row, beside 12 decoding rows. Prints, per case,
how many tokens match before the first difference and the largest log-probability difference
before it.

Usage: python tools/bench/seed_sources.py [serve flags...]
(``MLXCEL_NATIVE=0`` for mlx's own kernels, ``MLXCEL_NATIVE_INT8=...`` for another int8 mode.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import mlxcel.models  # noqa: F401  isort: skip  (OpenBLAS before mlx)

from mlxcel.actors.model_runner.mlx_backend import MlxBackend
from mlxcel.cli import add_serve_flags, settings_from
from mlxcel.models.loader import load_model
from mlxcel.models.resolve import resolve_model
from mlxcel.paths import default_cache_dir
from mlxcel.runtime.messages import InsertSequence, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.drive import drive_schedule  # noqa: E402 - after sys.path

SEEDED = SamplingParams(temperature=1.0, seed=1239)
OTHER = SamplingParams(temperature=1.0)
Schedule = list[tuple[int, InsertSequence]]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    settings = settings_from(parser.parse_args(["--parallel", "16", *argv]))
    loaded = load_model(resolve_model(None, default_cache_dir()))
    tok = loaded.tokenizer

    def chat(*turns: str) -> tuple[int, ...]:
        roles = ("user", "assistant")
        messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return tuple(out["input_ids"] if hasattr(out, "keys") else out)

    def seq(
        rid: str, prompt: tuple[int, ...], sampling: SamplingParams = SEEDED, n: int = 24
    ) -> InsertSequence:
        return InsertSequence(rid, prompt, n, sampling, logprobs=0, cache_key="")

    def run(schedule: Schedule, backend: MlxBackend | None = None) -> dict[str, list[Any]]:
        """Insert each sequence at its step: every row's (token, log-probability)."""
        return drive_schedule(backend or MlxBackend(loaded, settings), schedule)

    def after(first: Schedule, then: Schedule) -> dict[str, list[Any]]:
        backend = MlxBackend(loaded, settings)
        run(first, backend)
        return run(then, backend)

    def report(name: str, ref: list[Any], got: list[Any]) -> None:
        same = [a[0] == b[0] for a, b in zip(ref, got, strict=False)]
        first = same.index(False) if False in same else len(same)
        pairs = zip(ref[:first], got[:first], strict=True)
        diff = max((abs(a[1] - b[1]) for a, b in pairs), default=0.0)
        print(f"| {name} | {first} of {len(same)} | {diff:.1e} |")

    dragon = chat("Tell me about a dragon.")
    person = chat("Give me a person as JSON.")
    print("| case | tokens equal to the fresh read | max abs log-prob difference |")
    print("|---|---:|---:|")
    ref = run([(0, seq("a", dragon))])["a"]
    g = [(0, seq("g", person))]
    got = after(g, [(0, seq("a", dragon))])
    report("prefix from the cache (another question's)", ref, got["a"])
    for label, steps in (("at once", (0, 0, 0)), ("a step apart", (0, 1, 2))):
        got = after(g, [(at, seq(k, dragon)) for k, at in zip("abc", steps, strict=True)])
        for k in "abc":
            report(f"three {label} after it: {k}", ref, got[k])
    answer = tok.decode([t for t, _ in ref])
    follow = chat("Tell me about a dragon.", answer, "And a second one?")
    ref2 = run([(0, seq("x", follow))])["x"]
    got = after([(0, seq("a", dragon))], [(0, seq("x", follow))])
    report("follow-up turn, first turn cached", ref2, got["x"])
    short = dragon[-8:]
    longer = chat("Hello there, how are you doing today my friend?")
    got = run([(0, seq("s", short)), (0, seq("o", longer, OTHER))])
    report("8-token prompt beside a longer one", run([(0, seq("s", short))])["s"], got["s"])
    text = " ".join(f"Item {i} is the number {i * 7}." for i in range(150))
    long = chat(text + " Which item is 700?")
    ref3 = run([(0, seq("l", long))])["l"]
    got = after([(0, seq("g", long[:900] + (5, 6, 7)))], [(0, seq("l", long))])
    report(f"{len(long)}-token prompt, 900 tokens cached", ref3, got["l"])
    counting = [(0, seq(f"o{i}", chat(f"Count to {i}."), OTHER, 40)) for i in range(4)]
    report(
        f"{len(long)}-token prompt read while 4 rows decode",
        ref3,
        run([*counting, (3, seq("l", long))])["l"],
    )
    repeat = chat("Repeat after me: " + " ".join(["one two three"] * 5))
    greedy = SamplingParams(temperature=0.0)
    got = run([(0, seq("a", dragon)), (0, seq("r", repeat, greedy, 40))])
    report("beside a greedy row that speculates", ref, got["a"])
    twelve = [(0, seq(f"o{i}", chat(f"Count to {i}."), OTHER, 40)) for i in range(12)]
    report("beside 12 decoding rows", ref, run([*twelve, (2, seq("a", dragon))])["a"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

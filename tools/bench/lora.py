#!/usr/bin/env python
"""Decode speed of a batch whose rows use different LoRA adapters vs the same batch without.

In-process, on the model runner's backend (no HTTP): the default model (SmolLM2-135M-Instruct,
float32 on the CPU) or ``--model``, with ``--adapters`` adapters in mlx-lm's format (rank
``--rank`` on q_proj and v_proj of every layer, mlx_lm.lora's default targets; deterministic
random weights, written to a temporary folder). ``--rows`` streams decode ``--tokens`` tokens
each (greedy, ignore_eos, speculation off); the tokens after every row's first one are timed.
Three batches, alternating over ``--rounds``:

  base   a backend built without --lora
  zero   the --lora backend, every row at scale 0 (the LoRA term is skipped)
  mixed  the --lora backend, row i on adapter i mod n (every row adapted, n adapters mixed)

Prints tok/s of each (median over rounds) and the ratios mixed/base and zero/base.

    .venv/bin/python tools/bench/lora.py [--rows 8] [--tokens 64] [--adapters 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mlxcel.actors.model_runner.backend import Backend  # noqa: E402 - after sys.path
from mlxcel.models.mlx_setup import mx  # noqa: E402 - after sys.path
from mlxcel.runtime.messages import InsertSequence, SamplingParams, StepPlan  # noqa: E402 - after sys.path
from mlxcel.runtime.settings import Settings  # noqa: E402 - after sys.path
from mlxcel.server import build_mlx_backend  # noqa: E402 - after sys.path


def write_adapter(path: Path, model_config: dict[str, Any], rank: int, seed: int) -> None:
    hidden = int(model_config["hidden_size"])
    heads = int(model_config["num_attention_heads"])
    kv = int(model_config.get("num_key_value_heads", heads))
    head_dim = int(model_config.get("head_dim", hidden // heads))
    layers = int(model_config["num_hidden_layers"])
    rng = np.random.default_rng(seed)
    weights = {}
    for i in range(layers):
        for name, out in (("q_proj", heads * head_dim), ("v_proj", kv * head_dim)):
            p = f"model.layers.{i}.self_attn.{name}"
            a = rng.standard_normal((hidden, rank)) / np.sqrt(hidden)
            weights[f"{p}.lora_a"] = mx.array(a.astype(np.float32))
            weights[f"{p}.lora_b"] = mx.array(
                (rng.standard_normal((rank, out)) * 0.01).astype(np.float32)
            )
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": layers}
    config["lora_parameters"] = {"rank": rank, "scale": 20.0, "dropout": 0.0}
    (path / "adapter_config.json").write_text(json.dumps(config))


def decode_rate(backend: Backend, scales: list[tuple[float, ...]], tokens: int) -> float:
    """Tokens/s over the steps after every row has its first token."""
    prompt = tuple(range(1000, 1032))
    inserts = tuple(
        InsertSequence(f"r{i}", prompt, tokens, SamplingParams(temperature=0.0), True, lora=s)
        for i, s in enumerate(scales)
    )
    plan = StepPlan(inserts=inserts)
    started: set[str] = set()
    done: set[str] = set()
    timed, tic = 0, 0.0
    while len(done) < len(scales):
        out = backend.apply(plan)
        plan = StepPlan()
        for t in out.tokens:
            if len(started) == len(scales):
                timed += 1
            started.add(t.request_id)
            if t.finish_reason is not None:
                done.add(t.request_id)
        if len(started) == len(scales) and tic == 0.0:
            tic = time.perf_counter()
    return timed / (time.perf_counter() - tic)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from mlxcel.models.resolve import resolve_model
    from mlxcel.paths import default_cache_dir

    model = args.model or str(resolve_model(None, default_cache_dir()).path)
    config = json.loads((Path(model) / "config.json").read_text())
    common = Settings(model=model, parallel=args.rows, spec_ngram=False, cache_ram_mib=0)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for k in range(args.adapters):
            write_adapter(Path(tmp) / f"a{k}", config, args.rank, seed=k)
            paths.append((str(Path(tmp) / f"a{k}"), 1.0))
        base = build_mlx_backend(common)
        adapted = build_mlx_backend(attrs.evolve(common, lora=tuple(paths)))
    n = args.adapters
    zero = [(0.0,) * n] * args.rows
    mixed = [tuple(1.0 if k == i % n else 0.0 for k in range(n)) for i in range(args.rows)]
    rates: dict[str, list[float]] = {"base": [], "zero": [], "mixed": []}
    for r in range(args.rounds):
        runs = [("base", base, [()] * args.rows), ("zero", adapted, zero)]
        runs.append(("mixed", adapted, mixed))
        for name, backend, scales in runs if r % 2 == 0 else runs[::-1]:
            rates[name].append(decode_rate(backend, scales, args.tokens))
    # Best of the rounds too: on a shared machine, a round that ran beside other work is
    # slow for reasons of its own; the best round is the closest to the batch's own cost.
    med = {k: statistics.median(v) for k, v in rates.items()}
    best = {k: max(v) for k, v in rates.items()}
    print(f"model {Path(model).name}, {args.rows} rows x {args.tokens} tokens, ", end="")
    print(f"{n} adapters of rank {args.rank} on q_proj+v_proj, {args.rounds} rounds")
    for k in rates:
        runs = ", ".join(f"{x:.1f}" for x in rates[k])
        print(f"  {k:5s} median {med[k]:7.1f} best {best[k]:7.1f} tok/s   ({runs})")
    for stat, v in (("median", med), ("best", best)):
        mixed, zero = v["mixed"] / v["base"], v["zero"] / v["base"]
        print(f"  {stat}: mixed/base {mixed:.3f}  zero/base {zero:.3f}")


if __name__ == "__main__":
    main()

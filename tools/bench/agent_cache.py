"""A coding agent's session replayed against the prompt cache (issue 40, item 3).

    PYTHONPATH=. .venv/bin/python tools/bench/agent_cache.py [--model PATH] [--turns 20]
        [--api openai anthropic] [--edit-every 7]

An agent resends the whole conversation every step: a long system prompt and tool list, then
each turn's assistant tool call and the tool's result appended. Each step should read only
what is new, not the whole conversation again. This replays such a session (scripted calls and
results, so both runs see the same prompts) through the official SDK of each API family,
streaming, and reports per turn: the prompt's tokens, the tokens the server says it reused
(OpenAI ``prompt_tokens_details.cached_tokens``, Anthropic ``cache_read_input_tokens``, which
also carries ``cache_control`` on the system prompt as Claude Code sends it) and the time to
the first streamed event that carries text. Every ``--edit-every`` turns the client rewrites
an earlier tool result (as agents do when they trim old output): the cache can then reuse only
the prefix before the edit. Run twice, with the cache (the default) and without
(``--cache-ram 0`` and ``cache_prompt: false``), on servers started here, one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anthropic
import httpx
import openai

SYSTEM = (
    "You are a careful coding agent working in a Python repository. Read files before you "
    "change them, run the tests after every change, keep diffs small, explain what you did. "
) * 40  # ~1,500 tokens, as agents' instructions are
TOOLS = [
    ("read_file", {"path": {"type": "string"}}),
    ("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
    ("run_tests", {"selector": {"type": "string"}}),
    ("grep", {"pattern": {"type": "string"}, "path": {"type": "string"}}),
    ("list_dir", {"path": {"type": "string"}}),
    ("git_diff", {}),
]


def schema(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props)}


def tool_result(turn: int, edited: bool = False) -> str:
    if edited:
        return f"[output of step {turn} trimmed]"
    lines = [
        f"src/module_{turn}.py:{n}: def function_{turn}_{n}(x): return x * {n}" for n in range(12)
    ]
    return "\n".join(lines)


def call(turn: int) -> tuple[str, dict[str, str]]:
    name, props = TOOLS[turn % len(TOOLS)]
    return name, {k: f"src/module_{turn}.py" for k in props}


@contextmanager
def server(model: str | None, cache: bool) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [sys.executable, "-m", "mlxcel", "serve", "--port", str(port), "--ctx-size", "8192"]
    cmd += ["-m", model] if model else []
    cmd += [] if cache else ["--cache-ram", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("server did not start")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def openai_turns(
    url: str, turns: int, edit_every: int, cache: bool
) -> list[tuple[int, int, float]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    tools: Any = [
        {"type": "function", "function": {"name": n, "description": n, "parameters": schema(p)}}
        for n, p in TOOLS
    ]
    messages: list[Any] = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn}: go on with the task."})
        tic = time.perf_counter()
        first = None
        usage = None
        stream = client.chat.completions.create(
            model="default", messages=messages, tools=tools, max_tokens=8, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={} if cache else {"cache_prompt": False},
        )  # fmt: skip
        for chunk in stream:
            if (
                first is None
                and chunk.choices
                and (chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls)
            ):
                first = time.perf_counter() - tic
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and first is not None
        details = usage.prompt_tokens_details
        out.append((usage.prompt_tokens, details.cached_tokens or 0 if details else 0, first))
        name, args = call(turn)
        cid = f"call_{turn}"
        fn = {"name": name, "arguments": json.dumps(args)}
        calls = [{"id": cid, "type": "function", "function": fn}]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        messages.append({"role": "tool", "tool_call_id": cid, "content": tool_result(turn)})
        if edit_every and turn % edit_every == edit_every - 1:
            # Trim an old result, as agents do: every message after it must be read again.
            j = turn // 2
            k = 3 + 3 * j  # [system, user 0, assistant 0, tool 0, user 1, ...]: tool j
            assert messages[k]["role"] == "tool"
            messages[k] = {**messages[k], "content": tool_result(j, edited=True)}
    return out


def anthropic_turns(
    url: str, turns: int, edit_every: int, cache: bool
) -> list[tuple[int, int, float]]:
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=600)
    tools: Any = [{"name": n, "description": n, "input_schema": schema(p)} for n, p in TOOLS]
    system: Any = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    # [user 0, assistant 0, user (result 0 + step 1), assistant 1, ...]: roles alternate.
    messages: list[Any] = [{"role": "user", "content": "Step 0: go on with the task."}]
    out = []
    for turn in range(turns):
        tic = time.perf_counter()
        first = None
        with client.messages.stream(
            model="default", system=system, messages=messages, tools=tools, max_tokens=8,
            extra_body={"temperature": 0, **({} if cache else {"cache_prompt": False})},
        ) as stream:  # fmt: skip
            for event in stream:
                if first is None and event.type == "content_block_delta":
                    first = time.perf_counter() - tic
            final = stream.get_final_message()
        usage = final.usage
        assert first is not None
        reused = usage.cache_read_input_tokens or 0
        out.append((usage.input_tokens + reused, reused, first))
        name, args = call(turn)
        tid = f"toolu_{turn:04d}"
        messages.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": tid, "name": name, "input": args}]})  # fmt: skip
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tid, "content": tool_result(turn)},
            {"type": "text", "text": f"Step {turn + 1}: go on with the task."},
        ]})  # fmt: skip
        if edit_every and turn % edit_every == edit_every - 1:
            j = turn // 2
            k = 2 + 2 * j  # the user message holding result j
            blocks = messages[k]["content"]
            assert blocks[0]["type"] == "tool_result"
            edited = {**blocks[0], "content": tool_result(j, edited=True)}
            messages[k] = {"role": "user", "content": [edited, *blocks[1:]]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder or GGUF (default: embedded)")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--edit-every", type=int, default=7, help="0: never edit an old result")
    ap.add_argument("--api", nargs="+", default=["openai", "anthropic"])
    args = ap.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    runs = {"openai": openai_turns, "anthropic": anthropic_turns}
    for api in args.api:
        results = {}
        for cache in (True, False):
            with server(args.model, cache) as url:
                results[cache] = runs[api](url, args.turns, args.edit_every, cache)
        print(f"\n{api}: per turn, prompt tokens, reused (cache on), TTFT cache on / off")
        print("| turn | prompt | reused | TTFT on | TTFT off | on / off |")
        print("|---:|---:|---:|---:|---:|---:|")
        for i, (on, off) in enumerate(zip(results[True], results[False], strict=True)):
            print(f"| {i} | {on[0]} | {on[1]} | {on[2] * 1e3:.0f} ms | {off[2] * 1e3:.0f} ms | "
                  f"{on[2] / off[2]:.2f} |")  # fmt: skip
        later = range(1, len(results[True]))
        on_ms = statistics.median(results[True][i][2] for i in later) * 1e3
        off_ms = statistics.median(results[False][i][2] for i in later) * 1e3
        reused = sum(results[True][i][1] for i in later) / sum(results[True][i][0] for i in later)
        assert all(r[1] == 0 for r in results[False]), "cache off still reported reuse"
        print(f"turns 1+: TTFT p50 {on_ms:.0f} ms with the cache, {off_ms:.0f} ms without "
              f"({on_ms / off_ms:.2f}x); {reused:.0%} of their prompt tokens reused")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

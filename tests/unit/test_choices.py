"""n > 1 through the scheduling policy, the output slot and the whole pipeline on the fake
backend: one prompt read per request, one stream per choice, rows counted against --parallel."""

from __future__ import annotations

import json
from typing import Any

import trio

from mlxcel.actors.scheduling import policy
from mlxcel.runtime.messages import (
    GenerationRequest,
    SamplingParams,
    StepOutput,
    TextPrompt,
    Tokenized,
    TokenOut,
)
from mlxcel.runtime.slot import AbortBox, OutputSlot, Reservation
from tests.support.pipeline import admission, pipeline
from tests.unit.test_pipeline_fake import (
    CALL,
    HELLO,
    QWEN_TEMPLATE,
    WEATHER,
    chat,
    fake_server,
    wait_until,
)

# --- policy: rows, not requests --------------------------------------------------------------


def item(rid: str, n: int = 1) -> Tokenized:
    req = GenerationRequest(
        request_id=rid, prompt=TextPrompt(text="x"), sampling=SamplingParams(), max_tokens=5, n=n
    )
    slot: Any = object()  # the policy never touches slots
    return Tokenized(req, slot, (1, 2, 3), 5)


def test_a_request_takes_one_row_per_choice_and_waits_for_rows() -> None:
    state = policy.SchedulerState(parallel=4)
    for it in (item("a", 3), item("b", 2), item("c", 1)):
        state.enqueue(it)
    d = policy.plan(state, ())
    # b needs 2 rows and 1 is free: it waits, and c does not overtake it.
    assert [(s.request_id, s.n) for s in d.plan.inserts] == [("a", 3)]
    assert state.rows == 3 and state.slots == ["a", "a", "a", None]
    assert state.slot_choices[:3] == [0, 1, 2]
    # One choice finishing gives its row back: now b fits, and c waits behind it.
    assert policy.complete(state, StepOutput(tokens=(TokenOut("a", 1, "length", choice=1),))) == ()
    assert [s.request_id for s in policy.plan(state, ()).plan.inserts] == ["b"]
    assert state.slots == ["a", "b", "a", "b"] and state.slot_choices == [0, 0, 2, 1]
    assert policy.plan(state, ()).plan.inserts == ()
    assert policy.complete(state, StepOutput(tokens=(TokenOut("a", 1, "stop", choice=0),))) == ()
    done = policy.complete(state, StepOutput(tokens=(TokenOut("a", 1, "stop", choice=2),)))
    assert done == ("a",) and "a" not in state.running
    assert [s.request_id for s in policy.plan(state, ()).plan.inserts] == ["c"]


def test_a_stopped_choice_leaves_alone_and_the_last_one_ends_the_request() -> None:
    state = policy.SchedulerState(parallel=4)
    state.enqueue(item("a", 2))
    policy.plan(state, ())
    d = policy.plan(state, (), stopped={("a", 1)})
    assert d.plan.stop_choices == (("a", 1),) and d.plan.removes == ()
    assert state.rows == 1 and "a" in state.running
    d = policy.plan(state, (), stopped={("a", 0)})
    assert d.plan.removes == ("a",) and d.plan.stop_choices == ()
    assert state.idle and state.slots == [None] * 4


def test_an_abort_ends_every_choice() -> None:
    state = policy.SchedulerState(parallel=4)
    state.enqueue(item("a", 3))
    policy.plan(state, ())
    assert policy.plan(state, {"a"}).plan.removes == ("a",)
    assert state.rows == 0 and state.slots == [None] * 4


# --- the slot: one buffer per choice ---------------------------------------------------------


async def test_slot_merges_per_choice_and_ends_after_every_finish() -> None:
    aborts = AbortBox()
    slot = OutputSlot("r", Reservation(None, None), aborts, n=2)
    slot.push("a", 1, choice=0)
    slot.push("b", 1, choice=1)
    slot.push("c", 1, choice=0)
    slot.finish("length", choice=1)
    updates = await slot.next_choices()
    assert updates is not None
    assert [(u.index, u.text, u.n_tokens, u.finish_reason) for u in updates] == [
        (0, "ac", 2, None),
        (1, "b", 1, "length"),
    ]
    assert not slot.delivered and not slot.done
    slot.cancel()  # a reader leaving with a choice still running stops the request
    assert aborts.drain() == {"r"}
    slot.finish("stop", choice=0)
    updates = await slot.next_choices()
    assert updates is not None and [(u.index, u.finish_reason) for u in updates] == [(0, "stop")]
    assert slot.delivered and slot.completion_tokens == 3


# --- the pipeline on the fake backend ---------------------------------------------------------


def text(tokenizer: Any, shift: int, count: int) -> str:
    """What choice ``shift`` of the fake model says in ``count`` tokens."""
    return str(tokenizer.decode([HELLO[(i + shift) % len(HELLO)] for i in range(count)]))


async def test_n_choices_read_the_prompt_once(smollm_tokenizer: Any) -> None:
    prompt = "word " * 1200  # ~1200 tokens: three chunks of 512
    async with fake_server(smollm_tokenizer, ctx_size=8192) as (client, backend, _):
        one = (await client.post("/v1/chat/completions", json=chat(prompt, max_tokens=3))).json()
        read_once = backend.prompt_tokens_read
        r = await client.post("/v1/chat/completions", json=chat(prompt, max_tokens=3, n=3))
        body = r.json()
        assert backend.prompt_tokens_read == 2 * read_once
        assert backend.chunks_done[body["id"]] == 3
    assert r.status_code == 200
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["message"]["content"] for c in choices] == [
        text(smollm_tokenizer, i, 3) for i in range(3)
    ]
    assert all(c["finish_reason"] == "length" for c in choices)
    # Usage counts the prompt once and every choice's tokens.
    assert body["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"] == read_once
    assert body["usage"]["completion_tokens"] == 9
    assert body["usage"]["total_tokens"] == read_once + 9


async def stream_frames(client: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


async def test_streamed_choices_carry_their_index(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer) as (client, _, _):
        frames = await stream_frames(
            client,
            "/v1/chat/completions",
            chat(max_tokens=5, n=2, stream=True, stream_options={"include_usage": True}),
        )
        legacy = await stream_frames(
            client, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "n": 2, "stream": True}
        )
    assert all(len(f["choices"]) == 1 for f in frames[:-1])
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for f in frames[:-1]:
        by_index[f["choices"][0]["index"]].append(f["choices"][0])
    for i, parts in by_index.items():
        assert parts[0]["delta"] == {"role": "assistant", "content": None}
        streamed = "".join(p["delta"].get("content") or "" for p in parts)
        assert streamed == text(smollm_tokenizer, i, 5)
        assert [p["finish_reason"] for p in parts if p["finish_reason"]] == ["length"]
        assert parts[-1]["finish_reason"] == "length"
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] == 10
    texts = {0: "", 1: ""}
    for f in legacy:
        texts[f["choices"][0]["index"]] += f["choices"][0]["text"]
    assert texts == {i: text(smollm_tokenizer, i, 4) for i in range(2)}


async def test_a_stop_string_ends_only_its_choice(smollm_tokenizer: Any) -> None:
    first = str(smollm_tokenizer.decode(HELLO[:1]))
    # Choice 0 says HELLO[0] at once; choice 1 only after len(HELLO) - 1 tokens.
    async with fake_server(smollm_tokenizer, step_delay=0.01) as (client, backend, _):
        r = await client.post("/v1/chat/completions", json=chat(max_tokens=3, n=2, stop=[first]))
        rows = backend.rows_per_step
    c0, c1 = r.json()["choices"]
    assert (c0["message"]["content"], c0["finish_reason"]) == ("", "stop")
    assert (c1["message"]["content"], c1["finish_reason"]) == (
        text(smollm_tokenizer, 1, 3),
        "length",
    )
    # The stopped choice left the batch while its sibling went on.
    assert 2 in rows and 1 in rows
    assert r.json()["usage"]["completion_tokens"] == 1 + 3


async def test_a_disconnect_aborts_every_choice(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer, step_delay=0.02) as (client, backend, ctx):
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat(max_tokens=100_000, n=3, stream=True)
        ) as r:
            assert r.status_code == 200
            await wait_until(lambda: backend.rows == 3)
            steps = backend.steps
            await wait_until(lambda: backend.steps >= steps + 3)  # every choice is decoding
        await wait_until(lambda: admission(ctx).active == 0)  # its handler has sent the abort
        steps = backend.steps
        await wait_until(lambda: backend.rows == 0)  # 100,000 tokens each had they gone on
        assert backend.steps <= steps + 1, "a choice went on after the client left"
        assert pipeline(ctx).statistics().running == 0 and admission(ctx).queued == 0


async def test_n_is_bounded_by_parallel_and_validated(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer, parallel=2) as (client, _, _):
        for n in (3, 0, 129, -1):
            for path, body in (
                ("/v1/chat/completions", chat(n=n)),
                ("/v1/completions", {"prompt": "Hi", "n": n}),
            ):
                r = await client.post(path, json=body)
                assert r.status_code == 400, (path, n)
                assert r.json()["error"]["param"] == "n"
        ok = await client.post("/v1/chat/completions", json=chat(n=2, max_tokens=2))
        assert len(ok.json()["choices"]) == 2


async def test_logprobs_are_per_choice(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer) as (client, _, _):
        r = await client.post(
            "/v1/chat/completions",
            json=chat(max_tokens=3, n=2, logprobs=True, top_logprobs=2),
        )
        legacy = await client.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "n": 2, "logprobs": 1}
        )
    for i, c in enumerate(r.json()["choices"]):
        entries = c["logprobs"]["content"]
        assert "".join(e["token"] for e in entries) == c["message"]["content"]
        assert [e["token"] for e in entries] == [
            smollm_tokenizer.decode([HELLO[(k + i) % len(HELLO)]]) for k in range(3)
        ]
    for c in legacy.json()["choices"]:
        lp = c["logprobs"]
        assert "".join(lp["tokens"]) == c["text"]
        assert lp["text_offset"][0] == 0  # offsets count within each choice's own text


async def test_each_choice_parses_its_own_tool_calls(smollm_tokenizer: Any) -> None:
    script = smollm_tokenizer.encode(CALL, add_special_tokens=False)
    async with fake_server(
        smollm_tokenizer,
        script=script,
        eos_after=len(script),
        chat_template=QWEN_TEMPLATE,
        choice_shift=0,  # every choice says the same call
    ) as (client, _, _):
        whole = await client.post("/v1/chat/completions", json=chat(tools=WEATHER, n=2))
        frames = await stream_frames(
            client, "/v1/chat/completions", chat(tools=WEATHER, n=2, stream=True)
        )
    for c in whole.json()["choices"]:
        (call,) = c["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert c["finish_reason"] == "tool_calls"
    ids = [c["message"]["tool_calls"][0]["id"] for c in whole.json()["choices"]]
    assert len(set(ids)) == 2
    args: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for f in frames:
        (choice,) = f["choices"]
        for call in choice["delta"].get("tool_calls", []):
            args[choice["index"]] += call["function"]["arguments"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert {i: json.loads(a) for i, a in args.items()} == {i: {"city": "Paris"} for i in (0, 1)}
    assert finishes == {0: "tool_calls", 1: "tool_calls"}


async def test_slots_show_one_slot_per_choice(smollm_tokenizer: Any) -> None:
    async with fake_server(smollm_tokenizer, step_delay=0.02) as (client, backend, _):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: client.post("/v1/chat/completions", json=chat(max_tokens=40, n=2))
            )
            await wait_until(lambda: backend.rows == 2)
            slots = (await client.get("/slots")).json()
        busy = [s for s in slots if s["is_processing"]]
    assert len(busy) == 2 and len({s["id_task"] for s in busy}) == 1
    assert sorted(s["n_choice"] for s in busy) == [0, 1]


async def test_metrics_count_batch_rows_per_choice(smollm_tokenizer: Any) -> None:
    # One request with n=3: one request processing, three rows in the batch.
    async with fake_server(smollm_tokenizer, step_delay=0.02, metrics_endpoint=True) as (
        client,
        backend,
        _,
    ):
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat(max_tokens=100_000, n=3, stream=True)
        ):
            await wait_until(lambda: backend.rows == 3)
            text = (await client.get("/metrics")).text
        values = {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        assert values["llamacpp:requests_processing"] == 1
        assert values["mlxcel_batch_size"] == 3

"""The official openai SDK's ``client.realtime.connect()`` holding a session with our server
(OpenAI Realtime vocabulary, chosen by the ``model`` query parameter the SDK sends). Every
server event is validated against the SDK's own event models."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from tests.conftest import ServerProcess
from tests.support.realtime import frames, silence, spoken

EVENTS: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)


async def _events_until(conn: Any, kind: str) -> list[dict[str, Any]]:
    seen = []
    async with asyncio.timeout(240):
        while True:
            raw = json.loads(await conn.recv_bytes())
            EVENTS.validate_python(raw)  # the SDK's models accept every event we send
            seen.append(raw)
            if raw["type"] == kind:
                return seen


async def _session(base_url: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    question = np.concatenate([silence(0.3, 24_000), spoken(rate=24_000), silence(0.8, 24_000)])
    async with client.realtime.connect(model="gpt-realtime") as conn:
        created = await _events_until(conn, "session.created")
        await conn.session.update(
            session={
                "type": "realtime",
                "instructions": "Answer briefly.",
                "output_modalities": ["audio"],
                "max_output_tokens": 16,
                "audio": {"input": {"turn_detection": {"type": "server_vad"}}},
            }
        )
        for frame in frames(question, 1920):  # 80 ms at 24 kHz
            await conn.input_audio_buffer.append(audio=frame)
        voice_turn = created + await _events_until(conn, "response.done")
        # A typed message and an explicit text-only response, as a chat UI would send.
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "And of Italy?"}],
            }
        )
        await conn.response.create(response={"output_modalities": ["text"]})
        text_turn = await _events_until(conn, "response.done")
    await client.close()
    return voice_turn, text_turn


def test_sdk_realtime_voice_turn_then_text_turn(tiny_server: ServerProcess) -> None:
    voice, text = asyncio.run(_session(tiny_server.base_url))
    kinds = [e["type"] for e in voice]
    assert kinds[0] == "session.created"
    assert voice[0]["session"]["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    updated = next(e for e in voice if e["type"] == "session.updated")
    assert updated["session"]["instructions"] == "Answer briefly."
    for a, b in [
        ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"),
        ("input_audio_buffer.speech_stopped", "input_audio_buffer.committed"),
        ("input_audio_buffer.committed", "conversation.item.input_audio_transcription.completed"),
        ("conversation.item.input_audio_transcription.completed", "response.created"),
        ("response.created", "response.output_audio.delta"),
        ("response.output_audio.delta", "response.done"),
    ]:
        assert kinds.index(a) < kinds.index(b), (a, b)
    transcript = next(
        e["transcript"]
        for e in voice
        if e["type"] == "conversation.item.input_audio_transcription.completed"
    )
    assert "capital" in transcript.lower() and "france" in transcript.lower()
    audio = b"".join(
        base64.b64decode(e["delta"]) for e in voice if e["type"] == "response.output_audio.delta"
    )
    assert len(audio) % 2 == 0 and np.abs(np.frombuffer(audio, "<i2")).max() > 1000
    spoken_text = "".join(
        e["delta"] for e in voice if e["type"] == "response.output_audio_transcript.delta"
    )
    done = voice[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["transcript"] == spoken_text
    assert done["usage"]["output_tokens"] >= 1

    text_kinds = [e["type"] for e in text]
    assert "response.output_audio.delta" not in text_kinds
    deltas = "".join(e["delta"] for e in text if e["type"] == "response.output_text.delta")
    assert deltas
    final = text[-1]["response"]
    assert final["output"][0]["content"][0] == {"type": "output_text", "text": deltas}
    # The typed message went into the conversation after the spoken exchange.
    assert final["usage"]["input_tokens"] > done["usage"]["input_tokens"]


async def _typed_turns(base_url: str, truncation: object, turns: int) -> list[Any]:
    """A text-only conversation of ``turns`` typed questions; each answer's response.done."""
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    done = []
    async with client.realtime.connect(model="gpt-realtime") as conn:
        await _events_until(conn, "session.created")
        await conn.session.update(
            session={
                "type": "realtime",
                "instructions": "Answer briefly.",
                "output_modalities": ["text"],
                "max_output_tokens": 4,
                "truncation": truncation,  # type: ignore[typeddict-item]
            }
        )
        updated = await _events_until(conn, "session.updated")
        assert updated[-1]["session"]["truncation"] == truncation
        for i in range(turns):
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [
                        {
                            "type": "input_text",
                            "text": f"Question {i}: tell me about the number {i}.",
                        }
                    ],
                }
            )
            await conn.response.create()
            done.append((await _events_until(conn, "response.done"))[-1]["response"])
    await client.close()
    return done


def test_sdk_truncation_retention_ratio_bounds_the_prompt(tiny_server: ServerProcess) -> None:
    limit = 120
    truncation = {
        "type": "retention_ratio",
        "retention_ratio": 0.5,
        "token_limits": {"post_instructions": limit},
    }
    done = asyncio.run(_typed_turns(tiny_server.base_url, truncation, 12))
    assert all(d["status"] == "completed" for d in done)
    # Measured: [29, 56, 83, 110, 66, 93, 120, 66, 93, 120, 68, 97]. The instructions (and
    # the template) take under prompts[0] tokens; the conversation after them stays within
    # the limit, so every prompt is under prompts[0] + limit.
    prompts = [d["usage"]["input_tokens"] for d in done]
    assert max(prompts) < prompts[0] + limit, prompts
    # Each cut went down to half the limit (retention_ratio 0.5)...
    drops = [i for i in range(1, len(prompts)) if prompts[i] < prompts[i - 1]]
    assert drops and all(prompts[i] < prompts[0] + limit // 2 for i in drops), prompts
    # ...and in between the cut stays put: the prompt grows turn by turn (cache hits).
    assert len(drops) <= len(prompts) // 3, prompts


def test_sdk_truncation_auto_keeps_the_whole_short_conversation(
    tiny_server: ServerProcess,
) -> None:
    done = asyncio.run(_typed_turns(tiny_server.base_url, "auto", 4))
    prompts = [d["usage"]["input_tokens"] for d in done]
    assert prompts == sorted(prompts) and len(set(prompts)) == 4

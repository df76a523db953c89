"""The realtime wire in http/: client frames of both vocabularies become typed messages (or
``Refused``, carrying what the session needs to choose the error), and typed server events
become stamped payloads."""

from __future__ import annotations

import base64
import json

import numpy as np

from mlxcel.actors.realtime import events as ev
from mlxcel.actors.realtime.config import ResponseState
from mlxcel.http.realtime_openai import OpenAIRealtime
from mlxcel.http.realtime_voicechat import VoiceChat
from mlxcel.http.realtime_wire import RealtimeWire, parse

VOICECHAT = VoiceChat(22_050)
OPENAI = OpenAIRealtime()


def frame(**event: object) -> str:
    return json.dumps(event)


def pcm16(samples: list[int]) -> str:
    return base64.b64encode(np.array(samples, "<i2").tobytes()).decode()


def test_frames_that_are_not_events_are_refused_as_such() -> None:
    for raw in (b"\x00", "not json", "[1, 2]", '{"a": ' + "[" * 10_000 + "]" * 10_000 + "}"):
        refused = parse(raw, VOICECHAT)
        assert isinstance(refused, ev.Refused) and not refused.event
    refused = parse(b"{}", OPENAI)
    assert isinstance(refused, ev.Refused) and "JSON object" in refused.message


def test_events_become_typed_messages() -> None:
    assert parse(frame(type="session.ping"), OPENAI) == ev.Ping()
    assert parse(frame(type="input_audio_buffer.commit"), OPENAI) == ev.CommitAudio()
    assert parse(frame(type="response.cancel"), VOICECHAT) == ev.CancelResponse()
    create = parse(frame(type="response.create", response={"output_modalities": ["text"]}), OPENAI)
    assert create == ev.CreateResponse(output_audio=False)
    item = parse(
        frame(
            type="conversation.item.create",
            item={"id": "i1", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ),
        OPENAI,
    )
    assert item == ev.CreateItem(ev.Item("i1", "user", "hi"))
    update = parse(frame(type="session.update", session={"instructions": "Be brief."}), OPENAI)
    assert isinstance(update, ev.UpdateSession)
    assert update.patch.values == {"instructions": "Be brief."}


def test_audio_is_decoded_and_only_voicechat_names_its_rate() -> None:
    append = {"type": "input_audio_buffer.append", "audio": pcm16([1, -2, 3]), "sample_rate": 8000}
    native = parse(json.dumps(append), VOICECHAT)
    assert isinstance(native, ev.AppendAudio) and native.sample_rate == 8000
    assert native.pcm.tolist() == [1, -2, 3]
    openai = parse(json.dumps(append), OPENAI)
    assert isinstance(openai, ev.AppendAudio) and openai.sample_rate is None


def test_bad_fields_are_refused_with_the_event_kind() -> None:
    bad_rate = {"type": "input_audio_buffer.append", "audio": "!!", "sample_rate": 1}
    refused = parse(json.dumps(bad_rate), VOICECHAT)
    assert refused == ev.Refused(
        "'sample_rate' must be an integer in 8000..48000",
        param="sample_rate",
        event=True,
        kind="input_audio_buffer.append",
    )
    bad_audio = parse(frame(type="input_audio_buffer.append", audio="!!"), OPENAI)
    assert isinstance(bad_audio, ev.Refused)
    assert (bad_audio.code, bad_audio.param) == ("inference_error", "audio")
    unknown = parse(frame(type="response.dance"), OPENAI)
    assert unknown == ev.Refused(
        "unsupported event type 'response.dance'", event=True, kind="response.dance"
    )
    no_type = parse(frame(audio="x"), OPENAI)
    assert isinstance(no_type, ev.Refused) and no_type.event and no_type.kind is None
    colour = parse(frame(type="session.update", session={"colour": "blue"}), VOICECHAT)
    assert isinstance(colour, ev.Refused) and colour.param == "session.colour"


class Socket:
    async def receive(self) -> str:
        return frame(type="session.ping")

    async def send(self, data: str) -> None:
        pass

    async def close(self, code: int, reason: str) -> None:
        pass


def test_events_are_rendered_stamped_per_vocabulary() -> None:
    r = ResponseState("resp_1", "item_1", True, text="Hi")
    native = RealtimeWire(Socket(), VOICECHAT).render(ev.TextDelta(r, "Hi"), samples_in=2560)
    assert [p["type"] for p in native] == ["response.text.delta"]
    assert native[0]["frame_index"] == 2 and native[0]["event_id"].startswith("event_")
    openai = RealtimeWire(Socket(), OPENAI)
    assert openai.render(ev.TextDelta(r, "Hi"), 2560) == []  # spoken: the transcript follows
    audio = openai.render(ev.AudioDelta(r, b"\x01\x00"), 0)
    assert audio[0]["delta"] == "AQA=" and "frame_index" not in audio[0]
    error = openai.render(ev.Error("server_busy", "full"), 0)[0]
    assert error["error"]["type"] == "server_error"


async def test_the_wire_hands_the_session_typed_messages() -> None:
    assert await RealtimeWire(Socket(), OPENAI).receive() == ev.Ping()

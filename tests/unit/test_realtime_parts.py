"""The realtime session's pure parts: sentence cutting, the outbox, Silero VAD on real speech,
PCM16 decoding, and session.update parsing in both vocabularies."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from mlxcel.actors.realtime.audio import AudioFormatError, InputBuffer, decode_pcm16, resample
from mlxcel.actors.realtime.config import ProtocolError
from mlxcel.actors.realtime.openai_events import OpenAIRealtime
from mlxcel.actors.realtime.outbox import Outbox, OutboxOverflow
from mlxcel.actors.realtime.protocol import VoiceChat
from mlxcel.actors.realtime.sentences import SentenceSplitter
from mlxcel.actors.realtime.vad import VadStream, shared_model
from tests.support.realtime import silence, spoken


def test_sentences_are_cut_as_soon_as_they_end() -> None:
    s = SentenceSplitter()
    assert s.feed("The capital") == []
    assert s.feed(" of France is Paris. It is") == ["The capital of France is Paris."]
    assert s.feed(" big!\nYes") == ["It is big!"]
    assert s.flush() == "Yes"


def test_a_long_first_clause_is_spoken_before_its_sentence_ends() -> None:
    s = SentenceSplitter(first_clause_chars=24)
    assert s.feed("Well, if you really want to know, the answer") == [
        "Well, if you really want to know,"
    ]
    # Later pieces wait for the sentence end.
    assert s.feed(" is long, very long") == []


def test_a_piece_without_punctuation_is_cut_at_a_word() -> None:
    s = SentenceSplitter(max_chars=40)
    pieces = s.feed("word " * 20)
    assert pieces and all(len(p) <= 40 for p in pieces)


async def test_outbox_overflows_instead_of_blocking_and_purges_a_response() -> None:
    box = Outbox(max_bytes=200)
    box.put({"type": "a"})
    box.put({"type": "audio", "delta": "x" * 40}, response_id="r1", first_of_piece=0)
    box.put({"type": "audio", "delta": "y" * 40}, response_id="r1", first_of_piece=1)
    with pytest.raises(OutboxOverflow):
        box.put({"type": "big", "delta": "z" * 200})
    assert box.purge("r1") == {0, 1}
    box.close(1000, "bye")
    first = await box.get()
    assert not isinstance(first, tuple) and first.payload == {"type": "a"}
    assert await box.get() == (1000, "bye")


def test_pcm16_decoding_rejects_bad_base64_and_odd_lengths() -> None:
    assert decode_pcm16(base64.b64encode(b"\x01\x00\xff\xff").decode()).tolist() == [1, -1]
    with pytest.raises(AudioFormatError, match="base64"):
        decode_pcm16("@@@")
    with pytest.raises(AudioFormatError, match="even byte count"):
        decode_pcm16(base64.b64encode(b"\x01\x02\x03").decode())


def test_input_buffer_is_capped() -> None:
    buf = InputBuffer(max_seconds=1)
    buf.append(np.zeros(16_000, np.int16))
    assert not buf.fits(1)
    buf.drop_front(6_000)
    assert buf.samples == 10_000 and buf.start_sample == 6_000


def test_silero_vad_finds_the_spoken_question_in_silence() -> None:
    audio = np.concatenate([silence(1.0), spoken(), silence(1.0)])
    vad = VadStream(shared_model(), silence_ms=400)
    events = []
    for start in range(0, audio.size, 1280):  # 80 ms frames, as clients send them
        events += vad.feed(audio[start : start + 1280].astype(np.float32) / 32768)
    assert [e.kind for e in events] == ["start", "stop"]
    speech_end = 16_000 + spoken().size
    assert 12_000 <= events[0].sample <= 24_000
    assert speech_end - 8_000 <= events[1].sample <= speech_end + 8_000


def test_resample_keeps_duration() -> None:
    tone = (np.sin(np.arange(22_050) * 0.05) * 8000).astype(np.int16)
    out = resample(tone, 22_050, 16_000)
    assert abs(out.size - 16_000) < 100


def test_voicechat_update_fields_and_refusals() -> None:
    d = VoiceChat(22_050)
    cfg = d.initial_config("m")
    d.apply_update(
        cfg,
        {"seed": 3.0, "max_streaming_seconds": 9999, "turn_detection": {"type": "server_vad"}},
        first=True,
    )
    assert cfg.seed == 3 and cfg.max_seconds == 600 and cfg.multi_turn
    with pytest.raises(ProtocolError) as refused:
        d.apply_update(d.initial_config("m"), {"colour": "blue"}, first=True)
    assert refused.value.param == "session.colour"
    with pytest.raises(ProtocolError, match="already configured"):
        d.apply_update(cfg, {}, first=False)


def test_openai_update_honours_what_it_can_and_names_the_rest() -> None:
    d = OpenAIRealtime()
    cfg = d.initial_config("m")
    d.apply_update(
        cfg,
        {
            "type": "realtime",
            "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}, "output": {"voice": "alloy"}},
        },
        first=True,
    )
    assert not cfg.output_audio and cfg.turn_detection is None and cfg.voice == "alloy"
    for bad, param in [
        ({"tools": [{"type": "function", "name": "f"}]}, "session.tools"),
        ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "session.audio.input.format"),
        (
            {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}},
            "session.audio.input.turn_detection",
        ),
    ]:
        with pytest.raises(ProtocolError) as refused:
            d.apply_update(d.initial_config("m"), bad, first=False)
        assert refused.value.param == param

"""The realtime session's pure parts: sentence cutting, the outbox, Silero VAD on real speech,
PCM16 decoding, and session.update parsing in both vocabularies."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from mlxcel.actors.realtime.audio import (
    AudioFormatError,
    InputBuffer,
    InputPace,
    decode_pcm16,
    resample,
)
from mlxcel.actors.realtime.config import ProtocolError
from mlxcel.actors.realtime.outbox import OVERFLOW, Outbox
from mlxcel.actors.realtime.sentences import SentenceSplitter
from mlxcel.actors.realtime.vad import VadStream, shared_model
from mlxcel.http.realtime_openai import OpenAIRealtime
from mlxcel.http.realtime_voicechat import VoiceChat
from tests.support.realtime import silence, spoken


def test_sentences_are_cut_as_soon_as_they_end() -> None:
    s = SentenceSplitter()
    assert s.feed("The capital") == []
    assert s.feed(" of France is Paris. It is") == ["The capital of France is Paris."]
    assert s.feed(" big!\nYes") == ["It is big!"]
    assert s.flush() == "Yes"


def test_the_first_piece_ends_at_a_clause_once_it_is_long_enough() -> None:
    s = SentenceSplitter(first_clause_chars=10)
    # "Well," is too short to say alone; the next clause break ends the first piece.
    assert s.feed("Well, if you want") == []
    assert s.feed(" it, the answer") == ["Well, if you want it,"]
    # Later pieces wait for the sentence end.
    assert s.feed(" is long, very long and goes on") == []


def test_the_first_piece_ends_after_a_few_words_without_punctuation() -> None:
    s = SentenceSplitter(first_words=5)
    assert s.feed("The capital of France is") == []  # "is" may still grow ("isn't")
    assert s.feed(" Paris and") == ["The capital of France is"]
    assert s.feed(" it is a big city") == []
    assert s.feed(". Yes") == ["Paris and it is a big city."]


def test_a_hurried_piece_takes_the_whole_words_there_are() -> None:
    s = SentenceSplitter()
    assert s.feed("Yes. Spiders have eight") == ["Yes."]
    assert s.feed(" legs and") == []  # later pieces wait for their sentence...
    # ...unless the listener is about to run out of audio.
    assert s.feed(" they spi", hurry=True) == ["Spiders have eight legs and they"]
    assert s.feed("n webs, mostly at", hurry=True) == ["spin webs,"]
    assert s.feed(" night. Bye") == ["mostly at night."]


def test_a_piece_without_punctuation_is_cut_at_a_word() -> None:
    s = SentenceSplitter(max_chars=40)
    pieces = s.feed("word " * 20)
    assert pieces and all(len(p) <= 40 for p in pieces)


async def test_outbox_purges_a_response() -> None:
    box = Outbox(max_bytes=200)
    box.put({"type": "a"})
    box.put({"type": "audio", "delta": "x" * 40}, response_id="r1", first_of_piece=0)
    box.put({"type": "audio", "delta": "y" * 40}, response_id="r1", first_of_piece=1)
    assert box.purge("r1") == {0, 1}
    box.close(1000, "bye")
    first = await box.get()
    assert not isinstance(first, tuple) and first.payload == {"type": "a"}
    assert await box.get() == (1000, "bye")


async def test_an_overflowing_outbox_drops_its_events_and_closes_1008() -> None:
    box = Outbox(max_bytes=200)
    box.put({"type": "a"})
    box.put({"type": "big", "delta": "z" * 200})  # never blocks, never raises
    assert box.overflowed and box.pending_bytes == 0
    box.put({"type": "after"})  # dropped: the box is closing
    box.close(1000, "bye")  # the overflow's close stands
    assert await box.get() == OVERFLOW == (1008, "client too slow: outgoing queue overflow")


def test_pcm16_decoding_rejects_bad_base64_and_odd_lengths() -> None:
    assert decode_pcm16(base64.b64encode(b"\x01\x00\xff\xff").decode()).tolist() == [1, -1]
    with pytest.raises(AudioFormatError, match="base64"):
        decode_pcm16("@@@")
    with pytest.raises(AudioFormatError, match="even byte count"):
        decode_pcm16(base64.b64encode(b"\x01\x02\x03").decode())


def test_input_audio_is_paced_after_a_burst() -> None:
    pace = InputPace(speed=20, burst_seconds=120, now=0.0)
    assert pace.take(120, now=0.0) == 0  # a full buffer's worth at once
    assert pace.take(20, now=0.0) == 1.0  # then 20x real time: 20 s of audio wait 1 s
    assert pace.take(20, now=2.0) == 0.0  # that second was waited; the next came in time
    # A microphone (1x) and a replay at 10x are never held back.
    for speed in (1, 10):
        pace, now = InputPace(speed=20, burst_seconds=120, now=0.0), 0.0
        for _ in range(10_000):
            now += 0.08 / speed
            assert pace.take(0.08, now) == 0


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
    # A pause a third of the way into the closing silence (the session transcribes early
    # there), then the stop; a pause between words may come back as a resume.
    kinds = [e.kind for e in events]
    assert kinds[0] == "start" and kinds[-2:] == ["pause", "stop"]
    assert set(kinds[1:-2]) <= {"pause", "resume"}
    speech_end = 16_000 + spoken().size
    assert 12_000 <= events[0].sample <= 24_000
    assert speech_end - 8_000 <= events[-1].sample <= speech_end + 8_000
    # Both mark where the silence began.
    assert events[-2].sample == events[-1].sample


def test_speech_after_a_pause_resumes_the_turn() -> None:
    # With the speech's own quiet edges, a gap of ~0.5 s: past a third of the 1 s silence
    # window (a pause), short of all of it (no stop).
    gap = silence(0.3)
    audio = np.concatenate([silence(1.0), spoken(), gap, spoken(), silence(1.5)])
    vad = VadStream(shared_model(), silence_ms=1000)
    events = []
    for start in range(0, audio.size, 1280):
        events += vad.feed(audio[start : start + 1280].astype(np.float32) / 32768)
    kinds = [e.kind for e in events]
    assert kinds.count("start") == 1 and kinds.count("stop") == 1
    assert "resume" in kinds and kinds[-2:] == ["pause", "stop"]


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

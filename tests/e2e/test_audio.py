"""Audio routes end to end: a real `mlxcel serve` with the packaged Whisper tiny.en and Piper
voice, driven by the official openai SDK (and httpx where the SDK cannot send what we test).

The spoken question is made by our own text-to-speech route, then transcribed: the round trip
must give back the words.
"""

from __future__ import annotations

import base64
import io
import re
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import openai
import pytest

from tests.conftest import ServerProcess

QUESTION = "What is the capital of France? Please answer in one word."


@pytest.fixture(scope="module")
def audio_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    # One audio job per worker at a time, so a held job makes the next one 503.
    server = ServerProcess(
        ["-m", str(tiny_model_dir), "--parallel", "2", "--no-warmup", "--audio-queue-depth", "1"]
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(audio_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{audio_server.base_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=300,
        _strict_response_validation=True,
    )


@pytest.fixture(scope="module")
def question_wav(client: openai.OpenAI) -> bytes:
    """The question, spoken by our Piper voice (WAV, 22.05 kHz)."""
    return client.audio.speech.create(
        model="tts-1", voice="alloy", input=QUESTION, response_format="wav"
    ).content


def _decode(data: bytes) -> tuple[np.ndarray, int]:
    """Samples and rate of any audio file, read back with FFmpeg."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate
        chunks = [frame.to_ndarray().reshape(-1) for frame in container.decode(stream)]
    return np.concatenate(chunks), rate


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


# -- text to speech ---------------------------------------------------------------------------


def test_speech_is_a_wav_file_of_the_voice(question_wav: bytes) -> None:
    with wave.open(io.BytesIO(question_wav)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
        frames = w.readframes(10**9)
    samples = np.frombuffer(frames, dtype="<i2")
    # A spoken sentence of ten words lasts seconds, and is not silence.
    assert 1.5 < samples.size / 22050 < 15
    assert np.abs(samples).max() > 3000


def test_speech_streams_pcm_at_24khz(audio_server: ServerProcess) -> None:
    body = {
        "model": "tts-1",
        "voice": "echo",
        "input": "One. Two. Three.",
        "response_format": "pcm",
    }
    chunks = []
    with httpx.stream(
        "POST", f"{audio_server.base_url}/v1/audio/speech", json=body, timeout=300
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "audio/pcm"
        assert r.headers.get("transfer-encoding") == "chunked"
        chunks = list(r.iter_bytes())
    pcm = b"".join(chunks)
    assert len(pcm) % 2 == 0
    samples = np.frombuffer(pcm, dtype="<i2")
    assert 0.5 < samples.size / 24000 < 10
    assert np.abs(samples).max() > 3000


@pytest.mark.parametrize(
    ("fmt", "content_type", "rate"),
    [("mp3", "audio/mpeg", 22050), ("flac", "audio/flac", 22050), ("opus", "audio/ogg", 48000)],
)
def test_speech_encoded_formats_decode(
    client: openai.OpenAI, fmt: str, content_type: str, rate: int
) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="nova", input="Hello there.", response_format=fmt, speed=1.5
    ) as response:
        assert response.headers["content-type"] == content_type
        data = response.read()
    samples, got_rate = _decode(data)
    assert got_rate == rate
    assert 0.2 < samples.size / rate < 5


def test_speech_speed_changes_duration(client: openai.OpenAI) -> None:
    def seconds(speed: float) -> float:
        data = client.audio.speech.create(
            model="tts-1",
            voice="alloy",
            input="Counting slowly to ten.",
            speed=speed,
            response_format="wav",
        ).content
        samples, rate = _decode(data)
        return samples.size / rate

    assert seconds(2.0) < 0.75 * seconds(1.0)


def test_busy_voice_is_503_and_a_disconnect_frees_it(audio_server: ServerProcess) -> None:
    url = f"{audio_server.base_url}/v1/audio/speech"
    long_text = " ".join(f"This is sentence number {i}." for i in range(60))
    with httpx.stream(
        "POST",
        url,
        json={"input": long_text, "voice": "alloy", "response_format": "pcm"},
        timeout=300,
    ) as r:
        assert r.status_code == 200
        # Keep the iterator: dropping it would close the response (a disconnect).
        chunks = r.iter_bytes()
        assert next(chunks)
        # The stream holds the only place in the text-to-speech queue.
        busy = httpx.post(url, json={"input": "Hi.", "voice": "alloy"}, timeout=60)
        assert busy.status_code == 503
        assert busy.json()["error"]["type"] == "server_busy"
    # Closing the stream is a disconnect: the server drops the job and the place frees up.
    deadline = time.monotonic() + 60
    while True:
        r2 = httpx.post(url, json={"input": "Hi.", "voice": "alloy"}, timeout=300)
        if r2.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r2.status_code == 200
    assert r2.headers["content-type"] == "audio/mpeg"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "voice": "alloy", "response_format": "xml"}, "response_format"),
        ({"input": "hi", "voice": "nobody"}, "voice"),
        ({"input": "hi", "voice": "alloy", "speed": 5}, "speed"),
        ({"input": "", "voice": "alloy"}, "input"),
        # Nothing the voice can speak (found by tools/fuzz_openapi.py: it was a 500).
        ({"input": "\u0016\u0088\U000ddd1b\U00067562", "voice": "alloy"}, "input"),
        ({"input": "x" * 4097, "voice": "alloy"}, "input"),
        ({"input": "hi", "voice": "alloy", "instructions": "whisper"}, "instructions"),
        ({"input": "hi", "voice": "alloy", "stream_format": "sse"}, "stream_format"),
        ({"input": "hi", "voice": "alloy", "pitch": 2}, "pitch"),
    ],
)
def test_speech_bad_fields_are_400_naming_them(
    audio_server: ServerProcess, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        f"{audio_server.base_url}/v1/audio/speech", json={"model": "tts-1", **body}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# -- speech to text ---------------------------------------------------------------------------


def test_transcription_round_trip_json(client: openai.OpenAI, question_wav: bytes) -> None:
    result = client.audio.transcriptions.create(
        model="whisper-1", file=("question.wav", question_wav)
    )
    assert {"capital", "france"} <= _words(result.text)
    assert result.usage is not None and result.usage.type == "duration"
    assert result.usage.seconds >= 2


def test_transcription_text_format(client: openai.OpenAI, question_wav: bytes) -> None:
    text = client.audio.transcriptions.create(
        model="whisper-1", file=("question.wav", question_wav), response_format="text"
    )
    assert isinstance(text, str)
    assert {"capital", "france"} <= _words(text)


def test_transcription_verbose_json_segments_and_words(
    client: openai.OpenAI, question_wav: bytes
) -> None:
    result = client.audio.transcriptions.create(
        model="whisper-1",
        file=("question.wav", question_wav),
        response_format="verbose_json",
        timestamp_granularities=["segment", "word"],
    )
    assert result.language == "english"
    assert 2 < result.duration < 15
    assert result.segments and result.segments[0].id == 0
    assert result.segments[-1].end <= result.duration + 0.5
    assert "".join(s.text for s in result.segments).strip() == result.text
    assert result.words is not None
    words = [w.word.lower().strip("?,.") for w in result.words]
    assert "capital" in words and "france" in words
    starts = [w.start for w in result.words]
    assert starts == sorted(starts)


def test_transcription_srt_and_vtt(client: openai.OpenAI, question_wav: bytes) -> None:
    srt = client.audio.transcriptions.create(
        model="whisper-1", file=("q.wav", question_wav), response_format="srt"
    )
    assert re.match(r"1\n\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\n\S", srt)
    vtt = client.audio.transcriptions.create(
        model="whisper-1", file=("q.wav", question_wav), response_format="vtt"
    )
    assert re.match(r"WEBVTT\n\n\d\d:\d\d:\d\d\.\d{3} --> \d\d:\d\d:\d\d\.\d{3}\n\S", vtt)
    assert "France" in srt and "France" in vtt


def test_transcription_of_compressed_upload(client: openai.OpenAI) -> None:
    mp3 = client.audio.speech.create(
        model="tts-1", voice="alloy", input="The weather is sunny today.", response_format="mp3"
    ).content
    result = client.audio.transcriptions.create(model="whisper-1", file=("w.mp3", mp3))
    assert {"weather", "sunny"} <= _words(result.text)


def test_translation_route(client: openai.OpenAI, question_wav: bytes) -> None:
    # The SDK marks translations deprecated (OpenAI's newer models do not offer it).
    with pytest.warns(DeprecationWarning):
        result = client.audio.translations.create(model="whisper-1", file=("q.wav", question_wav))
    assert {"capital", "france"} <= _words(result.text)


def test_undecodable_audio_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(
            model="whisper-1", file=("notes.wav", b"this is not audio at all" * 100)
        )
    assert caught.value.body["param"] == "file"  # type: ignore[index]


def test_oversized_upload_is_413(audio_server: ServerProcess) -> None:
    big = b"\0" * (25 * 1024 * 1024 + 1)
    r = httpx.post(
        f"{audio_server.base_url}/v1/audio/transcriptions",
        files={"file": ("big.wav", big)},
        data={"model": "whisper-1"},
        timeout=120,
    )
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_upload_above_json_limit_is_accepted(client: openai.OpenAI, question_wav: bytes) -> None:
    # Audio uploads are not held to --max-request-bytes (2 MiB): the question as 48 kHz
    # stereo 32-bit WAV, plus three seconds of silence, is over 2 MiB.
    with av.open(io.BytesIO(question_wav)) as container:
        resampler = av.AudioResampler(format="s32", layout="stereo", rate=48000)
        frames = [
            out.to_ndarray().reshape(-1)
            for frame in container.decode(audio=0)
            for out in resampler.resample(frame)
        ]
    samples = np.concatenate([*frames, np.zeros(2 * 48000 * 3, dtype=np.int32)])
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(4)
        w.setframerate(48000)
        w.writeframes(samples.astype("<i4").tobytes())
    assert buf.tell() > 2 * 1024 * 1024
    result = client.audio.transcriptions.create(model="whisper-1", file=("l.wav", buf.getvalue()))
    assert "capital" in _words(result.text)


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"response_format": "xml"}, "response_format"),
        ({"temperature": "2"}, "temperature"),
        ({"language": "klingon"}, "language"),
        ({"language": "fr"}, "language"),
        ({"timestamp_granularities[]": "word"}, "timestamp_granularities"),
        ({"stream": "true"}, "stream"),
    ],
)
def test_transcription_bad_fields_are_400_naming_them(
    audio_server: ServerProcess, question_wav: bytes, data: dict[str, str], param: str
) -> None:
    r = httpx.post(
        f"{audio_server.base_url}/v1/audio/transcriptions",
        files={"file": ("q.wav", question_wav)},
        data={"model": "whisper-1", **data},
        timeout=300,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_audio_model_is_404(client: openai.OpenAI, question_wav: bytes) -> None:
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="whisper-9", file=("q.wav", question_wav))


def test_models_and_props_list_audio(client: openai.OpenAI, audio_server: ServerProcess) -> None:
    listed = {m.id: m for m in client.models.list().data}
    stt = listed["whisper-tiny.en"].model_extra
    tts = listed["en_US-joe-medium"].model_extra
    assert stt is not None and stt["capabilities"] == ["transcription", "translation"]
    assert tts is not None and tts["capabilities"] == ["speech"]
    caps = httpx.get(f"{audio_server.base_url}/props").json()["capabilities"]
    assert caps["speech_to_text"]["model"] == "whisper-tiny.en"
    assert caps["text_to_speech"]["sample_rate"] == 22050
    assert "wav" in caps["text_to_speech"]["formats"]
    # No --realtime-max-sessions: the cap is what 2 decode rows and speech workers of one
    # place each serve at real-time pace (one session), and the log says where it came from.
    assert caps["realtime"] == {
        "max_sessions": 1,
        "capacity": 1,
        "capacity_from": {"parallel": 2, "audio_queue_depth": 1},
    }
    log = audio_server.log()
    assert "realtime voice sessions at once: 1 (min(--parallel 2, --audio-queue-depth 1))" in log
    assert "is above the" not in log


def test_no_audio_server_answers_501(tiny_model_dir: Path) -> None:
    server = ServerProcess(["-m", str(tiny_model_dir), "--no-audio", "--no-warmup"])
    try:
        c = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            c.audio.transcriptions.create(model="whisper-1", file=("q.wav", b"RIFF"))
        assert caught.value.status_code == 501
        assert "--stt-model" in caught.value.message
        with pytest.raises(openai.APIStatusError) as caught:
            c.audio.speech.create(model="tts-1", voice="alloy", input="hi")
        assert caught.value.status_code == 501
        assert "--tts-model" in caught.value.message
        ids = {m.id for m in c.models.list().data}
        assert "whisper-tiny.en" not in ids and "en_US-joe-medium" not in ids
        c.close()
    finally:
        server.stop()


# -- audio parts on chat, heard through speech-to-text -----------------------------------------


def test_an_audio_part_is_heard_as_its_transcript(
    client: openai.OpenAI, question_wav: bytes
) -> None:
    heard = client.audio.transcriptions.create(model="whisper-1", file=("q.wav", question_wav))
    data = base64.b64encode(question_wav).decode()
    audio: Any = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    cue: Any = {"type": "text", "text": "Answer:"}
    by_ear = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": [audio, cue]}],
        max_tokens=4,
        temperature=0,
    )
    by_text = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": f"{heard.text.strip()}\nAnswer:"}],
        max_tokens=4,
        temperature=0,
    )
    assert {"capital", "france"} <= _words(heard.text)
    assert by_ear.usage is not None and by_text.usage is not None
    assert by_ear.usage.prompt_tokens == by_text.usage.prompt_tokens
    assert by_ear.choices[0].message.content == by_text.choices[0].message.content


@pytest.mark.parametrize(
    ("data", "message"),
    [("@@not base64@@", "not valid base64"), (base64.b64encode(b"hello").decode(), "decoded")],
)
def test_a_bad_audio_part_is_400_naming_it(client: openai.OpenAI, data: str, message: str) -> None:
    audio: Any = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": [audio]}], max_tokens=1
        )
    assert message in raised.value.body["message"]  # type: ignore[index]
    assert raised.value.body["param"] == "messages[0].content[0]"  # type: ignore[index]


def test_responses_input_audio_is_stored_as_its_transcript(
    client: openai.OpenAI, question_wav: bytes
) -> None:
    heard = client.audio.transcriptions.create(model="whisper-1", file=("q.wav", question_wav))
    data = base64.b64encode(question_wav).decode()
    content: Any = [
        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
        {"type": "input_text", "text": "Answer:"},
    ]
    response = client.responses.create(
        model="any", input=[{"role": "user", "content": content}], max_output_tokens=2
    )
    by_text = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": f"{heard.text.strip()}\nAnswer:"}],
        max_tokens=1,
    )
    assert response.usage is not None and by_text.usage is not None
    assert response.usage.input_tokens == by_text.usage.prompt_tokens
    stored = client.responses.input_items.list(response.id)
    parts = stored.data[0].content  # type: ignore[union-attr]
    assert [p.type for p in parts] == ["input_text", "input_text"]
    assert parts[0].text == heard.text.strip()  # type: ignore[union-attr]

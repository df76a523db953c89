"""Which audio models a spec names, the espeak-ng fallback engine, and the stream encoders."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from mlxcel.actors.audio.backends import Espeak, wav_payload
from mlxcel.actors.audio.decode import Pcm16Resampler, decode_audio, float_to_pcm16
from mlxcel.actors.audio.encode import SpeechEncoder
from mlxcel.models.audio import resolve_stt, resolve_tts
from mlxcel.models.errors import ModelNotFound, UnsupportedModel
from mlxcel.runtime.errors import InvalidRequest


def test_packaged_defaults() -> None:
    stt = resolve_stt(None)
    assert stt is not None and stt.model_id == "whisper-tiny.en"
    assert stt.engine == "faster-whisper" and not stt.multilingual
    tts = resolve_tts(None)
    assert tts is not None and tts.engine == "piper"
    assert tts.sample_rate == 22050 and tts.voices[0] == "joe"
    assert resolve_stt("none") is None and resolve_tts("none") is None


def test_mlx_whisper_folder_is_refused_with_what_is_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"n_mels": 80, "n_audio_ctx": 1500}))
    (tmp_path / "weights.npz").write_bytes(b"")
    with pytest.raises(UnsupportedModel, match="mlx-whisper.*CTranslate2"):
        resolve_stt(str(tmp_path))


def test_transformers_whisper_folder_says_how_to_convert(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(UnsupportedModel, match="ct2-transformers-converter"):
        resolve_stt(str(tmp_path))


def test_ctranslate2_folder_multilingual_from_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "vocabulary.txt").write_text("\n".join(["t"] * 51865))
    model = resolve_stt(str(tmp_path))
    assert model is not None and model.multilingual and model.model_id == tmp_path.name


def test_offline_hub_id_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="--stt-model 'Systran/faster-whisper-base'"):
        resolve_stt("base")


def test_piper_voice_folder(tmp_path: Path) -> None:
    packaged = resolve_tts(None)
    assert packaged is not None and packaged.config_path is not None
    shutil.copy(packaged.config_path, tmp_path / "en_GB-test-low.onnx.json")
    (tmp_path / "en_GB-test-low.onnx").write_bytes(b"")
    voice = resolve_tts(str(tmp_path))
    assert voice is not None and voice.voices[:2] == ("test", "en_GB-test-low")
    with pytest.raises(UnsupportedModel):
        resolve_tts(str(tmp_path / "en_GB-test-low.onnx.json"))


FAKE_ESPEAK = """#!{python}
import struct, sys
args = sys.argv[1:]
rate = int(args[args.index("-s") + 1])
n = 2205 * len(args[-1]) * 175 // rate
data = b"\\x10\\x00" * n
head = b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt "
head += struct.pack("<IHHIIHH", 16, 1, 1, 22050, 44100, 2, 16)
sys.stdout.buffer.write(head + b"data" + struct.pack("<I", 0xFFFFFFFF) + data)
"""


def test_espeak_fallback_speaks_sentence_by_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = tmp_path / "espeak-ng"
    exe.write_text(FAKE_ESPEAK.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    model = resolve_tts("espeak-ng")
    assert model is not None and model.engine == "espeak-ng" and model.sample_rate == 22050
    chunks = list(Espeak(model).synthesize("Hi. How are you?", "en-us", 1.0))
    # One chunk per sentence, the WAV header stripped even with placeholder lengths.
    assert [len(c) for c in chunks] == [2 * 2205 * 3, 2 * 2205 * 12]
    faster = list(Espeak(model).synthesize("Hi.", "en-us", 2.0))
    assert len(faster[0]) < len(chunks[0])


def test_wav_payload_honours_real_lengths() -> None:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x01\x00" * 10)
    assert wav_payload(buf.getvalue() + b"LIST\x04\x00\x00\x00junk") == b"\x01\x00" * 10


def _tone(seconds: float, rate: int) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return float_to_pcm16(0.5 * np.sin(2 * np.pi * 440 * t))


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "opus", "aac"])
def test_streamed_encodings_decode_to_the_same_length(fmt: str) -> None:
    pcm = _tone(1.0, 22050)
    encoder = SpeechEncoder(fmt, 22050)
    out = b"".join(encoder.push(pcm[i : i + 4410]) for i in range(0, len(pcm), 4410))
    out += encoder.finish()
    samples = decode_audio(out)
    # Codec priming and padding add a few tens of milliseconds at most.
    assert abs(samples.size / 16000 - 1.0) < 0.12
    assert 0.3 < float(np.abs(samples).max()) < 0.7


def test_pcm_format_is_24khz() -> None:
    encoder = SpeechEncoder("pcm", 22050)
    out = encoder.push(_tone(1.0, 22050)) + encoder.finish()
    assert abs(len(out) / 2 / 24000 - 1.0) < 0.01


def test_resampler_streams_in_pieces() -> None:
    pcm = _tone(0.5, 24000)
    resampler = Pcm16Resampler(24000, 16000)
    out = b"".join(resampler.push(pcm[i : i + 960]) for i in range(0, len(pcm), 960))
    out += resampler.flush()
    assert abs(len(out) / 2 - 8000) <= 32


def test_decode_refuses_garbage_and_overlong_audio() -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_audio(b"definitely not audio" * 50)
    assert caught.value.param == "file"
    encoder = SpeechEncoder("wav", 16000)
    wav = encoder.push(_tone(3.0, 16000)) + encoder.finish()
    with pytest.raises(InvalidRequest, match="longer than 2 seconds"):
        decode_audio(wav, max_seconds=2)

"""Audio parts before submission (mlxcel.http.heard): which are taken, how a model that hears
audio gets them (decoded waveforms) and how one that does not (transcripts in their place),
including a conversation stored by the first and answered by the second."""

from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from mlxcel.http import heard
from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import AudioRef, ChatPrompt, GenerationRequest, SamplingParams
from tests.support.noise_wav import noise_wav


def wav_b64(seconds: float, seed: int = 0) -> str:
    return base64.b64encode(noise_wav(seed, seconds)).decode()


class Ears:
    """A speech-to-text worker that says how many samples it heard."""

    def __init__(self) -> None:
        self.heard: list[int] = []

    async def transcribe(self, samples: Any) -> Any:
        self.heard.append(len(samples))
        return SimpleNamespace(text=f" heard {len(self.heard)} ")


NATIVE = SimpleNamespace(hears=True, max_audio_seconds=2.0)
IMAGES_ONLY = SimpleNamespace(hears=False, max_audio_seconds=30.0)


@pytest.mark.parametrize(
    ("stt", "audio_input", "media", "expected"),
    [
        (Ears(), True, None, (True, False)),  # a text model with a speech model: transcribed
        (None, True, None, (False, False)),  # no speech model: refused
        (None, True, NATIVE, (True, True)),  # the model hears it
        (Ears(), True, IMAGES_ONLY, (True, False)),  # a vision model without an audio tower
        (Ears(), False, NATIVE, (False, False)),  # --no-audio-input refuses it everywhere
    ],
)
def test_which_audio_is_taken_and_by_whom(
    stt: Any, audio_input: bool, media: Any, expected: tuple[bool, bool]
) -> None:
    assert heard.hearing(stt, audio_input, media) == expected


def request(messages: list[dict[str, Any]], *audio: AudioRef) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        prompt=ChatPrompt(messages=tuple(messages)),
        sampling=SamplingParams(),
        max_tokens=8,
        audio=tuple(audio),
    )


async def test_a_model_that_hears_gets_waveforms_in_order() -> None:
    refs = [AudioRef(f"messages[0].content[{i}]", wav_b64(0.5 + i / 4), "wav", "") for i in (0, 1)]
    gen = request([{"role": "user", "content": [{"type": "audio"}, {"type": "audio"}]}], *refs)
    out = await heard.hear(gen, Ears(), NATIVE)
    assert [len(w) for w in out.audio] == [8000, 12000]
    assert all(w.dtype == np.float32 for w in out.audio)
    # The prompt is untouched: the processor puts each audio's tokens at its part.
    assert out.prompt == gen.prompt


async def test_audio_longer_than_the_model_hears_is_refused_naming_it() -> None:
    gen = request([], AudioRef("input[0].content[1]", wav_b64(2.5), "wav", ""))
    with pytest.raises(InvalidRequest) as caught:
        await heard.hear(gen, Ears(), NATIVE)
    assert caught.value.param == "input[0].content[1]"
    assert "longer than 2 seconds" in caught.value.message


async def test_stored_audio_parts_are_transcribed_for_a_model_that_does_not_hear() -> None:
    """A conversation stored by a model that hears audio (audio kept as parts), answered by a
    text model: each part becomes its transcript, and an all-text message a string again."""
    ears = Ears()
    refs = [AudioRef(f"msg_{i}.content[0]", wav_b64(0.25, seed=i), "wav", "") for i in (1, 2)]
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Who?"}]},
        {"role": "assistant", "content": "Someone."},
        {"role": "user", "content": [{"type": "audio"}]},
    ]
    out = await heard.hear(request(messages, *refs), ears, None)
    assert ears.heard == [4000, 4000]
    assert [m["content"] for m in out.prompt.messages] == ["heard 1\nWho?", "Someone.", "heard 2"]
    assert out.audio == ()


async def test_keep_items_checks_audio_and_stores_it_in_openai_s_shape() -> None:
    data = wav_b64(0.5)
    items = [
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_audio", "data": data, "format": "wav", "where": "input[0]"},
                {"type": "input_text", "text": "Who?"},
            ],
        }
    ]
    kept = await heard.keep_items(items, 2.0)
    assert kept[0]["content"] == [
        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
        {"type": "input_text", "text": "Who?"},
    ]
    bad = [{**items[0], "content": [{**items[0]["content"][0], "data": "not base64!"}]}]
    with pytest.raises(InvalidRequest) as caught:
        await heard.keep_items(bad, 2.0)
    assert caught.value.param == "input[0]"

"""Audio parts heard by the model itself (issue 24): a tiny random-weight Gemma 4 checkpoint
(vision tower and Conformer audio tower, mlx-vlm's own classes, built at test time) loaded
through `-m`; ``input_audio`` parts on chat and Responses reach its audio tower instead of
speech-to-text.

The weights are random, so these tests check what the plumbing decides (which audio, how many
tokens, what is refused, what is stored), never answer quality: no real audio-capable
checkpoint was run here."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import ServerProcess
from tests.e2e.test_vision import Vlm, image_part
from tests.support.noise_wav import noise_wav as wav
from tests.support.tiny_vlm import build_tiny_vlm

QUESTION = {"type": "text", "text": "What was said?"}
# Gemma 4 gives an audio part one token per 40 ms, between its begin and end markers.
MS_PER_TOKEN = 40


# The same client and helpers as the vision tests: a Gemma 4 reads images too.
Gemma = Vlm


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gemma]:
    folder = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "gemma4", "gemma4")
    server = ServerProcess(["-m", str(folder), "-np", "4"])
    yield Gemma("gemma4", folder, folder, server)
    server.stop()


def audio_part(data: bytes | str) -> dict[str, Any]:
    text = data if isinstance(data, str) else base64.b64encode(data).decode()
    return {"type": "input_audio", "input_audio": {"data": text, "format": "wav"}}


# Gemma 4's own feature extractor (128 mel bins over a 512-point FFT) warns of an empty mel
# filter when it is built, as it does for the real checkpoint.
@pytest.mark.filterwarnings("ignore:At least one mel filter has all zero values")
def test_the_answer_is_mlx_vlm_s_own(gemma: Gemma, tmp_path: Path) -> None:
    """Greedy, our batched engine gives the tokens mlx-vlm's own generate gives for the same
    rendered prompt and audio file."""
    import mlx_vlm

    path = tmp_path / "said.wav"
    path.write_bytes(wav(1))
    model, processor = mlx_vlm.load(str(gemma.folder))
    messages = [{"role": "user", "content": [{"type": "audio"}, QUESTION]}]
    prompt = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    own = mlx_vlm.generate(
        model, processor, prompt, audio=[str(path)], max_tokens=6, temperature=0.0
    )
    ours = gemma.ask(audio_part(wav(1)), QUESTION)
    assert ours.choices[0].message.content == own.text
    # The audio's tokens count in the prompt: 1 s is 25 tokens and its two markers.
    assert ours.usage.prompt_tokens == own.prompt_tokens
    # A text prompt decodes through the batch engine's own caches (fewer than the layers:
    # KV sharing), to mlx-vlm's tokens too.
    messages = [{"role": "user", "content": QUESTION["text"]}]
    prompt = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    own_text = mlx_vlm.generate(model, processor, prompt, max_tokens=6, temperature=0.0)
    text_only = gemma.ask(QUESTION)
    assert text_only.choices[0].message.content == own_text.text
    assert ours.usage.prompt_tokens - text_only.usage.prompt_tokens == 1000 // MS_PER_TOKEN + 2


def test_the_audio_decides(gemma: Gemma) -> None:
    def heard(data: bytes) -> list[float]:
        # The tiny model's words barely depend on the audio: the log-probabilities do.
        choice = gemma.ask(audio_part(data), QUESTION, max_tokens=3, logprobs=True).choices[0]
        return [t.logprob for t in choice.logprobs.content]

    first, other, again = heard(wav(2)), heard(wav(3)), heard(wav(2))
    assert first == again
    assert first != other


def test_audio_and_an_image_in_one_prompt(gemma: Gemma) -> None:
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(4).integers(0, 256, (64, 64, 3), np.uint8))
    both = gemma.ask(image_part(image), audio_part(wav(5, seconds=2.0)), QUESTION)
    alone = gemma.ask(image_part(image), QUESTION)
    assert both.choices[0].message.content
    assert both.usage.prompt_tokens - alone.usage.prompt_tokens == 2000 // MS_PER_TOKEN + 2


def test_the_server_says_the_model_hears(gemma: Gemma) -> None:
    props = httpx.get(f"{gemma.server.base_url}/props").json()
    assert props["modalities"] == {"vision": True, "video": False, "audio": True}
    models = httpx.get(f"{gemma.server.base_url}/v1/models").json()
    assert {"completion", "vision", "audio"} <= set(models["data"][0]["capabilities"])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("not base64!", "not valid base64"),
        (base64.b64encode(b"RIFF not really a wav").decode(), "messages[0].content[0]"),
        # Gemma 4's audio tokens cover 30 s: longer audio would be cut without a word.
        (wav(6, seconds=31.0), "longer than 30 seconds"),
    ],
)
def test_audio_the_model_cannot_hear_is_400_naming_it(
    gemma: Gemma, data: bytes | str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gemma.ask(audio_part(data), QUESTION)
    error = caught.value.body
    assert message in error["message"]
    assert error["param"] == "messages[0].content[0]"
    # Nothing was left running.
    slots = httpx.get(f"{gemma.server.base_url}/slots").json()
    assert not any(s["is_processing"] for s in slots)


def test_responses_input_audio_is_heard_stored_and_chained(gemma: Gemma) -> None:
    said = base64.b64encode(wav(7)).decode()
    first = gemma.client.responses.create(
        model="any",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_audio", "input_audio": {"data": said, "format": "wav"}},
                    {"type": "input_text", "text": "What was said?"},
                ],
            }
        ],
        max_output_tokens=3,
        temperature=0,
    )
    text_only = gemma.client.responses.create(
        model="any", input="What was said?", max_output_tokens=1, temperature=0
    )
    assert first.usage.input_tokens - text_only.usage.input_tokens == 1000 // MS_PER_TOKEN + 2
    # Stored as OpenAI shapes it, the audio with it: a chained turn hears it again.
    items = gemma.client.responses.input_items.list(first.id).data
    stored = items[0].content[0].to_dict()
    assert stored == {"type": "input_audio", "input_audio": {"data": said, "format": "wav"}}
    second = gemma.client.responses.create(
        model="any",
        previous_response_id=first.id,
        input="And then?",
        max_output_tokens=1,
        temperature=0,
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_a_text_stream_keeps_streaming_beside_audio_requests(gemma: Gemma) -> None:
    """A text stream beside audio requests: each audio prefill is one step it waits, and
    every one of its tokens arrives."""
    stream = gemma.client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Count to fifty."}],
        max_tokens=60,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    answers: list[str] = []

    def ask_heard() -> None:
        for seed in range(8, 11):
            answers.append(gemma.ask(audio_part(wav(seed)), QUESTION).choices[0].message.content)

    beside = threading.Thread(target=ask_heard)
    usage = None
    for n, chunk in enumerate(stream):
        if n == 2:
            beside.start()
        usage = chunk.usage or usage
    beside.join(timeout=60)
    assert usage is not None and usage.completion_tokens == 60
    assert len(answers) == 3 and all(answers)


def test_native_completion_takes_audio_in_multimodal_data(gemma: Gemma) -> None:
    """llama-server's ``multimodal_data`` carries no type: a WAV file is audio (on a model
    that hears it), anything else an image; each fills its ``<__media__>`` marker in order."""
    from PIL import Image

    def complete(prompt: str, *media: bytes) -> Any:
        encoded = [base64.b64encode(m).decode() for m in media]
        body = {
            "prompt": {"prompt_string": prompt, "multimodal_data": encoded},
            "n_predict": 6,
            "temperature": 0,
        }
        r = httpx.post(f"{gemma.server.base_url}/completion", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    said = wav(12)
    chat = gemma.ask(audio_part(said), QUESTION)
    # The chat template's rendering of the same turn, the audio where its marker is.
    turn = "<|im_start|>user\n<__media__>What was said?<|im_end|>\n<|im_start|>assistant\n"
    native = complete(turn, said)
    assert native["content"] == chat.choices[0].message.content
    assert native["tokens_evaluated"] == chat.usage.prompt_tokens

    image = Image.fromarray(np.random.default_rng(13).integers(0, 256, (64, 64, 3), np.uint8))
    png = io.BytesIO()
    image.save(png, "PNG")
    both = complete("<__media__><__media__>What?", png.getvalue(), said)
    image_only = complete("<__media__>What?", png.getvalue())
    added = both["tokens_evaluated"] - image_only["tokens_evaluated"]
    assert added == 1000 // MS_PER_TOKEN + 2


def test_token_counts_include_the_media_tokens(gemma: Gemma) -> None:
    """The counting routes read images and audio as generation does: their counts are the
    prompt_tokens the same request is then billed."""
    from PIL import Image

    base = gemma.server.base_url
    image = Image.fromarray(np.random.default_rng(14).integers(0, 256, (64, 64, 3), np.uint8))
    parts = [image_part(image), audio_part(wav(15)), QUESTION]
    billed = gemma.ask(*parts, max_tokens=1).usage.prompt_tokens
    body = {"messages": [{"role": "user", "content": parts}]}
    chat = httpx.post(f"{base}/v1/chat/completions/input_tokens", json=body, timeout=60)
    assert chat.json() == {"input_tokens": billed}

    said = base64.b64encode(wav(15)).decode()
    url = image_part(image)["image_url"]["url"]
    content = [
        {"type": "input_image", "image_url": url},
        {"type": "input_audio", "input_audio": {"data": said, "format": "wav"}},
        {"type": "input_text", "text": QUESTION["text"]},
    ]
    item = {"type": "message", "role": "user", "content": content}
    counted = gemma.client.responses.input_tokens.count(model="any", input=[item])
    answered = gemma.client.responses.create(model="any", input=[item], max_output_tokens=1)
    assert counted.input_tokens == answered.usage.input_tokens

    data = url.split(",", 1)[1]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    message = {"role": "user", "content": [block, {"type": "text", "text": "What is it?"}]}
    anthropic = {"model": "any", "max_tokens": 1, "messages": [message]}
    count = httpx.post(f"{base}/v1/messages/count_tokens", json=anthropic, timeout=60).json()
    reply = httpx.post(f"{base}/v1/messages", json=anthropic, timeout=60).json()
    assert count["input_tokens"] == reply["usage"]["input_tokens"]

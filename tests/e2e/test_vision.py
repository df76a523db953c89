"""Vision-language models served like any folder (issue 24): tiny random-weight checkpoints of
two mlx-vlm families (Qwen2-VL, with M-RoPE; Idefics3 / SmolVLM), built at test time, loaded
through `-m`, asked about images with the official OpenAI SDK.

The weights are random, so these tests check what the plumbing decides (which image, how many
tokens, what is cached, what is refused), never answer quality: that was checked on no real
VLM here."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.conftest import ServerProcess
from tests.support.metrics import sample
from tests.support.noise_wav import noise_wav
from tests.support.tiny_vlm import build_tiny_vlm

QUESTION = "Describe the image."


class Vlm:
    def __init__(self, family: str, folder: Path, media: Path, server: ServerProcess) -> None:
        self.family, self.folder, self.media, self.server = family, folder, media, server
        self.client = openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        )

    def ask(self, *parts: dict[str, Any], **fields: Any) -> Any:
        return self.client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": list(parts)}],
            temperature=0,
            max_tokens=fields.pop("max_tokens", 6),
            **fields,
        )


@pytest.fixture(scope="module", params=["qwen2_vl", "idefics3"])
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vlm]:
    family = request.param
    folder = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / family, family)
    media = tmp_path_factory.mktemp("media")
    (media / "one.png").write_bytes(png(noise(1)))
    args = ["-m", str(folder), "-np", "4", "--metrics", "--max-images", "2"]
    server = ServerProcess([*args, "--media-path", str(media)])
    yield Vlm(family, folder, media, server)
    server.stop()


def noise(seed: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def image_part(image: Image.Image | str) -> dict[str, Any]:
    url = (
        image
        if isinstance(image, str)
        else "data:image/png;base64," + base64.b64encode(png(image)).decode()
    )
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": QUESTION}


def test_the_answer_is_mlx_vlm_s_own(vlm: Vlm) -> None:
    """Greedy, our batched engine gives the tokens mlx-vlm's own generate gives for the same
    rendered prompt and image."""
    import mlx_vlm

    image = noise(3)
    model, processor = mlx_vlm.load(str(vlm.folder))
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    prompt = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    own = mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=6, temperature=0.0)
    ours = vlm.ask(image_part(image), TEXT)
    assert ours.choices[0].message.content == own.text
    # Image tokens count in the prompt, as the processor expanded them.
    assert ours.usage.prompt_tokens == own.prompt_tokens


def test_the_image_decides_and_an_image_sent_again_is_not_encoded_again(vlm: Vlm) -> None:
    def vision_cache() -> tuple[float, float]:
        base = vlm.server.base_url
        return (
            sample(base, "mlxcel_vision_cache_hits_total") or 0.0,
            sample(base, "mlxcel_vision_cache_misses_total") or 0.0,
        )

    def answer(*parts: dict[str, Any]) -> tuple[str, list[float]]:
        # The tiny models' answers barely depend on the picture: the log-probabilities do.
        choice = vlm.ask(*parts, max_tokens=4, logprobs=True).choices[0]
        return choice.message.content, [t.logprob for t in choice.logprobs.content]

    hits, misses = vision_cache()
    first = answer(image_part(noise(10)), TEXT)
    assert vision_cache() == (hits, misses + 1)
    again = answer(image_part(noise(10)), TEXT)
    assert vision_cache() == (hits + 1, misses + 1)
    assert again == first
    other = answer(image_part(noise(11)), TEXT)
    assert other[1][0] != pytest.approx(first[1][0], abs=1e-5)
    text_only = answer(TEXT)
    assert text_only[1][0] != pytest.approx(first[1][0], abs=1e-5)


def test_images_count_in_usage(vlm: Vlm) -> None:
    one = vlm.ask(image_part(noise(4)), TEXT, max_tokens=1).usage.prompt_tokens
    two = vlm.ask(image_part(noise(4)), image_part(noise(5)), TEXT, max_tokens=1)
    text = vlm.ask(TEXT, max_tokens=1).usage.prompt_tokens
    # Each image adds its tokens (the same number at the same size).
    assert text < one
    assert two.usage.prompt_tokens - one == one - text


def test_a_text_stream_keeps_streaming_beside_image_requests(vlm: Vlm) -> None:
    arrivals: list[float] = []

    def stream() -> None:
        chunks = vlm.client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=120,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())

    reader = threading.Thread(target=stream)
    reader.start()
    while not arrivals:
        time.sleep(0.01)
    start = time.monotonic()
    for seed in range(3):
        vlm.ask(image_part(noise(20 + seed)), TEXT, max_tokens=4)
    end = time.monotonic()
    reader.join(timeout=120)
    assert len(arrivals) >= 100
    during = [t for t in arrivals if start <= t <= end]
    assert during, "the text stream stalled while the images were read"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    # Reading an image is one step of the batch, not a pause: no gap is long.
    assert max(gaps) < 2.0


def test_local_files_only_under_media_path(vlm: Vlm) -> None:
    inside = vlm.ask(image_part(f"file://{vlm.media / 'one.png'}"), TEXT, max_tokens=2)
    assert inside.usage.prompt_tokens > vlm.ask(TEXT, max_tokens=1).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as raised:
        vlm.ask(image_part(str(vlm.folder / "config.json")), TEXT)
    assert raised.value.body["param"] == "messages[0].content[0]"  # type: ignore[index]


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}, "image"),
        ({"type": "image_url", "image_url": {"url": ""}}, "url"),
        ({"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}, "scheme"),
        ({"type": "image_url", "image_url": {"url": "x.png", "detail": "max"}}, "detail"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "base64 audio"),
    ],
)
def test_bad_image_parts_are_400_naming_the_part(
    vlm: Vlm, part: dict[str, Any], message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        vlm.ask(TEXT, part)
    error = raised.value.body
    assert message in error["message"]  # type: ignore[index]
    assert error["param"].startswith("messages[0].content[1]")  # type: ignore[index]


def test_more_images_than_max_images_is_a_400(vlm: Vlm) -> None:
    parts = [image_part(noise(s)) for s in range(3)]
    with pytest.raises(openai.BadRequestError) as raised:
        vlm.ask(*parts, TEXT)
    assert "--max-images" in raised.value.body["message"]  # type: ignore[index]
    assert raised.value.body["param"] == "messages[0].content[2]"  # type: ignore[index]


def test_props_and_models_say_vision(vlm: Vlm) -> None:
    props = httpx.get(f"{vlm.server.base_url}/props").json()
    assert props["modalities"] == {"vision": True, "video": False, "audio": False}
    models = httpx.get(f"{vlm.server.base_url}/v1/models").json()
    assert "vision" in models["data"][0]["capabilities"]
    assert "vision" in models["models"][0]["capabilities"]


def test_a_text_model_refuses_images_before_reading_them(tiny_server: ServerProcess) -> None:
    # An http URL that would hang: the guard answers before anything is fetched.
    body = {
        "messages": [
            {"role": "user", "content": [image_part("http://10.255.255.1/never.png"), TEXT]}
        ],
        "max_tokens": 1,
    }
    tic = time.monotonic()
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "image input is not supported"
    assert time.monotonic() - tic < 2
    props = httpx.get(f"{tiny_server.base_url}/props").json()
    assert props["modalities"]["vision"] is False


def test_anthropic_image_blocks_read_as_chat_parts(vlm: Vlm) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=vlm.server.base_url, api_key="unused", max_retries=0)
    image = noise(30)
    data = base64.b64encode(png(image)).decode()
    blocks: list[Any] = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": QUESTION},
    ]
    message = client.messages.create(
        model="any",
        max_tokens=6,
        messages=[{"role": "user", "content": blocks}],
        extra_body={"temperature": 0},
    )
    chat = vlm.ask(image_part(image), TEXT)
    assert message.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    # A url source: here a file under --media-path.
    by_url = client.messages.create(
        model="any",
        max_tokens=1,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "url", "url": str(vlm.media / "one.png")}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
    )
    assert by_url.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(
            model="any",
            max_tokens=1,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "@@"},
                        },
                    ],
                }
            ],
        )
    assert "messages[0].content[0]" in str(raised.value)


def test_responses_input_image_and_a_chained_turn(vlm: Vlm) -> None:
    image = noise(40)
    uri = image_part(image)["image_url"]["url"]
    first = vlm.client.responses.create(
        model="any",
        temperature=0,
        max_output_tokens=6,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": uri, "detail": "auto"},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
    )
    chat = vlm.ask(image_part(image), TEXT)
    assert first.output_text == chat.choices[0].message.content
    assert first.usage is not None and first.usage.input_tokens == chat.usage.prompt_tokens
    # The next turn carries the image along (previous_response_id): it is read again, from
    # the vision cache.
    hits = sample(vlm.server.base_url, "mlxcel_vision_cache_hits_total") or 0.0
    second = vlm.client.responses.create(
        model="any",
        max_output_tokens=2,
        previous_response_id=first.id,
        input="And the colours?",
    )
    assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens
    assert (sample(vlm.server.base_url, "mlxcel_vision_cache_hits_total") or 0.0) == hits + 1


def test_native_completion_multimodal_data(vlm: Vlm) -> None:
    """llama-server's ``{prompt_string, multimodal_data}``: each ``<__media__>`` marker is one
    base64 image; the answer is the chat route's for the same rendered prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vlm.folder))
    parts = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    marker = (
        "<|vision_start|><|image_pad|><|vision_end|>" if vlm.family == "qwen2_vl" else "<image>"
    )
    assert rendered.count(marker) == 1
    image = noise(50)
    data = base64.b64encode(png(image)).decode()
    prompt = {"prompt_string": rendered.replace(marker, "<__media__>"), "multimodal_data": [data]}
    url = f"{vlm.server.base_url}/completion"
    r = httpx.post(url, json={"prompt": prompt, "n_predict": 6, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    chat = vlm.ask(image_part(image), TEXT)
    assert r.json()["content"] == chat.choices[0].message.content
    assert r.json()["tokens_evaluated"] == chat.usage.prompt_tokens
    two = {**prompt, "multimodal_data": [data, data]}
    bad = httpx.post(url, json={"prompt": two, "n_predict": 1}, timeout=60)
    assert bad.status_code == 400
    assert "markers" in bad.json()["error"]["message"]
    # A WAV file where the image was: this model has no audio tower.
    heard = {**prompt, "multimodal_data": [base64.b64encode(noise_wav(1)).decode()]}
    bad = httpx.post(url, json={"prompt": heard, "n_predict": 1}, timeout=60)
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == (
        "prompt.multimodal_data[0]: audio input is not supported"
    )


@pytest.fixture(scope="module")
def prefix_vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vlm]:
    # Qwen2-VL: its M-RoPE positions must survive the trip through the prompt cache.
    folder = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen2_vl", "qwen2_vl")
    server = ServerProcess(
        ["-m", str(folder), "-np", "2", "--metrics", "--enable-vlm-prefix-cache"]
    )
    yield Vlm("qwen2_vl", folder, folder, server)
    server.stop()


def test_the_next_turn_about_an_image_reads_only_its_new_text(prefix_vlm: Vlm) -> None:
    vlm = prefix_vlm
    image = image_part(noise(60))
    first = vlm.ask(image, TEXT, max_tokens=5)
    turns: list[Any] = [
        {"role": "user", "content": [image, TEXT]},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the colours?"},
    ]
    hits = sample(vlm.server.base_url, "mlxcel_prompt_cache_hits_total") or 0.0

    def second(**extra: Any) -> tuple[str, list[float], Any]:
        r = vlm.client.chat.completions.create(
            model="any",
            messages=turns,
            temperature=0,
            max_tokens=4,
            logprobs=True,
            extra_body=extra,
        )
        choice = r.choices[0]
        return choice.message.content, [t.logprob for t in choice.logprobs.content], r.usage

    cached_text, cached_lp, usage = second()
    assert (sample(vlm.server.base_url, "mlxcel_prompt_cache_hits_total") or 0.0) == hits + 1
    assert usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
    # Read whole (no cache): the same answer, so the cached prefix is the same state.
    whole_text, whole_lp, _ = second(cache_prompt=False)
    assert cached_text == whole_text
    assert cached_lp == pytest.approx(whole_lp, abs=1e-4)
    # Another image with the same text is not served from this image's entry.
    turns[0] = {"role": "user", "content": [image_part(noise(61)), TEXT]}
    hits = sample(vlm.server.base_url, "mlxcel_prompt_cache_hits_total") or 0.0
    second()
    assert (sample(vlm.server.base_url, "mlxcel_prompt_cache_hits_total") or 0.0) == hits


def test_streamed_and_n_choices_with_an_image(vlm: Vlm) -> None:
    image = image_part(noise(70))
    whole = vlm.ask(image, TEXT).choices[0].message.content
    chunks = vlm.client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": [image, TEXT]}],
        temperature=0,
        max_tokens=6,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    # n choices share the image's prefill; greedy, each is the lone answer.
    two = vlm.ask(image, TEXT, n=2)
    assert [c.message.content for c in two.choices] == [whole, whole]

"""The tiny VLM checkpoints load and run through mlx-vlm's own API, as a user's folder would.

These are the facts the VLM backend (issue 24) will build on: the folder loads with
``mlx_vlm.load``, the image changes the logits, the prompt carries the number of image
tokens the processor promises, and a batch can be prefilled from merged input
embeddings once and then decoded through the language model alone with mlx-lm's
BatchKVCache, giving each row the tokens it gets on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx_vlm
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache
from PIL import Image

from mlxcel.models.mlx_setup import mx
from tests.support.tiny_vlm import FAMILIES, build_tiny_vlm

# (width, height) -> image tokens in the prompt, from each family's sizing rules:
#   qwen2_vl  sides rounded to multiples of 28 px within 56..112 px, one token per 2x2
#             merged 14-px patch: 64x64 -> 56x56 -> 4; 112x56 -> 8 (2 x 4 merged patches).
#   idefics3  longest edge scaled to 64 px, split into 32-px crops plus one global crop,
#             4 tokens per crop: 64x64 -> 2x2 + 1 = 5 crops -> 20; 64x32 -> 1x2 + 1 -> 12.
#   llava     one 32-px centre crop, one token per 8-px patch: 16 whatever the size.
EXPECTED_IMAGE_TOKENS: dict[str, dict[tuple[int, int], int]] = {
    "qwen2_vl": {(64, 64): 4, (112, 56): 8},
    "idefics3": {(64, 64): 20, (64, 32): 12},
    "llava": {(64, 64): 16, (64, 32): 16},
}

# mlx-vlm's prepare_inputs (behind generate and stream_generate) passes padding=True to
# the processor, and LlavaProcessor hands it on to transformers' image processor, whose
# ImagesKwargs rejects it since transformers 5.4 (upstream mlx-vlm issue 870). Calling the
# processor directly, as the tests' inputs() does, works.
GENERATE_BROKEN = {"llava"}


class TinyVlm:
    """A loaded tiny VLM and the helpers the tests share."""

    def __init__(self, family: str, path: Path) -> None:
        self.family = family
        self.path = path
        self.model, self.processor = mlx_vlm.load(str(path))
        config = self.model.config
        # Qwen2-VL and Idefics3 name it image_token_id, LLaVA image_token_index.
        token_id = getattr(config, "image_token_id", None)
        self.image_token_id = int(config.image_token_index if token_id is None else token_id)

    def prompt(self, text: str = "Describe the image.") -> str:
        return str(
            mlx_vlm.apply_chat_template(self.processor, self.model.config, text, num_images=1)
        )

    def inputs(self, image: Image.Image, prompt: str) -> dict[str, Any]:
        # The processor expands each image marker into the image's tokens and returns
        # mx arrays: input_ids, attention_mask, pixel_values and the family's extras
        # (image_grid_thw, pixel_attention_mask).
        return dict(self.processor(text=[prompt], images=[image]))

    def embed(self, image: Image.Image, prompt: str) -> tuple[mx.array, Any]:
        """Vision encoding + merge: the prompt's ids and mlx-vlm's InputEmbeddingsFeatures."""
        inputs = self.inputs(image, prompt)
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values")}
        features = self.model.get_input_embeddings(
            inputs["input_ids"], inputs["pixel_values"], **extra
        )
        return inputs["input_ids"], features

    def stream(self, image: Image.Image, prompt: str, n: int) -> list[Any]:
        # Greedy (temperature 0); each response carries its token's full log-probabilities.
        responses = mlx_vlm.stream_generate(
            self.model, self.processor, prompt, image=[image], max_tokens=n, temperature=0.0
        )
        return list(responses)[:n]


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def flat_image(width: int, height: int, value: int = 200) -> Image.Image:
    return Image.fromarray(np.full((height, width, 3), value, dtype=np.uint8))


_LOADED: dict[str, TinyVlm] = {}


def _tiny(family: str, tmp_path_factory: pytest.TempPathFactory) -> TinyVlm:
    # Built and loaded once per family for both fixtures below.
    if family not in _LOADED:
        path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / family, family)
        _LOADED[family] = TinyVlm(family, path)
    return _LOADED[family]


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyVlm:
    return _tiny(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f not in GENERATE_BROKEN])
def generating_vlm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> TinyVlm:
    """The families mlx-vlm's generate can drive (the others: GENERATE_BROKEN, pinned below)."""
    return _tiny(request.param, tmp_path_factory)


def test_folder_loads_as_the_family(vlm: TinyVlm) -> None:
    assert vlm.model.config.model_type == vlm.family
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        assert (vlm.path / name).is_file()
    marker = vlm.processor.tokenizer.convert_ids_to_tokens(vlm.image_token_id)
    assert vlm.prompt().count(marker) == 1


def test_generates_text_for_an_image(generating_vlm: TinyVlm) -> None:
    vlm = generating_vlm
    image, prompt = noise_image(64, 64), vlm.prompt()
    first = mlx_vlm.generate(
        vlm.model, vlm.processor, prompt, image=[image], max_tokens=4, temperature=0.0
    )
    again = mlx_vlm.generate(
        vlm.model, vlm.processor, prompt, image=[image], max_tokens=4, temperature=0.0
    )
    assert first.generation_tokens >= 1
    assert first.prompt_tokens == vlm.inputs(image, prompt)["input_ids"].shape[1]
    assert first.text == again.text


def test_generate_cannot_prepare_llava_inputs(tmp_path: Path) -> None:
    # Pins the upstream bug GENERATE_BROKEN works around: when this fails, mlx-vlm (or
    # transformers) fixed it, and the family can join generating_vlm.
    vlm = TinyVlm("llava", build_tiny_vlm(tmp_path / "llava", "llava"))
    with pytest.raises(ValueError, match="unexpected keyword argument 'padding'"):
        mlx_vlm.generate(vlm.model, vlm.processor, vlm.prompt(), image=[noise_image(64, 64)])


def test_the_image_changes_the_logits(vlm: TinyVlm) -> None:
    prompt = vlm.prompt()

    def last_logits(image: Image.Image) -> mx.array:
        ids, features = vlm.embed(image, prompt)
        logits = vlm.model.language_model(ids, inputs_embeds=features.inputs_embeds).logits
        return logits[0, -1]

    noise, flat = last_logits(noise_image(64, 64)), last_logits(flat_image(64, 64))
    assert mx.array_equal(noise, last_logits(noise_image(64, 64))).item()
    assert mx.abs(noise - flat).max().item() > 1e-3


def test_the_image_changes_generate_s_logprobs(generating_vlm: TinyVlm) -> None:
    vlm = generating_vlm
    prompt = vlm.prompt()
    noise = vlm.stream(noise_image(64, 64), prompt, 1)[0].logprobs
    flat = vlm.stream(flat_image(64, 64), prompt, 1)[0].logprobs
    assert mx.array_equal(noise, vlm.stream(noise_image(64, 64), prompt, 1)[0].logprobs).item()
    assert mx.abs(noise - flat).max().item() > 1e-3


@pytest.mark.parametrize("size_index", [0, 1])
def test_prompt_has_the_expected_image_tokens(vlm: TinyVlm, size_index: int) -> None:
    (width, height), expected = list(EXPECTED_IMAGE_TOKENS[vlm.family].items())[size_index]
    inputs = vlm.inputs(noise_image(width, height), vlm.prompt())
    assert int((inputs["input_ids"] == vlm.image_token_id).sum().item()) == expected
    # The same number, as each processor states it.
    if vlm.family == "qwen2_vl":
        merge = vlm.processor.image_processor.merge_size
        assert int(inputs["image_grid_thw"].prod().item()) // merge**2 == expected
        assert mlx_vlm.utils.estimate_num_image_tokens(vlm.processor, height, width) == expected
    elif vlm.family == "idefics3":
        crops = inputs["pixel_values"].shape[1]
        assert crops * vlm.processor.image_seq_len == expected
    # And the vision tower fills every one of them: the merge checks the counts match.
    _, features = vlm.embed(noise_image(width, height), vlm.prompt())
    assert features.inputs_embeds.shape[:2] == inputs["input_ids"].shape


def _left_pad(rows: list[mx.array], pads: list[int], axis: int, value: int = 0) -> mx.array:
    def pad(row: mx.array, n: int) -> mx.array:
        widths = [(0, 0)] * row.ndim
        widths[axis] = (n, 0)
        return mx.pad(row, widths, constant_values=value)

    # Rows stack on the axis before the padded one: 0 for ids and embeddings, 1 for
    # M-RoPE position ids, shaped (3, batch, length).
    return mx.concatenate([pad(r, n) for r, n in zip(rows, pads, strict=True)], axis=axis - 1)


def _decode_batch(
    vlm: TinyVlm, requests: list[tuple[Image.Image, str]], steps: int, chunk: int | None = None
) -> list[list[int]]:
    """Vision + merge once per request, a left-padded prefill of the merged embeddings (in
    ``chunk``-column pieces when given, as the model runner reads prompts), then greedy
    decode steps through ``model.language_model`` alone on mlx-lm's BatchKVCache."""
    embedded = [vlm.embed(image, prompt) for image, prompt in requests]
    ids = [row_ids for row_ids, _ in embedded]
    features = [f for _, f in embedded]
    longest = max(row.shape[1] for row in ids)
    pads = [longest - row.shape[1] for row in ids]

    language_model = vlm.model.language_model
    cache = [BatchKVCache(pads) for _ in language_model.layers]
    prefill: dict[str, mx.array] = {}
    decode: dict[str, mx.array] = {}
    if features[0].position_ids is not None:
        # M-RoPE (qwen2_vl): prefill positions come from the merge (image patches take 2-D
        # positions); each decode step continues at the row's offset + its rope delta.
        prefill["position_ids"] = _left_pad([f.position_ids for f in features], pads, 2, 1)
        decode["rope_deltas"] = mx.concatenate([f.rope_deltas for f in features])

    batch_ids = _left_pad(ids, pads, 1)
    batch_embeds = _left_pad([f.inputs_embeds for f in features], pads, 1)
    step = chunk or longest
    for start in range(0, longest, step):
        # Every prompt-aligned input is cut to the chunk: with a batch cache the language
        # model takes position_ids as given (it slices them itself only for one row).
        logits = language_model(
            batch_ids[:, start : start + step],
            inputs_embeds=batch_embeds[:, start : start + step],
            cache=cache,
            **{k: v[..., start : start + step] for k, v in prefill.items()},
        ).logits
    tokens = mx.argmax(logits[:, -1], axis=-1)
    got: list[list[int]] = [[t] for t in tokens.tolist()]
    for _ in range(steps - 1):
        logits = language_model(tokens[:, None], cache=cache, **decode).logits
        tokens = mx.argmax(logits[:, -1], axis=-1)
        for row, token in zip(got, tokens.tolist(), strict=True):
            row.append(token)
    return got


def test_batched_decode_through_the_language_model(vlm: TinyVlm) -> None:
    steps = 5
    requests = [
        (noise_image(64, 64, seed=1), vlm.prompt("Describe the image.")),
        (noise_image(64, 32, seed=2), vlm.prompt("What is in this picture, in detail?")),
    ]
    alone = [_decode_batch(vlm, [request], steps)[0] for request in requests]
    assert _decode_batch(vlm, requests, steps) == alone
    # Chunked prefill, 7 columns at a time: boundaries fall anywhere, image tokens included.
    assert _decode_batch(vlm, requests, steps, chunk=7) == alone
    if vlm.family not in GENERATE_BROKEN:
        # And alone is what mlx-vlm's own greedy generation gives.
        expected = [[r.token for r in vlm.stream(image, p, steps)] for image, p in requests]
        assert alone == expected


def test_which_families_decode_side_by_side(vlm: TinyVlm) -> None:
    from types import SimpleNamespace

    from mlxcel.models.vlm import Vision

    # Plain RoPE (Idefics3, LLaVA) and M-RoPE given per-row positions (Qwen2-VL) batch.
    assert Vision(model=vlm.model, media=None, family=vlm.family).batchable
    # A language model holding one prompt's rope offsets, in a family not handled: one at a time.
    stateful = SimpleNamespace(language_model=SimpleNamespace(_rope_deltas=None))
    assert not Vision(model=stateful, media=None, family="glm4v").batchable

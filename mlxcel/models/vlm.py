"""Vision-language checkpoints, through mlx-vlm (issue 24).

A VLM is served by the same continuous-batching engine as a text model. What differs is only
how an image request's prompt is read:

- off the compute thread (the tokenizer actor), mlx-vlm's processor turns the rendered prompt
  and the decoded images (and audio, on a checkpoint with an audio tower: Gemma 3n / 4) into
  token ids (each image or audio marker expanded into its tokens) and pixel / log-mel feature
  arrays (``prepare``: numpy only, so nothing mlx crosses threads);
- on the model runner's thread, the vision (and audio) tower encodes the pixels (and audio
  features), the projector merges them into the prompt's embeddings, and the language model
  reads all of the prompt but its last token into a fresh KV cache (``prefill``: one call,
  which is the one step the other rows wait);
- the row then joins the batch like a prompt-cache hit: the batch reads its last token and it
  decodes through the language model alone (``LanguageModel``), as a text row does.

Qwen2-VL-style models place tokens with M-RoPE: an image's tokens share positions, so the
text after an image sits at "index + delta" (mlx-vlm's ``rope_deltas``, negative). A decoding
row's position is its batch cache's ``offset`` (mlx-lm's batch cache uses ``offset`` for
nothing else), so the row's cache carries ``delta`` in its offset from the moment it joins
(``POSITION_SHIFT``, read by ``mlx_lm_compat``'s batch-cache merge), and ``LanguageModel``
hands the language model explicit position ids built from the offsets.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from mlxcel.models import mlx_lm_compat
from mlxcel.models.mlx_setup import mx

log = logging.getLogger(__name__)

# The attribute on a row's layer caches that says how far its positions are from its length
# (mlx_lm_compat's batch-cache merge reads it).
POSITION_SHIFT = mlx_lm_compat.POSITION_SHIFT
# Families whose language model places tokens with M-RoPE (three position streams), given
# explicit per-row positions here (qwen2_vl is tested; qwen2_5_vl's language model is the
# same code shape, not run here).
MROPE_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})
# Processor outputs with one value per prompt token (Gemma 4's: which tokens are image, video
# or audio), cut with the prompt the prefill reads.
TOKEN_ALIGNED = frozenset({"mm_token_type_ids", "token_type_ids"})


def is_vlm(path: Path) -> bool:
    """A checkpoint folder whose config describes a vision tower mlx-vlm knows."""
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


@attrs.frozen(kw_only=True)
class PreparedMedia:
    """What the processor made of a prompt and its images and audio (numpy; read on another
    thread)."""

    tokens: tuple[int, ...]
    # None: the prompt has audio but no image.
    pixel_values: np.ndarray | None
    # The family's extras (image_grid_thw, pixel_attention_mask, input_features, ...), as
    # numpy arrays; those with one value per token (TOKEN_ALIGNED) are cut to all but the
    # last token (what the prefill reads).
    extras: tuple[tuple[str, np.ndarray], ...] = ()
    # Where the last image or audio token is in ``tokens`` (-1: none).
    last_media_token: int = -1
    # A digest of the pixels and audio features (and the family's grids): the media's
    # identity, for caching.
    digest: str = ""


class MediaProcessor:
    """The checkpoint's processor, for the tokenizer actor's thread: thread-safe (it only
    reads its configuration), holds no mlx state.

    ``audio_token_id`` is set when the checkpoint hears audio itself (an audio tower and a
    feature extractor: Gemma 3n / 4); a text-only or image-only checkpoint hears audio
    through speech-to-text (http/heard.py)."""

    def __init__(
        self, processor: Any, image_token_id: int, audio_token_id: int | None = None
    ) -> None:
        self._processor = processor
        self.image_token_id = image_token_id
        self.audio_token_id = audio_token_id
        self.image_marker = _image_marker(processor)
        # The processor's own audio marker: what the template writes for an audio part.
        self.audio_marker = str(getattr(processor, "audio_token", "")) if audio_token_id else ""
        # The waveforms' sampling rate the feature extractor expects.
        extractor = getattr(processor, "feature_extractor", None)
        self.sampling_rate = int(getattr(extractor, "sampling_rate", 16000))
        # The longest audio part the model's audio tokens cover (Gemma 4: 750 tokens of 40 ms);
        # longer audio would be cut by the processor without a word, so it is refused.
        tokens = getattr(processor, "audio_seq_length", None)
        ms = getattr(processor, "audio_ms_per_token", None)
        self.max_audio_seconds = float(tokens * ms / 1000) if tokens and ms else 30.0

    @property
    def hears(self) -> bool:
        return self.audio_token_id is not None

    def prepare(self, prompt: str, images: list[Any], audio: Sequence[Any] = ()) -> PreparedMedia:
        """``audio``: waveforms at ``sampling_rate`` (float32 numpy), one per marker."""
        out = self._processor(
            text=[prompt],
            images=list(images) or None,
            return_tensors="np",
            **({"audio": list(audio)} if audio else {}),
        )
        arrays = {k: np.asarray(v) for k, v in out.items()}
        ids = arrays.pop("input_ids")[0].astype(np.int64)
        arrays.pop("attention_mask", None)
        pixels = arrays.pop("pixel_values", None)
        if pixels is not None and not images:
            pixels = None  # a processor's empty placeholder
        extras = tuple(
            (name, array[:, :-1] if name in TOKEN_ALIGNED else array)
            for name, array in sorted(arrays.items())
        )
        digest = hashlib.sha256()
        for name, array in (("pixel_values", pixels), *arrays.items()):
            if array is None:
                continue
            digest.update(f"{name}{array.dtype}{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        media_ids = [self.image_token_id]
        if self.audio_token_id is not None:
            media_ids.append(self.audio_token_id)
        where = np.flatnonzero(np.isin(ids, media_ids))
        return PreparedMedia(
            tokens=tuple(int(t) for t in ids),
            pixel_values=pixels,
            extras=extras,
            last_media_token=int(where[-1]) if where.size else -1,
            digest=digest.hexdigest(),
        )


def _image_marker(processor: Any) -> str:
    """What the chat template writes for one image (what a raw prompt's ``<__media__>``
    becomes): the text between two text parts around an image part; the processor's own
    image token when the template cannot say."""
    before, after = "\u2063A\u2063", "\u2063B\u2063"
    parts = [
        {"type": "text", "text": before},
        {"type": "image"},
        {"type": "text", "text": after},
    ]
    try:
        text = processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": parts}], tokenize=False
        )
        start = text.index(before) + len(before)
        marker = str(text[start : text.index(after, start)])
        if marker.strip():
            return marker
    except Exception:  # noqa: BLE001  # a template without parts: fall back below
        pass
    return str(getattr(processor, "image_token", "<image>"))


class LanguageModel:
    """The VLM's language model as mlx-lm's generator calls a model: ``model(inputs,
    cache=...)`` returning logits, ``layers`` for its caches. M-RoPE families get explicit
    position ids from each row's cache offset (see the module's docstring)."""

    def __init__(self, language_model: Any, mrope: bool) -> None:
        self._lm = language_model
        self._mrope = mrope
        self.layers = language_model.layers
        if hasattr(language_model, "make_cache"):
            self.make_cache = language_model.make_cache

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if self._mrope and cache and cache[0] is not None:
            batch, length = inputs.shape
            offset = cache[0].offset
            start = offset[:, None] if isinstance(offset, mx.array) else mx.array([[offset]])
            positions = mx.broadcast_to(start + mx.arange(length)[None, :], (batch, length))
            kwargs["position_ids"] = mx.broadcast_to(positions[None], (3, batch, length))
        logits: mx.array = self._lm(inputs, cache=cache, **kwargs).logits
        return logits

    def parameters(self) -> Any:
        return self._lm.parameters()


@attrs.frozen(kw_only=True)
class Vision:
    """The whole mlx-vlm model (vision tower, projector, language model) and its processor."""

    model: Any
    media: MediaProcessor
    family: str

    @property
    def mrope(self) -> bool:
        return self.family in MROPE_FAMILIES

    @property
    def batchable(self) -> bool:
        """Whether rows of this family may decode side by side. A language model that keeps
        the last prompt's rope offsets on itself (``_rope_deltas``: GLM-4V, Qwen3-VL, MiniCPM-V,
        ...) places every row of a batch by one prompt's images, unless its positions are
        given per row as here for ``MROPE_FAMILIES``; such a family is served one request at
        a time. Families with plain RoPE (positions from each row's cache offset, as
        Idefics3 / SmolVLM, LLaVA, Gemma 3) batch."""
        return self.mrope or not hasattr(self.model.language_model, "_rope_deltas")

    def prefill(self, prepared: PreparedMedia) -> list[Any]:
        """All of the prompt but its last token read into a fresh KV cache (one per layer),
        the images (and audio) encoded and merged on the way. Model runner's thread."""
        from mlx_lm.models.cache import make_prompt_cache

        lm = self.model.language_model
        cache = make_prompt_cache(LanguageModel(lm, self.mrope))  # type: ignore[arg-type]  # duck-typed model
        ids = mx.array([list(prepared.tokens[:-1])])
        extras = {k: mx.array(v) for k, v in prepared.extras}
        pixels = prepared.pixel_values
        self.model(ids, mx.array(pixels) if pixels is not None else None, cache=cache, **extras)
        mx.eval([c.state for c in cache])
        if self.mrope:
            deltas = getattr(lm, "_rope_deltas", None)
            shift = int(np.asarray(deltas).reshape(-1)[0]) if deltas is not None else 0
            # The model keeps the last prompt's positions for itself: our rows carry theirs.
            lm._rope_deltas = None
            lm._position_ids = None
            for c in cache:
                setattr(c, POSITION_SHIFT, shift)
        return list(cache)


def load_vlm(path: Path) -> tuple[Vision, Any, dict[str, Any]]:
    """Load a VLM folder with mlx-vlm: the parts, the transformers tokenizer, the config."""
    from mlx_vlm.utils import load

    model, processor = load(str(path))
    config = json.loads((path / "config.json").read_text())
    family = str(config.get("model_type", ""))
    token_id = getattr(model.config, "image_token_id", None)
    if token_id is None:
        token_id = getattr(model.config, "image_token_index", None)
    if token_id is None:
        raise ValueError(f"{path}: the config names no image token")
    media = MediaProcessor(processor, int(token_id), _audio_token(model, processor))
    return Vision(model=model, media=media, family=family), processor.tokenizer, config


def _audio_token(model: Any, processor: Any) -> int | None:
    """The audio token of a checkpoint that hears audio itself: an audio tower, a feature
    extractor to make its input, and a marker for the template (None: it does not)."""
    token_id = getattr(model.config, "audio_token_id", None)
    heard = (
        getattr(model, "audio_tower", None) is not None
        and getattr(processor, "feature_extractor", None) is not None
        and bool(getattr(processor, "audio_token", ""))
    )
    return int(token_id) if heard and token_id is not None else None

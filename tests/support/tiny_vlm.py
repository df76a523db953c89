"""Tiny random-weight vision-language models (mlx-vlm families), for fast tests.

No VLM weights can be downloaded here, so the tests build checkpoint folders the
way a user's would look: config.json, model.safetensors, preprocessor_config.json
(and processor_config.json where the family reads one), a chat template and
tokenizer files. The tokenizer is SmolLM2's real one (borrowed from the packaged
model, as in tiny_model.py) plus the family's image special tokens.

The model itself is built from mlx-vlm's own classes, so parameter names and
shapes are exactly what ``mlx_vlm.load`` expects (it loads strictly: a wrong name
or shape fails loudly). Weights are numpy-seeded, so a seed gives the same
folder on every machine.

Families:
    qwen2_vl   Qwen2-VL: ViT on 14-pixel patches with 2x2 merge, M-RoPE in the
               language model; image tokens = grid_h * grid_w / 4 per image.
    idefics3   Idefics3 / SmolVLM: SigLIP ViT, pixel-shuffle connector, optional
               image splitting; image tokens = image_seq_len per crop.
    llava      LLaVA-1.5: CLIP ViT on a fixed square crop, MLP projector; image
               tokens = patches per crop, whatever the image's size.
    gemma4     Gemma 4 (the E2B/E4B shape): ViT with pooled patches for images and a
               Conformer audio tower (USM log-mel features, one token per 40 ms) for
               audio; image tokens = pooled patches, audio tokens = ceil(ms / 40).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.models.mlx_setup import mx
from mlxcel.models.resolve import resolve_model

# The image families the unit tests drive through mlx-vlm's decode recipe (test_tiny_vlm).
FAMILIES = ("qwen2_vl", "idefics3", "llava")
# Families that also hear audio (their language model takes per-layer inputs that recipe
# does not build): served and tested end to end (test_heard_audio).
AUDIO_FAMILIES = ("gemma4",)

# Qwen2-VL's own markers: an image is <|vision_start|><|image_pad|><|vision_end|>, and the
# processor repeats <|image_pad|> once per merged patch.
_QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# SmolLM2 speaks ChatML, as Qwen2-VL does, so its own markers serve as they are.
_QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Idefics3's markers: each crop is <fake_token_around_image><row_r_col_c> followed by
# image_seq_len <image> tokens, and the whole image ends with a <global-img> crop.
_IDEFICS_ROWS = 4
_IDEFICS_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(
        f"<row_{r}_col_{c}>"
        for r in range(1, _IDEFICS_ROWS + 1)
        for c in range(1, _IDEFICS_ROWS + 1)
    ),
)
# SmolVLM's turn format ("User:", "Assistant:", <end_of_utterance>); the processor expands
# each <image> into the crops' tokens.
_IDEFICS_TEMPLATE = (
    "<|im_start|>"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}"
    "{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# LLaVA-1.5's turn format; the processor repeats <image> once per vision patch.
_LLAVA_TOKENS = ("<image>",)
_LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | upper + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ ' ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Gemma 4's markers (its tokenizer names them image_token, boi_token, ... so the processor
# finds them): the template writes one <|image|> / <|audio|> per part and the processor
# expands it to <|image>{n x <|image|>}<image|> (and the audio alike).
_GEMMA4_MARKERS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "video_token": "<|video|>",
}
_GEMMA4_TOKENS = tuple(_GEMMA4_MARKERS.values())
_GEMMA4_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'audio' %}{{ '<|audio|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TEXT: dict[str, Any] = {
    # Every family's language model: 2 layers, hidden 64, 4 heads / 2 KV heads.
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 2048,
    # Untied on purpose (see tiny_model.py): random tied weights make greedy decoding
    # repeat the input token.
    "tie_word_embeddings": False,
}


# What a family's folder holds beyond the weights: config.json and the processor files.
_Files = tuple[dict[str, Any], dict[str, dict[str, Any]]]


def _vocab_size(tokenizer: Any) -> int:
    # The embedding must cover the added tokens; a multiple of 64 as real checkpoints pad.
    return -(-len(tokenizer) // 64) * 64


def _qwen2_vl_files(tokenizer: Any) -> _Files:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_TOKENS}
    vocab = _vocab_size(tokenizer)
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        **_TEXT,
        "vocab_size": vocab,
        # M-RoPE splits each head's 8 rotary frequencies into (time, height, width).
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": 32,
            "num_heads": 2,
            # The merger projects into the language model's width.
            "hidden_size": _TEXT["hidden_size"],
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        "torch_dtype": "float32",
    }
    # Small pixel budget: images are resized to multiples of 28 px between 56x56 and
    # 112x112, i.e. 1 to 16 image tokens, so a forward pass stays cheap.
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 56 * 56,
        "max_pixels": 112 * 112,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }
    return config, {"preprocessor_config.json": image}


def _idefics3_files(tokenizer: Any) -> _Files:
    vocab = _vocab_size(tokenizer)
    crop = 32  # pixels per crop side: 4x4 patches of 8 px, pixel-shuffled 2x2 -> 4 tokens
    patch, scale = 8, 2
    image_seq_len = (crop // patch) ** 2 // scale**2
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
        "scale_factor": scale,
        "vocab_size": vocab,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "text_config": {"model_type": "llama", **_TEXT, "vocab_size": vocab},
        "vision_config": {
            "model_type": "idefics3_vision",
            "hidden_size": 32,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "intermediate_size": 64,
            "patch_size": patch,
            "image_size": crop,
            "num_channels": 3,
        },
        "torch_dtype": "float32",
    }
    image = {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        # Images are scaled so the longest edge is 2 crops, then split into up to 2x2
        # crops plus one global crop, as SmolVLM does at 4x364 / 364 px.
        "do_resize": True,
        "size": {"longest_edge": 2 * crop},
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": crop},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
        "do_convert_rgb": True,
        "resample": 1,
    }
    processor = {"image_seq_len": image_seq_len, "processor_class": "Idefics3Processor"}
    return config, {"preprocessor_config.json": image, "processor_config.json": processor}


def _llava_files(tokenizer: Any) -> _Files:
    vocab = _vocab_size(tokenizer)
    crop, patch = 32, 8  # 4x4 patches of 8 px -> 16 image tokens (the CLS token is dropped)
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": vocab,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "text_config": {"model_type": "llama", **_TEXT, "vocab_size": vocab},
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "image_size": crop,
            "patch_size": patch,
            "projection_dim": 32,
            "num_channels": 3,
        },
        "torch_dtype": "float32",
    }
    # CLIP's preprocessing: shortest edge to the crop size, then a centre crop.
    image = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": crop},
        "do_center_crop": True,
        "crop_size": {"height": crop, "width": crop},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
        "resample": 3,
    }
    # The processor counts patches + the CLS token, less the CLS token the "default"
    # strategy drops: (32 / 8)^2 = 16.
    processor = {
        "patch_size": patch,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
        "processor_class": "LlavaProcessor",
    }
    return config, {"preprocessor_config.json": image, "processor_config.json": processor}


def _gemma4_files(tokenizer: Any) -> _Files:
    vocab = _vocab_size(tokenizer)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in _GEMMA4_MARKERS.items()}
    patch, pool, soft = 8, 2, 16  # up to 16 pooled tokens: images of at most 64x64 px
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "vocab_size": vocab,
        "image_token_id": ids["image_token"],
        "boi_token_id": ids["boi_token"],
        "eoi_token_id": ids["eoi_token"],
        "audio_token_id": ids["audio_token"],
        "boa_token_id": ids["boa_token"],
        "eoa_token_id": ids["eoa_token"],
        "video_token_id": ids["video_token"],
        "vision_soft_tokens_per_image": soft,
        "audio_ms_per_token": 40,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "global_head_dim": 16,
            # As E2B / E4B: the last layers read the KV of earlier ones (fewer caches than
            # layers), and every layer takes a per-layer input embedding.
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 8,
            "vocab_size": vocab,
            "vocab_size_per_layer_input": vocab,
            "sliding_window": 512,
            # Local and global layers alternate, as in the real ones.
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "use_double_wide_mlp": False,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "global_head_dim": 16,
            "patch_size": patch,
            "pooling_kernel_size": pool,
            "default_output_length": soft,
            "position_embedding_size": 64,
        },
        "audio_config": {
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "subsampling_conv_channels": [8, 4],
            "output_proj_dims": 32,
        },
        "torch_dtype": "float32",
    }
    processor = {
        "processor_class": "Gemma4Processor",
        "audio_seq_length": 750,
        "audio_ms_per_token": 40,
        "image_processor": {
            "image_processor_type": "Gemma4ImageProcessor",
            "patch_size": patch,
            "max_soft_tokens": soft,
            "pooling_kernel_size": pool,
        },
        "feature_extractor": {"feature_extractor_type": "Gemma4AudioFeatureExtractor"},
    }
    return config, {"processor_config.json": processor}


@dataclass(frozen=True)
class _Family:
    tokens: tuple[str, ...]  # special tokens added to SmolLM2's tokenizer
    chat_template: str
    files: Callable[[Any], _Files]  # (tokenizer) -> (config, {file name: JSON content})
    # Special tokens the tokenizer names (tokenizer.image_token, ...), for processors that
    # look them up by name.
    named: dict[str, str] | None = None


_FAMILY_SPECS: dict[str, _Family] = {
    "qwen2_vl": _Family(_QWEN_TOKENS, _QWEN_TEMPLATE, _qwen2_vl_files),
    "idefics3": _Family(_IDEFICS_TOKENS, _IDEFICS_TEMPLATE, _idefics3_files),
    "llava": _Family(_LLAVA_TOKENS, _LLAVA_TEMPLATE, _llava_files),
    "gemma4": _Family(_GEMMA4_TOKENS, _GEMMA4_TEMPLATE, _gemma4_files, _GEMMA4_MARKERS),
}


def _build_model(config: dict[str, Any]) -> Any:
    """An mlx-vlm model object for ``config``, built as ``mlx_vlm.load`` builds one."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    # from_dict rewrites the dict it is given (qwen2_vl copies root keys into text_config).
    config = copy.deepcopy(config)
    module, _ = get_model_and_args(config)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = module.ModelConfig.from_dict(config)
    parts = ["text", "vision", *(["audio"] if "audio_config" in config else [])]
    model_config = update_module_configs(model_config, module, config, parts)
    return module.Model(model_config)


def _random_weights(model: Any, seed: int) -> dict[str, mx.array]:
    import mlx.nn as nn
    import numpy as np
    from mlx.utils import tree_flatten

    # Norms start as identity (weight 1, bias 0) so activations keep a sane scale through
    # random layers; every other tensor is N(0, 0.02), the usual init.
    norm_types = (nn.LayerNorm, nn.RMSNorm)
    norms = {name for name, module in model.named_modules() if isinstance(module, norm_types)}
    rng = np.random.default_rng(seed)
    weights: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.parameters()):
        owner, _, leaf = name.rpartition(".")
        if owner in norms:
            fill = 1.0 if leaf == "weight" else 0.0
            array = np.full(value.shape, fill, dtype=np.float32)
        else:
            array = (rng.standard_normal(value.shape) * 0.02).astype(np.float32)
        weights[name] = mx.array(array)
    return weights


def build_tiny_vlm(
    dest: Path, family: str, seed: int = 0, *, cache_dir: Path | None = None
) -> Path:
    """Write a tiny ``family`` VLM checkpoint folder into ``dest`` (created); return it.

    ``family`` is one of FAMILIES or AUDIO_FAMILIES. The folder loads with
    ``mlx_vlm.load(str(dest))``. The tokenizer files come from the cached conversion of the
    packaged SmolLM2 GGUF (``cache_dir`` defaults to ``$MLXCEL_CACHE_DIR``).
    """
    from transformers import AutoTokenizer

    if family not in _FAMILY_SPECS:
        known = ", ".join((*FAMILIES, *AUDIO_FAMILIES))
        raise ValueError(f"unknown tiny VLM family {family!r}; known: {known}")
    spec = _FAMILY_SPECS[family]
    dest.mkdir(parents=True, exist_ok=True)

    source = resolve_model(None, cache_dir).path
    tokenizer = AutoTokenizer.from_pretrained(
        str(source), **({"extra_special_tokens": spec.named} if spec.named else {})
    )
    # Special, so the tokenizer never splits them and decoding can skip them.
    tokenizer.add_tokens(list(spec.tokens), special_tokens=True)
    tokenizer.chat_template = spec.chat_template
    tokenizer.save_pretrained(str(dest))

    config, extra_files = spec.files(tokenizer)
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for name, content in extra_files.items():
        (dest / name).write_text(json.dumps(content, indent=2), encoding="utf-8")
    # The chat template also as a file of its own, where processors look for it first.
    (dest / "chat_template.json").write_text(
        json.dumps({"chat_template": spec.chat_template}, indent=2), encoding="utf-8"
    )
    (dest / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id},
            indent=2,
        ),
        encoding="utf-8",
    )
    model = _build_model(config)
    mx.save_safetensors(
        str(dest / "model.safetensors"), _random_weights(model, seed), metadata={"format": "mlx"}
    )
    return dest

"""Load a resolved model folder with mlx_lm, ready for serving on mlx's default device.

Quantised and float16 kernels run at 1-5 GFLOP/s on CPU against ~170 for
float32 matmuls on OpenBLAS, so on the CPU everything is made float32 at load
time: quantised layers are dequantised (with float32 scales, so no float16
rounding) and half-precision tensors are cast. On a GPU (CUDA, Metal) the
quantised and half-precision kernels are the fast ones, so the weights stay as
stored, as mlx_lm.server keeps them. Nothing runs at import time; call
``load_model`` on the thread that will own the model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import attrs

# Defining modules, not mlx.nn: mlx.nn re-exports by star import, which mypy --strict (no
# implicit re-export) sees through only by the mlx.nn override in pyproject.toml.
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear

from mlxcel.models import (
    device,
    fast_lm,
    gemma2_layers,
    gguf_blocks,
    longrope,
    mlx_lm_compat,
    vlm,
)
from mlxcel.models.errors import UnsupportedModel
from mlxcel.models.mlx_setup import mx
from mlxcel.models.resolve import ResolvedModel
from mlxcel.native import available as _native_available
from mlxcel.native import layers as native_layers

__all__ = [
    "DTYPES",
    "LoadedModel",
    "load_model",
    "model_meta",
    "native_enabled",
    "release_thread_streams",
]

_NATIVE = (native_layers.NativeQuantizedLinear, native_layers.NativeQuantizedEmbedding)

DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
)
_FALLBACK_CONTEXT = 4096


@attrs.frozen
class LoadedModel:
    """A model and tokenizer, plus the facts the server needs about them.

    ``tokenizer`` is the transformers fast tokenizer; ``tokenizer_wrapper`` is
    mlx_lm's wrapper around it (streaming detokenizer, eos set), which mlx_lm's
    generation helpers expect.
    """

    model: Module
    tokenizer: Any
    tokenizer_wrapper: Any
    model_id: str
    path: Path
    eos_token_ids: frozenset[int]
    chat_template: str | None
    context_length: int
    vocab_size: int
    n_params: int
    dtype: str
    quantized: bool
    config: dict[str, Any] = attrs.field(repr=False)
    # Quantised layers running on mlxcel's native CPU kernels (0: none).
    native_layers: int = 0
    # A vision-language checkpoint's vision parts (``models.vlm``); ``model`` is then its
    # language model, wrapped as mlx-lm's generator calls a model.
    vision: Any = None


def load_model(
    resolved: ResolvedModel,
    *,
    dtype: str | None = None,
    keep_quantized: bool = False,
    native: bool = True,
    ctx_size: int = 0,
) -> LoadedModel:
    """Load ``resolved`` with mlx_lm; blocking, evaluates all weights before returning.

    ``dtype`` None is the device's choice: float32 on the CPU, the stored precision on a GPU,
    where quantised weights are kept too (``keep_quantized`` is for the CPU). On the CPU,
    affine 4/8-bit layers run on mlxcel's native kernels (``mlxcel.native``) with their
    weights as stored, when they are built and ``native`` (``MLXCEL_NATIVE=0`` turns them off
    too); other quantised layers are dequantised to float32.

    A converted GGUF's Q4_K and Q6_K matrices run on the native kernels as the file stores them
    (``gguf_blocks``); elsewhere their affine copy is loaded like any other quantised layer.

    ``ctx_size`` is the context per sequence it will serve (0: the model's own); a LongRoPE
    model's factors are chosen for it, as llama.cpp chooses them (``models.longrope``).

    Raises ``IncompatibleMlxLm`` first when the installed mlx-lm is not one we tested."""
    from mlx_lm.utils import load

    mlx_lm_compat.install()
    if vlm.is_vlm(resolved.path):
        return _load_vlm(resolved, dtype)
    cpu = device.on_cpu()
    chosen = dtype is not None
    if dtype is None and cpu:
        dtype = "float32"
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    # lazy=True: convert first, then evaluate once, so the quantised and the
    # float32 copies of a weight never both sit in memory.
    try:
        model, wrapper, config = load(  # type: ignore[misc]  # 3-tuple with return_config
            str(resolved.path), lazy=True, return_config=True
        )
    # mlx_lm's ways of saying "not a model I can load": no safetensors
    # (FileNotFoundError), unknown model_type or bad weights (ValueError).
    except (FileNotFoundError, ValueError) as exc:
        raise UnsupportedModel(
            f"cannot load model {resolved.model_id!r} from {resolved.path}: {exc}"
        ) from exc
    longrope.apply(
        model, config, ctx_size or _context_length(config, mlx_lm_compat.tokenizer_of(wrapper))
    )
    gemma2_layers.install(model, config)
    on_native = 0
    kept: set[str] = set()
    if not keep_quantized and cpu:
        if native and native_enabled():
            # A GGUF's Q4_K and Q6_K matrices as the file stores them (before anything is evaluated:
            # their affine copy is then never read). MLXCEL_KQUANT_BLOCKS=0 keeps the affine
            # copy: up to ~10 % faster decoding (the affine kernels read ready-made scales) for
            # ~0.2x the file's size more memory (docs/performance.md, issue 38).
            if os.environ.get("MLXCEL_KQUANT_BLOCKS", "1") != "0":
                on_native = gguf_blocks.install(model, resolved.path)
            on_native += native_layers.install(model)
            if not chosen:
                # A bfloat16 checkpoint's projections stay bfloat16 (half float32's bytes per
                # token); asking for a dtype gets that dtype everywhere.
                kept = set(native_layers.install_bf16(model))
                on_native += len(kept)
        _dequantize(model)
    if dtype is None:
        dtype = _stored_dtype(model)
    else:
        _cast(model, DTYPES[dtype], keep=kept)
    mx.eval(model.parameters())
    if cpu and native and native_enabled():
        native_layers.install_row_ops(model)  # RMSNorm and RoPE as one graph node each
    # Vectorised softmax / SwiGLU on the CPU, attention as one native node (see fast_lm).
    fast_lm.install(model)

    return _loaded(resolved, model, wrapper, config, dtype, native_layers=on_native)


def _loaded(
    resolved: ResolvedModel,
    model: Any,
    wrapper: Any,
    config: dict[str, Any],
    dtype: str,
    *,
    parameters: Any = None,
    **extra: Any,
) -> LoadedModel:
    """The facts the server needs about a loaded model (``parameters``: the module whose
    weights count, when ``model`` only wraps part of it)."""
    from mlx_lm.utils import get_total_parameters

    tokenizer = mlx_lm_compat.tokenizer_of(wrapper)
    counted = model if parameters is None else parameters
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        tokenizer_wrapper=wrapper,
        model_id=resolved.model_id,
        path=resolved.path,
        eos_token_ids=frozenset(int(i) for i in wrapper.eos_token_ids),
        chat_template=_chat_template(tokenizer),
        context_length=_context_length(config, tokenizer),
        vocab_size=int(_config_value(config, "vocab_size") or len(tokenizer)),
        n_params=int(get_total_parameters(counted)) + _block_weights(counted),
        dtype=dtype,
        quantized=_is_quantized(counted),
        config=config,
        **extra,
    )


def _block_weights(model: Module) -> int:
    """What mlx-lm's parameter count misses for layers held as K-quant blocks (it counts their
    bytes, not their weights)."""
    return sum(
        m.input_dims * m.output_dims - int(m["weight"].size)
        for _, m in model.named_modules()
        if isinstance(m, native_layers.KQUANT_LAYERS)
    )


def _load_vlm(resolved: ResolvedModel, dtype: str | None) -> LoadedModel:
    """A vision-language checkpoint through mlx-vlm: float32 on the CPU (its bfloat16 and
    quantised kernels are the slow ones here), as stored on a GPU."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    try:
        vision, tokenizer, config = vlm.load_vlm(resolved.path)
    except (FileNotFoundError, ValueError) as exc:
        raise UnsupportedModel(
            f"cannot load vision-language model {resolved.model_id!r} from {resolved.path}: {exc}"
        ) from exc
    model = vision.model
    if dtype is None and device.on_cpu():
        dtype = "float32"
    if dtype is None:
        dtype = _stored_dtype(model)
    else:
        _cast(model, DTYPES[dtype])
    mx.eval(model.parameters())
    # As mlx-lm's own loader does: the config's end-of-sequence ids join the tokenizer's.
    configured = _config_value(config, "eos_token_id")
    eos = configured if isinstance(configured, list) else [configured]
    wrapper = TokenizerWrapper(tokenizer, eos_token_ids=[i for i in eos if i is not None])
    language = vlm.LanguageModel(model.language_model, vision.mrope)
    return _loaded(resolved, language, wrapper, config, dtype, parameters=model, vision=vision)


# llama.cpp's vocabulary kinds, by the tokenizers model a transformers tokenizer runs.
_VOCAB_TYPES = {"BPE": 2, "WordPiece": 3, "Unigram": 4}
_FTYPES = {"float32": "MLX F32", "float16": "MLX F16", "bfloat16": "MLX BF16"}


def model_meta(loaded: LoadedModel) -> dict[str, Any]:
    """What llama-server's `/v1/models` says of a model, from the loaded weights and config."""
    from mlx.utils import tree_flatten

    weights = cast(list[tuple[str, mx.array]], tree_flatten(loaded.model.parameters()))
    size = sum(int(w.nbytes) for _, w in weights)
    quant = _config_value(loaded.config, "quantization")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    ftype = f"MLX Q{bits}" if loaded.quantized and bits else _FTYPES.get(loaded.dtype, "MLX")
    try:
        kind = loaded.tokenizer.backend_tokenizer.model.__class__.__name__
    except AttributeError:  # a slow (pure Python) tokenizer: llama.cpp's "none"
        kind = ""
    embd = _config_value(loaded.config, "hidden_size") or _config_value(loaded.config, "d_model")
    return {
        "vocab_type": _VOCAB_TYPES.get(kind, 0),
        "n_vocab": loaded.vocab_size,
        "n_ctx_train": loaded.context_length,
        "n_embd": int(embd) if isinstance(embd, int) else 0,
        "n_params": loaded.n_params,
        "size": size,
        "ftype": ftype,
    }


def _quantized_classes() -> tuple[type[Module], ...]:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return (QuantizedLinear, QuantizedEmbedding, QuantizedSwitchLinear)


def _is_quantized(model: Module) -> bool:
    classes = _quantized_classes()
    modules = model.named_modules()
    return any(isinstance(m, classes) for _, m in modules)


def _dequantize(model: Module) -> None:
    from mlx.utils import tree_unflatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    replaced: list[tuple[str, Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, _quantized_classes()) or isinstance(module, _NATIVE):
            continue
        scales = module["scales"]
        biases = module.get("biases")
        # Affine scales are float16 in GGUF-derived checkpoints; dequantising
        # in float16 would round every weight. Non-affine scales are uint8.
        if mx.issubdtype(scales.dtype, mx.floating):
            scales = scales.astype(mx.float32)
            biases = biases.astype(mx.float32) if biases is not None else None
        weight = mx.dequantize(
            module["weight"], scales, biases, module.group_size, module.bits, mode=module.mode
        )
        has_bias = "bias" in module
        new: Module
        if isinstance(module, QuantizedEmbedding):
            vocab, dims = weight.shape
            new = Embedding(vocab, dims)
        elif isinstance(module, QuantizedSwitchLinear):
            experts, out_dims, in_dims = weight.shape
            new = SwitchLinear(in_dims, out_dims, experts, bias=has_bias)
        else:
            out_dims, in_dims = weight.shape
            new = Linear(in_dims, out_dims, bias=has_bias)
        new.weight = weight
        if has_bias:
            new.bias = module["bias"]
        replaced.append((name, new))
    if replaced:
        model.update_modules(tree_unflatten(replaced))


def native_enabled() -> bool:
    """Whether quantised layers may run on the native kernels here (built, an AVX-512 or AVX2
    CPU, mlx on the CPU, and ``MLXCEL_NATIVE`` not ``0``)."""
    return os.environ.get("MLXCEL_NATIVE", "1") != "0" and _native_available()


def _stored_dtype(model: Module) -> str:
    """The precision most of the weights are in (by size; quantised scales aside)."""
    from mlx.utils import tree_flatten

    sizes: dict[str, int] = {}
    for path, value in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())):
        if path.endswith((".scales", ".biases")) or not mx.issubdtype(value.dtype, mx.floating):
            continue
        name = next((n for n, d in DTYPES.items() if d == value.dtype), "float32")
        sizes[name] = sizes.get(name, 0) + int(value.size)
    return max(sizes, key=sizes.__getitem__) if sizes else "float32"


def _cast(model: Module, dtype: mx.Dtype, keep: set[str] | frozenset[str] = frozenset()) -> None:
    from mlx.utils import tree_map_with_path

    def cast(path: str, value: mx.array) -> mx.array:
        # Quantised layers keep their scales/biases as packed (the kernels
        # accept any float activations), and the native bfloat16 layers their weights
        # (``keep``); everything else follows ``dtype``.
        if path.endswith((".scales", ".biases")) or not mx.issubdtype(value.dtype, mx.floating):
            return value
        if path in keep:
            return value
        return value.astype(dtype)

    params = model.parameters()
    model.update(tree_map_with_path(cast, params))


def _config_value(config: dict[str, Any], key: str) -> Any:
    # Multimodal checkpoints nest the language model's settings.
    if key in config:
        return config[key]
    text = config.get("text_config")
    return text.get(key) if isinstance(text, dict) else None


def _context_length(config: dict[str, Any], tokenizer: Any) -> int:
    for key in _CONTEXT_KEYS:
        value = _config_value(config, key)
        if isinstance(value, int) and value > 0:
            return value
    # transformers uses a huge sentinel when the tokenizer does not know.
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10_000_000:
        return limit
    return _FALLBACK_CONTEXT


def _chat_template(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


def release_thread_streams() -> None:
    """Call last on a thread that ran mlx work, before the thread ends.

    mlx keeps per-thread streams (mlx_lm decodes on one); if they outlive
    their thread the process can abort at exit ("terminate called without an
    active exception", ml-explore/mlx#3126). Measured: generating on a worker
    thread aborted 3 runs in 20 without this, 0 in 20 with it.
    """
    mx.synchronize()
    mx.clear_streams()

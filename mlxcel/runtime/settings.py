"""Frozen server settings, built once from CLI flags and LLAMA_ARG_* environment variables."""

from __future__ import annotations

from pathlib import Path

import attrs

from mlxcel.paths import default_cache_dir
from mlxcel.runtime.messages import SamplingParams


@attrs.frozen(kw_only=True)
class Settings:
    model: str | None = None
    alias: str | None = None
    # llama-server serves any `model` name in single-model mode (clients send their own);
    # strict: a name this server does not serve is a 404 on every route.
    strict_model_names: bool = False
    # Router mode: the models in this folder, at most models_max loaded at once, loaded on the
    # first request that names one (autoload) or only when told to (POST /models/load).
    models_dir: Path | None = None
    models_max: int = 4
    models_autoload: bool = True
    host: str = "127.0.0.1"
    port: int = 8080
    # Per-sequence context window; 0 means "what the model was trained for".
    ctx_size: int = 4096
    # Default generation cap; -1 runs until EOS or the context is full (llama-server's meaning).
    n_predict: int = -1
    parallel: int = 4
    max_queue_depth: int = 32
    prefill_chunk_size: int = 512
    # Of the model runner's time, what reading prompts may take while rows decode (1 = no
    # limit); see actors/model_runner/prefill_budget.py.
    prefill_share: float = 0.2
    # Seconds a request may wait for others to join the running batch with it (0 = never).
    join_window: float = 0.5
    sse_ping_interval: float = 30.0
    warmup: bool = True
    # The whole drain after SIGTERM, endings included: inside Kubernetes' default 30 s
    # termination grace period, so its SIGKILL never cuts a stream.
    graceful_timeout: float = 25.0
    keep_quantized: bool = False
    verbose: int = 0
    cache_dir: Path = attrs.field(factory=default_cache_dir)
    # "mlx" in production; "fake" is the deterministic backend for unit tests and demos.
    backend: str = "mlx"
    # Side models (embeddings / reranking), each on its own worker thread.
    embedding_model: str | None = None
    reranker_model: str | None = None
    embedding_batch_size: int = 16
    # Longest input in tokens; 0 = the model's own limit.
    embedding_max_length: int = 0
    embedding_queue_depth: int = 8
    embedding_request_timeout_secs: float = 120.0
    # llama-server's embd_normalize default: -1 none, 0 max-abs, 1 taxicab, 2 L2, p > 2 p-norm.
    embd_normalize: int = 2
    # Overrides the pooling read from 1_Pooling: cls, mean, max or lasttoken.
    pooling: str | None = None
    # Accepted API keys; empty means no authentication. Never logged.
    api_keys: frozenset[str] = attrs.field(factory=frozenset, repr=False)
    # Every route is mounted under this prefix ("" = at the root).
    api_prefix: str = ""
    # Threads per matmul (llama-server's -t: OPENBLAS_NUM_THREADS); -1: OpenBLAS's default.
    threads: int = -1
    # Origins allowed by CORS; "*" allows any (the request's Origin is echoed).
    cors_origins: tuple[str, ...] = ("*",)
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    # Request headers a preflight allows; "*" allows those the preflight asks for.
    cors_headers: str = "*"
    cors_credentials: bool = True
    # Seconds an idle connection is kept open (keep-alive).
    timeout: float = 600.0
    # Prompt (prefix) cache budget in MiB; 0 turns the cache off.
    cache_ram_mib: int = 8192
    # mlx's allocator keeps freed buffers for reuse; this bounds them (MiB). The batch's KV
    # grows by copying, so without a bound every size it ever had stays resident.
    mlx_cache_limit_mib: int = 512
    # Largest JSON request body accepted; larger ones get 413.
    max_request_bytes: int = 2 * 1024 * 1024
    # Defaults for request fields a client leaves out (llama-server's sampling defaults).
    sampling: SamplingParams = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    # llama-server's gates: /metrics off, /slots on, POST /props off by default.
    metrics_endpoint: bool = False
    slots_endpoint: bool = True
    # Folder of /slots save and restore files; None: those actions answer 501.
    slot_save_path: Path | None = None
    # Image inputs (vision models): --max-images per request, --max-image-payload-size bytes
    # per image, --max-image-width/height pixels, --max-image-decode-alloc-bytes decoded,
    # --media-path (the only folder local images are read from; None: no local files).
    max_images: int = 16
    max_image_payload: int = 64 * 1024 * 1024
    max_image_width: int = 16_384
    max_image_height: int = 16_384
    max_image_decode_alloc: int = 512 * 1024 * 1024
    media_path: Path | None = None
    # Image encodings kept for images sent again (--vision-cache-size; 0: none).
    vision_cache_size: int = 20
    # Image prompts share the prompt cache, keyed by their images too
    # (--enable-vlm-prefix-cache; off: image prompts are read whole every time).
    vlm_prefix_cache: bool = False
    # Audio parts on chat are transcribed into the prompt by the speech-to-text worker
    # (--no-audio-input: refused instead).
    audio_input: bool = True
    # llama-server's --context-shift (off by default, as there): a sequence that fills its
    # context drops its oldest tokens after n_keep and goes on instead of stopping.
    context_shift: bool = False
    # --batch-invariant: a seeded request's tokens do not depend on what runs beside it
    # (decode attention per row, prompts read one at a time, seeded prompts not from cache).
    batch_invariant: bool = False
    # --distributed: tensor parallel over mlx.distributed's group (mlx.launch starts the ranks);
    # rank 0 serves HTTP, the others follow its plans (actors/model_runner/distributed.py).
    distributed: bool = False
    # --distributed-timeout: a collective or step longer than this ends the rank (a peer died
    # or stalled).
    distributed_timeout: float = 60.0
    # N-gram speculation (--no-spec-ngram, --spec-ngram-max): rows propose continuations of
    # their own earlier text and check them in the batch step, while it pays.
    spec_ngram: bool = True
    spec_ngram_max: int = 16
    # --model-draft: a smaller model with the same tokenizer proposes instead of n-grams
    # (--draft-max tokens at most, --draft-min at least, stopping under --draft-p-min).
    model_draft: str | None = None
    draft_max: int = 16
    draft_min: int = 0
    draft_p_min: float = 0.75
    # --lora / --lora-scaled: mlx-lm adapter folders and their start-up scales, by id
    # (--lora-init-without-apply: every scale starts at 0).
    lora: tuple[tuple[str, float], ...] = ()
    # --keep: prompt tokens a shift always keeps (-1: the whole prompt); requests' n_keep.
    n_keep: int = 0
    props_endpoint: bool = False
    # Stored Responses and conversations (SQLite under cache_dir): entries 0 turns a store
    # off; bytes and TTL 0 mean unbounded.
    responses_store_max_entries: int = 1024
    responses_store_max_bytes: int = 268435456
    responses_store_ttl_secs: float = 3600.0
    conversation_store_max_entries: int = 256
    conversation_store_max_bytes: int = 67108864
    conversation_store_ttl_secs: float = 3600.0
    # --store: a postgresql:// URL (replicas share it) or a SQLite file; None: SQLite under
    # cache_dir.
    store: str | None = None
    # Default thinking budget for requests that set none: -1 unlimited, 0 none, N tokens.
    reasoning_budget: int = -1
    # A chat template (Jinja) to use instead of the model's own (--chat-template[-file]).
    chat_template: str | None = None
    # Where thinking goes (llama-server's --reasoning-format): "auto"/"deepseek" split it into
    # reasoning_content (Anthropic thinking blocks, Responses reasoning items); "none" leaves
    # the raw output, markers included, in the content.
    reasoning_format: str = "auto"
    # --tool-format: "auto" (the template's own format, else generic), "generic" for any model,
    # a native format's name (ToolFormat's values), or "none" (requests with tools get a 400).
    tool_format: str = "auto"
    # llama-server's --skip-chat-parsing: the raw output is the content, tool calls included.
    skip_chat_parsing: bool = False
    # The OpenRouter-style `reasoning` copy of `reasoning_content` in chat ("none": left out).
    reasoning_alias_field: str = "reasoning"
    # Audio workers (speech-to-text, text-to-speech): None = the packaged defaults, "none" = off.
    audio: bool = True
    stt_model: str | None = None
    tts_model: str | None = None
    audio_queue_depth: int = 8
    audio_request_timeout_secs: float = 120.0
    # Realtime voice WebSocket sessions open at once (more: error server_busy, close 1013).
    # None: derived from --parallel and --audio-queue-depth (actors/realtime/capacity.py).
    realtime_max_sessions: int | None = None
    # Seconds a realtime client may leave one outgoing event (or the close) untaken before its
    # connection is dropped: a client that reads nothing cannot be sent even a close frame.
    realtime_send_timeout_secs: float = 10.0

    @property
    def spec_kind(self) -> str | None:
        """What proposes tokens: "draft" (``--model-draft``), "ngram" (the default), or None
        when nothing does, or in a mode that keeps rows to one token a step
        (``--batch-invariant``, ``--context-shift``)."""
        if self.batch_invariant or self.context_shift:
            return None
        if self.model_draft is not None:
            return "draft" if self.draft_max > 0 else None
        return "ngram" if self.spec_ngram and self.spec_ngram_max > 0 else None

    @property
    def spec_max(self) -> int:
        """Most tokens one proposal may have (0: no speculation)."""
        kind = self.spec_kind
        return 0 if kind is None else self.draft_max if kind == "draft" else self.spec_ngram_max

    @property
    def speculating(self) -> bool:
        return self.spec_kind is not None

    @property
    def cache_enabled(self) -> bool:
        return self.cache_ram_mib > 0

    @property
    def unix_socket(self) -> str | None:
        """llama-server's rule: a host that looks like a path (or ends in .sock) is a UDS."""
        if "/" in self.host or self.host.endswith(".sock"):
            return self.host
        return None

    @property
    def sse_ping_enabled(self) -> bool:
        return self.sse_ping_interval > 0

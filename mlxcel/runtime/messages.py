"""Every message that crosses an actor boundary, grouped by the edge it crosses.

Messages are frozen attrs classes named for what they mean. Wire types (request and response
JSON) never appear here: ``mlxcel.http`` converts them into these before anything is submitted.
The table in docs/reference/messages.md is generated from this module (tools/gen_message_table.py);
a test fails when it is stale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import attrs

if TYPE_CHECKING:
    import trio

    from mlxcel.runtime.reply import EmbedReply
    from mlxcel.runtime.slot import OutputSlot

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


# --- shared request description ------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick each next token: llama.cpp's sampler chain settings.

    The defaults leave every stage off but temperature 1; the server's flags (--temp, --top-k,
    ...) supply llama-server's defaults at the HTTP boundary.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    typical_p: float = 1.0  # 1: off
    top_n_sigma: float = 0.0  # 0: off (llama.cpp's -1 maps here)
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: float = 1.0
    repetition_context_size: int = 64  # repeat_last_n: -1 whole context, 0 off; all 3 penalties
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75  # below 1: off
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1 whole context, 0 off
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None  # None: the process-wide generator


@attrs.frozen(kw_only=True)
class ChatPrompt:
    """Messages to render through the model's chat template."""

    messages: tuple[dict[str, object], ...]
    # Function tools offered to the model, passed to the template as `tools`.
    tools: tuple[dict[str, object], ...] | None = None
    # Extra template variables (`chat_template_kwargs`, `reasoning_effort`), as (name, value).
    template_kwargs: tuple[tuple[str, object], ...] = ()


@attrs.frozen
class AudioRef:
    """An audio part (``input_audio``): where it is in the body, its base64 data and format,
    and the placeholder the prompt holds until its transcript replaces it (a text model hears
    it through speech-to-text, before the request is submitted); empty when the audio stays a
    part of the message (a model that hears audio itself, or a stored conversation)."""

    where: str
    data: str
    format: str
    placeholder: str


@attrs.frozen
class ImageRef:
    """An image part as a request names it: where it is in the body, and its URL (a data
    URI, http(s), ``file://`` or a path). http/ reads it before the request is submitted."""

    where: str
    url: str


@attrs.frozen(kw_only=True)
class TextPrompt:
    """Raw text, encoded as is (with the tokenizer's special prefix tokens)."""

    text: str


@attrs.frozen(kw_only=True)
class TokensPrompt:
    """Token ids given by the client (llama-server's native routes), used as they are."""

    tokens: tuple[int, ...]


Prompt = ChatPrompt | TextPrompt | TokensPrompt


@attrs.frozen(kw_only=True)
class JsonSchemaFormat:
    """Constrain the output to JSON matching this schema (response_format json_schema,
    Responses text.format, a tool's parameters)."""

    # The schema as JSON text: hashable, and what llguidance takes.
    schema_json: str
    strict: bool = False


@attrs.frozen(kw_only=True)
class JsonObjectFormat:
    """Constrain the output to any JSON object (response_format json_object)."""


@attrs.frozen(kw_only=True)
class ForcedToolCall:
    """The output must be tool calls in the template's tool-call format.

    ``names`` are the tools the call may name: one for a named tool_choice (OpenAI
    {"type":"function",...}, Anthropic {"type":"tool"}), every offered tool for "required" /
    Anthropic "any". Their argument schemas come from ``ChatPrompt.tools``.
    """

    names: tuple[str, ...]
    # False: exactly one call (parallel_tool_calls false / Anthropic disable_parallel_tool_use).
    parallel: bool = True


@attrs.frozen(kw_only=True)
class LarkGrammar:
    """Constrain the output to a grammar in llguidance's Lark syntax (llama-server's `grammar`
    field, GBNF converted at the HTTP boundary)."""

    lark: str


Constraint = JsonSchemaFormat | JsonObjectFormat | ForcedToolCall | LarkGrammar


@attrs.frozen
class LoopLimit:
    """vLLM's repetition detection: stop once the output ends in a pattern of ``min_size`` to
    ``max_size`` tokens repeated ``min_count`` times in a row."""

    min_size: int
    max_size: int
    min_count: int


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """What a client asked for, in internal terms (built by http/ from the wire body)."""

    request_id: str
    prompt: Prompt
    sampling: SamplingParams
    # None: the server's --n-predict default (and then the context window).
    max_tokens: int | None
    stop: tuple[str, ...] = ()
    # Keep generating through end-of-sequence tokens (llama-server's `ignore_eos`).
    ignore_eos: bool = False
    # Prompt-cache tenant; None keeps this request out of the cache (it neither reads nor
    # donates), as `cache_prompt: false` asks.
    cache_key: str | None = None
    # Strict-priority lane from `X-Priority`: 0 high, 1 normal, 2 low.
    priority: int = 1
    # None: no log-probabilities; k >= 0: the sampled token's and the k most likely ones.
    logprobs: int | None = None
    # Parse tool calls out of the output (tools offered and tool_choice is not "none").
    parse_tools: bool = False
    # Keep at most the first tool call (parallel_tool_calls: false).
    single_tool_call: bool = False
    # The client's own parallel_tool_calls (None: not sent). The generic format writes a list of
    # calls only when it is true, as llama-server does (a small model repeats list items).
    parallel_tool_calls: bool | None = None
    # Grammar-constrained decoding for this sequence (structured output, forced tool calls).
    constraint: Constraint | None = None
    # Cap on reasoning tokens before the end-of-thinking marker is forced: None unlimited,
    # 0 no thinking at all (thinking_budget_tokens, Anthropic thinking.budget_tokens).
    thinking_budget: int | None = None
    # Number of choices (OpenAI n): that many sequences sharing one prompt prefill.
    n: int = 1
    # Armed for `/v1/chat/completions/control` (`reasoning_control: true`): who may end the
    # reasoning early (a digest of the API key, "" without keys); None: not armed.
    reasoning_control: str | None = None
    # The n-gram loop breaker (max_pattern_size, min_pattern_size, min_count); None: off.
    loop_limit: LoopLimit | None = None
    # llama-server's `id_slot`: run in this slot (its position in /slots); None: any free one.
    id_slot: int | None = None
    # Context shift (`--context-shift`): prompt tokens always kept (-1: the whole prompt;
    # None: the server's --keep), and tokens dropped after them (0: half of the rest).
    n_keep: int | None = None
    n_discard: int = 0
    # The prompt's images in the order their parts appear (vision models): ``ImageRef``s as
    # the wire names them, decoded images (PIL) once http/ has read them within its limits.
    images: tuple[Any, ...] = ()
    # The prompt's audio parts in order: ``AudioRef``s as the wire names them; a model that
    # hears audio itself (models.vlm.MediaProcessor.hears) gets them decoded (16 kHz float32
    # numpy waveforms) by http/, else http/ replaces them by their transcripts before
    # submission (no audio left).
    audio: tuple[Any, ...] = ()
    # LoRA adapter scales, one per loaded adapter (--lora): the request's `lora` field;
    # None: the global scales (/lora-adapters) as they are when admission takes it.
    lora: tuple[float, ...] | None = None


# --- http -> admission -> tokenizer ----------------------------------------------------------


@attrs.frozen
class Submit:
    """A validated request with its reserved queue place and its output slot."""

    request: GenerationRequest
    slot: OutputSlot


# --- tokenizer -> scheduler ------------------------------------------------------------------


@attrs.frozen
class Tokenized:
    """A request with its prompt encoded and its output budget fixed."""

    request: GenerationRequest
    slot: OutputSlot
    prompt_tokens: tuple[int, ...]
    # Already clamped to the context window and the server default.
    max_tokens: int
    # The rendered prompt leaves a thinking block open (the output starts inside reasoning).
    reasoning_open: bool = False
    # The request's constraint compiled to an llguidance grammar (off the compute thread).
    grammar: str | None = None
    # Context shift cut the prompt to fit the context (llama-server's `truncated`).
    truncated: bool = False
    # The processor's pixels and audio features for the prompt's images and audio
    # (models.vlm.PreparedMedia); None: text.
    images: Any = None


# --- scheduler -> model runner ----------------------------------------------------------------


@attrs.frozen
class InsertSequence:
    """Start decoding this prompt as a new sequence of the batch."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    ignore_eos: bool = False
    cache_key: str | None = None
    logprobs: int | None = None
    # Choices (OpenAI n): the prompt is read once, then its KV cache is forked into n rows.
    n: int = 1
    # llguidance grammar the output must match (None: unconstrained).
    grammar: str | None = None
    # Reasoning tokens before the end-of-thinking marker is forced (None: unlimited).
    thinking_budget: int | None = None
    # The prompt leaves a thinking block open: the output starts inside reasoning.
    reasoning_open: bool = False
    # The reasoning may be ended on request (EndReasoning), so its thinking is tracked.
    reasoning_control: bool = False
    # The slot (/slots position) the sequence runs in: its cache is that slot's once done.
    slot: int = 0
    # Context shift: tokens kept at the start, tokens dropped after them (0: half the rest).
    n_keep: int = 0
    n_discard: int = 0
    # X-Priority lane (0 high: a live voice turn); 0 is read past the prefill budget.
    priority: int = 1
    # The processor's pixels and audio features for the prompt's images and audio
    # (models.vlm.PreparedMedia); None: text.
    images: Any = None
    # LoRA adapter scales, one per loaded adapter, fixed at admission (all 0 or empty: none).
    lora: tuple[float, ...] = ()


@attrs.frozen
class ResetCache:
    """Empty the prompt cache; ``done`` is set once the compute thread has done it."""

    done: trio.Event


@attrs.frozen
class EndReasoning:
    """Close this running request's thinking block now (`/v1/chat/completions/control`)."""

    request_id: str


@attrs.frozen
class SlotState:
    """A slot's cached prompt: its tokens and, per layer, its keys and values (numpy arrays,
    shaped like mlx-lm's KVCache buffers), on its way to or from a file."""

    tokens: tuple[int, ...]
    keys: tuple[Any, ...]
    values: tuple[Any, ...]


@attrs.define
class SlotReply:
    """What the compute thread did for a SlotAction; read once ``done`` is set."""

    done: trio.Event
    # Tokens saved, restored or erased.
    n_tokens: int = 0
    # save: the slot's cache, copied out of mlx (None: the slot holds nothing).
    state: SlotState | None = None
    error: str | None = None


@attrs.frozen
class SlotAction:
    """/slots/{id}?action=: save (copy out), restore (install ``state``) or erase a slot's
    cached prompt, between two steps."""

    kind: Literal["save", "restore", "erase"]
    slot: int
    reply: SlotReply
    state: SlotState | None = None


# What HTTP may send the scheduler: control, never work (work comes through admission).
SchedulerControl = ResetCache | EndReasoning | SlotAction
SchedulerInbox = Tokenized | SchedulerControl


@attrs.frozen
class StepPlan:
    """One step for the compute thread: drop these, add those, then advance everything once."""

    removes: tuple[str, ...] = ()
    inserts: tuple[InsertSequence, ...] = ()
    reset_cache: bool = False
    # Single choices of a multi-choice request to drop (a stop string ended them while their
    # siblings go on); ``removes`` still drops whole requests.
    stop_choices: tuple[tuple[str, int], ...] = ()
    # Requests whose thinking block is to be closed now (the end marker is forced next).
    end_reasoning: tuple[str, ...] = ()
    # Slot saves, restores and erases, applied before the step.
    slot_actions: tuple[SlotAction, ...] = ()


# --- model runner -> scheduler ----------------------------------------------------------------


@attrs.frozen
class TokenOut:
    """One sequence's new token from one step."""

    request_id: str
    token: int
    # "stop" means an end-of-sequence token (which is not text); "length" the token cap.
    finish_reason: FinishReason | None
    # Only for sequences that asked: the sampled token's log-probability and the top-k
    # alternatives as (token id, logprob), most likely first.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    # Which of the request's n choices this token belongs to.
    choice: int = 0


@attrs.frozen
class PrefillProgress:
    """How far one request has read its prompt (once, whatever its number of choices)."""

    request_id: str
    done: int
    total: int


@attrs.frozen
class StepOutput:
    """Everything one step did."""

    tokens: tuple[TokenOut, ...] = ()
    prefill: tuple[PrefillProgress, ...] = ()
    # Sequences that failed inside the step; the scheduler fails their requests.
    errors: tuple[tuple[str, str], ...] = ()
    # Prompt tokens served from the prompt cache, per sequence inserted in this step.
    cached: tuple[tuple[str, int], ...] = ()
    cache: CacheStats | None = None
    # Requests whose context was shifted in this step (--context-shift).
    shifted: tuple[str, ...] = ()
    # Speculation, per request that had tokens proposed in this step: (id, proposed,
    # accepted); ``proposer`` says what proposed them ("ngram", "draft").
    drafts: tuple[tuple[str, int, int], ...] = ()
    proposer: str = ""


@attrs.frozen
class CacheStats:
    """The prompt cache, and mlx's allocator, as the compute thread last saw them."""

    entries: int = 0
    nbytes: int = 0
    max_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    # Bytes in live mlx arrays (model, batch KV, prompt cache, ...) and in freed buffers
    # mlx's allocator keeps for reuse.
    mlx_active: int = 0
    mlx_cached: int = 0
    # The vision cache (--vision-cache-size): image encodings reused and computed.
    vision_hits: int = 0
    vision_misses: int = 0


# --- scheduler -> http (statistics) -----------------------------------------------------------


@attrs.frozen(kw_only=True)
class SlotStatistics:
    """One busy slot (one choice of a running request), as it was when the copy was taken."""

    request: GenerationRequest
    # Which of the request's choices this slot decodes (a request with n choices fills n).
    choice: int
    prompt_tokens: int
    cached_tokens: int
    decoded_tokens: int
    max_tokens: int


@attrs.frozen(kw_only=True)
class SchedulerStatistics:
    """The scheduler's state copied between two steps, for /slots, /metrics and control."""

    running: int = 0
    waiting: int = 0
    # Batch rows decoding: one per choice (a request with n choices holds n).
    rows: int = 0
    # Per slot: what it decodes, or None when free.
    slots: tuple[SlotStatistics | None, ...] = ()
    cache: CacheStats = CacheStats()

    def running_request(self, request_id: str) -> GenerationRequest | None:
        """The request if it holds a slot (is in the batch, not waiting, not finished)."""
        for slot in self.slots:
            if slot is not None and slot.request.request_id == request_id:
                return slot.request
        return None


# --- scheduler -> streamer --------------------------------------------------------------------


@attrs.frozen
class OpenStream:
    """A request got a running place: the streamer starts detokenising for it."""

    request_id: str
    slot: OutputSlot
    stop: tuple[str, ...]
    # The last few prompt tokens: left context for detokenising the first output tokens.
    prompt_tail: tuple[int, ...]
    parse_tools: bool = False
    single_tool_call: bool = False
    reasoning_open: bool = False
    # Choices to stream, each with its own detokeniser, stop matcher and parsers.
    n: int = 1
    loop_limit: LoopLimit | None = None
    # The tools offered: formats that write arguments as raw text (Qwen3-Coder, GLM-4.5) take
    # each value's JSON type from its tool's schema.
    tools: tuple[dict[str, object], ...] | None = None


@attrs.frozen
class StepTokens:
    """Everything one step produced, for every running request at once."""

    tokens: tuple[TokenOut, ...]


@attrs.frozen
class CloseStream:
    """The scheduler ended a request (abort or failure) without a finishing token: every
    choice still open ends with this reason."""

    request_id: str
    finish_reason: FinishReason
    error: str | None = None


StreamerInbox = OpenStream | StepTokens | CloseStream


# --- http -> embedder worker ------------------------------------------------------------------

# A text, or token ids passed to the model as they are.
EmbedInput = str | tuple[int, ...]


@attrs.frozen
class EmbedTexts:
    """Inputs to embed: one pooled vector each, answered in request order."""

    request_id: str
    inputs: tuple[EmbedInput, ...]
    reply: EmbedReply


@attrs.frozen
class ScorePairs:
    """A query against documents on a cross-encoder: one relevance score per document."""

    request_id: str
    query: str
    documents: tuple[str, ...]
    reply: EmbedReply


EmbedderInbox = EmbedTexts | ScorePairs


# --- embedder worker -> http ------------------------------------------------------------------


@attrs.frozen
class Embedded:
    """One job's outcome: a numpy array of rows in request order, and real tokens per row."""

    # [n, dim] float32 vectors, or [n] scores in [0, 1] for a cross-encoder.
    values: object = attrs.field(eq=False)
    token_counts: tuple[int, ...]


# --- speech-to-text worker -> http / realtime voice ---------------------------------------------


@attrs.frozen(kw_only=True)
class Word:
    """One recognised word with its time span in seconds (word timestamps)."""

    word: str
    start: float
    end: float
    probability: float = 0.0


@attrs.frozen(kw_only=True)
class Segment:
    """One decoded stretch of speech: Whisper's segment, as verbose_json reports it."""

    id: int
    start: float
    end: float
    text: str
    seek: int = 0
    tokens: tuple[int, ...] = ()
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    words: tuple[Word, ...] = ()


@attrs.frozen(kw_only=True)
class Transcription:
    """A finished transcription (or translation into English) of one audio clip."""

    text: str
    language: str
    # Seconds of audio that were read.
    duration: float
    segments: tuple[Segment, ...] = ()


# --- speech workers -> http (statistics) -------------------------------------------------------


@attrs.frozen
class AudioWorkerStatistics:
    """A speech worker's queue at one moment, for /metrics."""

    # Jobs admitted and not yet handed back (queued on the thread or being computed).
    held: int
    queue_depth: int
    # Live voice turns waiting for a place (``admit``), first come first served.
    waiting: int
    # Jobs refused with a 503 because the queue was full (``admit_nowait``), since start.
    refused: int


# --- realtime sessions -> http (statistics) ------------------------------------------------------


@attrs.frozen
class RealtimeStatistics:
    """The realtime voice sessions at one moment, for /metrics."""

    open: int
    # Sessions admitted at once: --realtime-max-sessions, else ``capacity``.
    limit: int
    # What the decode rows and speech workers serve at real-time pace (derived at start).
    capacity: int
    # Summed over open sessions: uncommitted input audio held, and outgoing events queued and
    # not yet handed to the socket.
    input_bytes: int
    output_bytes: int
    # Sessions the server ended because their client did not read, by reason
    # ("outgoing_backlog", "send_timeout"), since start.
    dropped: tuple[tuple[str, int], ...]


# --- http -> session store --------------------------------------------------------------------


@attrs.define
class CancelReply:
    """What the session store did for a CancelResponse; read once ``done`` is set."""

    done: trio.Event
    # The response as it stood once its handler had ended it (None: none by that id ran).
    snapshot: dict[str, Any] | None = None


@attrs.frozen
class CancelResponse:
    """Stop the Responses response generating under this id (`/v1/responses/{id}/cancel`)."""

    response_id: str
    reply: CancelReply


SessionStoreInbox = CancelResponse

"""The tokenizer actor: chat templates and encoding, in a worker thread.

Requests are handled in arrival order. Rendering and encoding run in ``trio.to_thread`` so a
long prompt never blocks the event loop; transformers' fast tokenizers are safe to call from
a thread while the streamer decodes on the Trio thread.
"""

from __future__ import annotations

import json
import logging
from typing import Any, assert_never

import trio

from mlxcel.actors import grammars
from mlxcel.actors.harmony import harmony_history
from mlxcel.actors.reasoning import HarmonyFormat, ReasoningFormat
from mlxcel.actors.toolcalls import ToolFormat, generic
from mlxcel.actors.toolcalls.sections import kimi_history_ids
from mlxcel.runtime.errors import ContextOverflow, InternalError, InvalidRequest, MlxcelError
from mlxcel.runtime.messages import (
    ChatPrompt,
    ForcedToolCall,
    GenerationRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    Submit,
    TextPrompt,
    Tokenized,
    TokensPrompt,
)

log = logging.getLogger(__name__)


class TokenizerActor:
    def __init__(
        self,
        *,
        tokenizer: Any,
        context_length: int,
        reasoning: ReasoningFormat | None = None,
        n_predict: int,
        inbox: trio.MemoryReceiveChannel[Submit],
        outbox: trio.MemorySendChannel[Tokenized],
        tool_format: ToolFormat | None = None,
        context_shift: bool = False,
        media: Any = None,
    ) -> None:
        self._tok = tokenizer
        # A vision model's processor (models.vlm.MediaProcessor); None: text only.
        self._media = media
        self._context_shift = context_shift
        self._tool_format = tool_format
        self._special: dict[str, int] | None = None
        self._reasoning = reasoning
        self._ctx = context_length
        self._n_predict = n_predict
        self._inbox = inbox
        self._outbox = outbox

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; a request being encoded when cancellation comes is dropped
        after its thread returns (encoding cannot be interrupted)."""
        task_status.started()
        async for sub in self._inbox:
            if sub.slot.cancelled:
                sub.slot.reservation.release()
                continue
            try:
                images = None
                if sub.request.images or sub.request.audio:
                    images = await trio.to_thread.run_sync(self.prepare_media, sub.request)
                    tokens = list(images.tokens)
                else:
                    tokens = await trio.to_thread.run_sync(self.encode, sub.request)
                truncated = self._context_shift and len(tokens) >= self._ctx
                if truncated and images is not None:
                    # Cutting an image's tokens would leave pixels without their places.
                    raise ContextOverflow(len(tokens), self._ctx, param="messages")
                if truncated:
                    tokens = truncate_prompt(tokens, self._ctx, sub.request.n_keep or 0)
                max_tokens = self.budget(sub.request, len(tokens))
                opened = self._opens_reasoning(tokens)
                grammar = (
                    await trio.to_thread.run_sync(self.grammar, sub.request)
                    if sub.request.constraint is not None or self._generic_tools(sub.request)
                    else None
                )
            except MlxcelError as error:
                sub.slot.fail(error)
                sub.slot.reservation.release()
                continue
            except Exception as error:  # a bug for this request only: contain it here
                log.exception("tokenizing %s failed", sub.request.request_id)
                sub.slot.fail(InternalError(f"Tokenization failed: {type(error).__name__}"))
                sub.slot.reservation.release()
                continue
            sub.slot.accept(len(tokens))
            await self._outbox.send(
                Tokenized(
                    sub.request,
                    sub.slot,
                    tuple(tokens),
                    max_tokens,
                    opened,
                    grammar,
                    truncated,
                    images,
                )
            )

    def _generic_tools(self, request: GenerationRequest) -> tuple[dict[str, object], ...]:
        """The tools offered in the generic format (none: a native format, or not offered)."""
        if self._tool_format is not ToolFormat.GENERIC:
            return ()
        prompt, constraint = request.prompt, request.constraint
        if not isinstance(prompt, ChatPrompt) or not prompt.tools:
            return ()
        if request.parse_tools or isinstance(constraint, ForcedToolCall):
            return prompt.tools
        return ()

    def grammar(self, request: GenerationRequest) -> str | None:
        """The llguidance grammar for the request's constraint (InvalidRequest: a 400)."""
        generic_tools = self._generic_tools(request)
        if generic_tools:
            return _generic_grammar(request, generic_tools)
        if request.constraint is None:
            return None
        if self._special is None:
            self._special = grammars.special_tokens(self._tok)
        tools = request.prompt.tools if isinstance(request.prompt, ChatPrompt) else None
        return grammars.grammar_for(
            request.constraint,
            tools=tools,
            tool_format=self._tool_format,
            special=self._special,
            think=request.thinking_budget != 0,
        )

    @property
    def reasoning(self) -> ReasoningFormat | None:
        """The model's thinking markers (None: its template does not think)."""
        return self._reasoning

    def _opens_reasoning(self, tokens: list[int]) -> bool:
        if self._reasoning is None:
            return False
        tail = str(self._tok.decode(tokens[-16:], skip_special_tokens=False))
        return self._reasoning.opened_by(tail)

    def _generic_messages(
        self, request: GenerationRequest, messages: tuple[dict[str, object], ...]
    ) -> tuple[dict[str, object], ...]:
        """The template is not told about tools: they, earlier calls and their results are
        text it can render whatever it supports."""
        offered = self._generic_tools(request)
        forced = isinstance(request.constraint, ForcedToolCall)
        parallel = _parallel(request)
        system = (
            generic.system_prompt(offered, parallel=parallel, required=forced) if offered else None
        )
        try:
            return tuple(generic.render_messages(messages, system, parallel=parallel))
        except ValueError as error:
            raise InvalidRequest(f"Invalid messages: {error}", param="messages") from None

    def render(self, request: GenerationRequest) -> str:
        """The exact text the model will read (the chat template applied)."""
        prompt = request.prompt
        match prompt:
            case ChatPrompt(messages=messages, tools=tools, template_kwargs=kwargs):
                extra: dict[str, object] = dict(kwargs)
                if self._tool_format is ToolFormat.GENERIC:
                    messages = self._generic_messages(request, messages)
                elif tools:
                    extra["tools"] = list(tools)
                if self._tool_format is ToolFormat.KIMI_K2:
                    messages = tuple(kimi_history_ids(messages))
                if isinstance(self._reasoning, HarmonyFormat):
                    messages = tuple(harmony_history(messages))
                # A final assistant turn to continue (an Anthropic prefill) replaces the new one.
                add_generation = not extra.get("continue_final_message", False)
                try:
                    return self._apply(list(messages), add_generation, extra)
                except Exception as error:  # jinja raises plain exceptions for template errors
                    # Earlier calls' arguments go to templates as objects (most iterate over
                    # them); DeepSeek V3.1's concatenates them as a string, so a template that
                    # refuses the objects gets the JSON text, as llama.cpp's template
                    # capability probe decides.
                    as_text = _arguments_as_text(messages)
                    if as_text is not None:
                        try:
                            return self._apply(as_text, add_generation, extra)
                        except Exception:
                            pass  # the original error says more about the messages
                    raise InvalidRequest(
                        f"The chat template could not render these messages: {error}"
                    ) from error
            case TextPrompt(text=text):
                return text
            case TokensPrompt(tokens=tokens):
                return str(self._tok.decode(list(tokens), skip_special_tokens=False))
            case _:
                assert_never(prompt)

    def _apply(
        self, messages: list[dict[str, object]], add_generation: bool, extra: dict[str, object]
    ) -> str:
        return str(
            self._tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation, **extra
            )
        )

    def prepare_media(self, request: GenerationRequest) -> Any:
        """The rendered prompt and its images (and audio) through the model's processor:
        token ids (each image or audio marker expanded into its tokens), pixels and audio
        features."""
        if self._media is None:  # http/ refuses media before this; a guard, not a path
            kind = "image" if request.images else "audio"
            raise InvalidRequest(f"{kind} input is not supported", param="messages")
        text = self.render(request)
        try:
            return self._media.prepare(text, list(request.images), list(request.audio))
        except (ValueError, TypeError, StopIteration) as error:
            # Processors say "mismatch between image markers and images" and the like (and
            # run out of replacements when markers outnumber the media).
            what = "images" if request.images else "audio"
            why = str(error) or type(error).__name__
            raise InvalidRequest(f"The {what} could not be prepared: {why}") from error

    def encode(self, request: GenerationRequest) -> list[int]:
        if isinstance(request.prompt, TokensPrompt):
            vocab = len(self._tok)
            if any(not 0 <= t < vocab for t in request.prompt.tokens):
                raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
            if request.prompt.tokens:
                return list(request.prompt.tokens)
        text = self.render(request)
        # A chat template writes its own BOS; raw text gets the tokenizer's special prefix.
        add_special = isinstance(request.prompt, TextPrompt)
        tokens: list[int] = list(self._tok.encode(text, add_special_tokens=add_special))
        if not tokens:
            # Unconditional generation from an empty prompt starts from BOS (or EOS, as GPT-2).
            start = (
                self._tok.bos_token_id
                if self._tok.bos_token_id is not None
                else self._tok.eos_token_id
            )
            tokens = [int(start)]
        return tokens

    def budget(self, request: GenerationRequest, n_prompt: int) -> int:
        room = self._ctx - n_prompt
        if room <= 0:
            raise ContextOverflow(
                n_prompt,
                self._ctx,
                param="messages" if isinstance(request.prompt, ChatPrompt) else "prompt",
            )
        cap = request.max_tokens
        if self._n_predict > 0:
            # --n-predict caps what a request asks for (llama-server clamps to the smaller).
            cap = self._n_predict if cap is None else min(cap, self._n_predict)
        if self._context_shift:
            # The context never ends: only the cap (or an end-of-sequence token) stops it.
            return UNLIMITED if cap is None else cap
        # llama-server clamps silently to the context window rather than failing.
        return room if cap is None else min(cap, room)


# The token budget of a request with no cap under --context-shift (llama-server's n_predict
# -1 with a shifting context: until an end-of-sequence token).
UNLIMITED = 2**31 - 1


def truncate_prompt(tokens: list[int], n_ctx: int, n_keep: int) -> list[int]:
    """A prompt that fills the context, cut as llama-server cuts it under context shift: the
    first ``n_keep`` tokens, then whole blocks of half the rest dropped until it fits."""
    keep = len(tokens) if n_keep < 0 else n_keep
    keep = max(0, min(n_ctx - 4, keep))
    block = max(1, (n_ctx - keep) // 2)
    erased = (len(tokens) - keep - block) // block
    return tokens[:keep] + tokens[keep + erased * block :]


def _parallel(request: GenerationRequest) -> bool:
    """A list of calls in the generic format: only when the client asked for parallel calls
    (llama-server's default is one call; a small model given a list repeats its items)."""
    if isinstance(request.constraint, ForcedToolCall) and not request.constraint.parallel:
        return False
    return request.parallel_tool_calls is True


def _generic_grammar(request: GenerationRequest, tools: tuple[dict[str, object], ...]) -> str:
    """A call, or (tool_choice auto) a response that follows any response_format given."""
    constraint = request.constraint
    response: dict[str, Any] | None = None
    match constraint:
        case ForcedToolCall(names=names):
            return grammars.generic_tool_grammar(
                tools, names, parallel=_parallel(request), required=True
            )
        case JsonSchemaFormat(schema_json=schema):
            response = json.loads(schema)
        case JsonObjectFormat():
            response = {"type": "object"}
        case None:
            pass
        case _:
            raise InvalidRequest(
                "A grammar cannot be combined with tools on this model (generic tool calls)",
                param="grammar",
            )
    every = [grammars.tool_name(t) for t in tools]
    return grammars.generic_tool_grammar(
        tools, every, parallel=_parallel(request), required=False, response_schema=response
    )


def _arguments_as_text(messages: tuple[dict[str, object], ...]) -> list[dict[str, object]] | None:
    """The messages with every tool call's arguments object as its JSON text; None when no
    call has an object to convert."""
    changed = False
    out: list[dict[str, object]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            new_calls: list[object] = []
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), (dict, list)):
                    text = json.dumps(fn["arguments"], ensure_ascii=False)
                    call = {**call, "function": {**fn, "arguments": text}}
                    changed = True
                new_calls.append(call)
            message = {**message, "tool_calls": new_calls}
        out.append(message)
    return out if changed else None

"""What the tool-call parsers emit, and the non-streaming view of the same events.

The events map one to one onto OpenAI's streaming deltas: ``ToolCallStart`` carries what only
the first delta of an ``index`` may carry (id, name; type is always "function"), ``ToolCallArgs``
carries an ``arguments`` fragment. ``TextDelta`` is shared with the reasoning splitter, so the
streamer can pipe one into the other.
"""

from __future__ import annotations

import enum
import secrets
import string
from collections.abc import Callable, Iterable
from typing import Protocol

import attrs


class ToolFormat(enum.StrEnum):
    """Tool-call wire formats; the values are vLLM's parser names, which users already know."""

    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen, Hermes)
    LLAMA3_JSON = "llama3_json"  # <|python_tag|>{"name": ..., "parameters": ...} or bare JSON
    MISTRAL = "mistral"  # [TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}
    PYTHONIC = "pythonic"  # [f(a=1), g()] (Llama 4, Llama 3.2 pythonic templates)
    # <tool_call>\n<function=NAME>\n<parameter=KEY>\nraw value\n</parameter>\n</function>
    # \n</tool_call> (Qwen3-Coder, Qwen3.5): values are raw text, typed by the tool's schema.
    QWEN3_CODER = "qwen3_coder"
    # <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call> (GLM-4.5,
    # 4.6, 4.7): string values raw, others JSON.
    GLM45 = "glm45"
    # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>...
    # <｜tool▁calls▁end｜> (DeepSeek V3.1, V3.2-Exp chat templates).
    DEEPSEEK_V31 = "deepseek_v31"
    # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{json}\n```
    # <｜tool▁call▁end｜>...<｜tool▁calls▁end｜> (DeepSeek V3-0324 and R1 chat templates).
    DEEPSEEK_V3 = "deepseek_v3"
    # <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    # <|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|> (Kimi K2).
    KIMI_K2 = "kimi_k2"
    # <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}<|call|> (gpt-oss's
    # harmony messages; vLLM names this parser "openai").
    GPT_OSS = "gpt_oss"
    # llama-server's fallback for templates with none: tools described in the system prompt,
    # the answer one JSON object {"tool_call": ...} / {"tool_calls": [...]} / {"response": ...}.
    GENERIC = "generic"


@attrs.frozen
class TextDelta:
    """Ordinary content, safe to show: it can no longer turn out to be part of a tool call."""

    text: str


@attrs.frozen
class ReasoningDelta:
    """Thinking text, for ``reasoning_content`` (and its ``reasoning`` mirror); here beside
    TextDelta because both reasoning splitters (``reasoning``, ``harmony``) emit them."""

    text: str


@attrs.frozen
class ToolCallStart:
    index: int
    id: str
    name: str


@attrs.frozen
class ToolCallArgs:
    """A fragment of the arguments JSON; a call's fragments concatenate to one JSON object."""

    index: int
    fragment: str


@attrs.frozen
class ToolCallEnd:
    index: int


Event = TextDelta | ToolCallStart | ToolCallArgs | ToolCallEnd


class Parser(Protocol):
    """What the streamer drives: text in, events out; neither method raises on model output."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self, cut: bool = False) -> list[Event]:
        """Decide everything still held back; ``cut``: the token budget ended the output, so a
        call being written ends as a start and its arguments so far, with no end event."""
        ...


@attrs.frozen
class ToolCall:
    """One complete call, as the non-streaming response carries it."""

    id: str
    name: str
    arguments: str  # a JSON object, serialised


IdFactory = Callable[[], str]


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    # Mistral's chat templates raise unless a tool call id is exactly 9 alphanumerics, so ids we
    # hand out must survive being sent back in the next request's assistant turn.
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def default_id_factory(fmt: ToolFormat) -> IdFactory:
    return mistral_call_id if fmt is ToolFormat.MISTRAL else openai_call_id


def collect(events: Iterable[Event]) -> tuple[str | None, list[ToolCall]]:
    """Fold a stream of events into (content, calls) for a non-streaming response.

    Content is None when the turn is only tool calls (OpenAI sends ``content: null`` then).
    """
    text: list[str] = []
    calls: dict[int, tuple[str, str]] = {}
    args: dict[int, list[str]] = {}
    for ev in events:
        match ev:
            case TextDelta(t):
                text.append(t)
            case ToolCallStart(index, call_id, name):
                calls[index] = (call_id, name)
                args[index] = []
            case ToolCallArgs(index, fragment):
                args[index].append(fragment)
            case ToolCallEnd():
                pass
    content = "".join(text)
    done = [ToolCall(cid, name, "".join(args[i])) for i, (cid, name) in sorted(calls.items())]
    return (content if content or not done else None), done

"""Tool-call detection and parsing: pure, synchronous text processing for the streamer.

Use::

    fmt = detect(chat_template, tokenizer.get_vocab())
    parser = make_parser(fmt, tools=tools)  # one per request (per choice)
    for delta in text_deltas:
        events = parser.feed(delta)     # TextDelta / ToolCallStart / ToolCallArgs / ToolCallEnd
    events = parser.finish()            # decides whatever is still held back
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mlxcel.actors.toolcalls._stream import StreamParser
from mlxcel.actors.toolcalls.detect import detect
from mlxcel.actors.toolcalls.events import (
    Event,
    IdFactory,
    Parser,
    TextDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    ToolFormat,
    collect,
    default_id_factory,
)
from mlxcel.actors.toolcalls.formats import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
)
from mlxcel.actors.toolcalls.generic import GenericParser
from mlxcel.actors.toolcalls.harmony import HarmonyParser
from mlxcel.actors.toolcalls.sections import DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser
from mlxcel.actors.toolcalls.xml_args import Glm45Parser, Qwen3CoderParser, Schemas, tool_schemas

__all__ = [
    "MARKER_TEXTS",
    "Event",
    "IdFactory",
    "Parser",
    "StreamParser",
    "TextDelta",
    "ToolCall",
    "ToolCallArgs",
    "ToolCallEnd",
    "ToolCallStart",
    "ToolFormat",
    "collect",
    "detect",
    "make_parser",
    "parse_complete",
]

# Every marker the parsers read. Models whose vocabulary makes one a special token (GLM's
# <arg_key>, DeepSeek's and Kimi's section tokens, Qwen's <tool_call>) must still have it
# spelled out in the text the parsers see, so the streamer keeps these special tokens visible.
MARKER_TEXTS = frozenset(
    {
        *HermesParser.markers,
        HermesParser.CLOSE,
        *Llama3JsonParser.markers,
        *MistralParser.markers,
        "[ARGS]",
        "[CALL_ID]",
        *Qwen3CoderParser.markers,
        Qwen3CoderParser.CLOSE,
        *Glm45Parser.markers,
        Glm45Parser.CLOSE,
        *Glm45Parser.TAGS,
        *DeepSeekV31Parser.markers,
        *DeepSeekV31Parser.tokens(),
        *DeepSeekV3Parser.tokens(),
        *KimiK2Parser.markers,
        *KimiK2Parser.tokens(),
    }
)

_PARSERS: dict[ToolFormat, Callable[[IdFactory, Schemas], Parser]] = {
    ToolFormat.HERMES: lambda new_id, _: HermesParser(new_id),
    ToolFormat.LLAMA3_JSON: lambda new_id, _: Llama3JsonParser(new_id),
    ToolFormat.MISTRAL: lambda new_id, _: MistralParser(new_id),
    ToolFormat.PYTHONIC: lambda new_id, _: PythonicParser(new_id),
    ToolFormat.GENERIC: lambda new_id, _: GenericParser(new_id),
    # Arguments written as raw text: their JSON types come from the tools' schemas.
    ToolFormat.QWEN3_CODER: Qwen3CoderParser,
    ToolFormat.GLM45: Glm45Parser,
    ToolFormat.DEEPSEEK_V31: lambda new_id, _: DeepSeekV31Parser(new_id),
    ToolFormat.DEEPSEEK_V3: lambda new_id, _: DeepSeekV3Parser(new_id),
    ToolFormat.KIMI_K2: lambda new_id, _: KimiK2Parser(new_id),
    ToolFormat.GPT_OSS: lambda new_id, _: HarmonyParser(new_id),
}


def make_parser(
    fmt: ToolFormat,
    *,
    new_id: IdFactory | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> Parser:
    """A fresh incremental parser for a request offering ``tools``; ``new_id`` makes call ids
    deterministic in tests."""
    return _PARSERS[fmt](new_id or default_id_factory(fmt), tool_schemas(tools))


def parse_complete(
    fmt: ToolFormat,
    text: str,
    *,
    new_id: IdFactory | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[str | None, list[ToolCall]]:
    """The non-streaming result: exactly what feeding ``text`` in any chunking would give."""
    parser = make_parser(fmt, new_id=new_id, tools=tools)
    return collect(parser.feed(text) + parser.finish())

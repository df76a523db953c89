"""Tool-call detection and parsing: pure, synchronous text processing for the streamer.

Use::

    fmt = detect(chat_template, tokenizer.get_vocab())
    parser = make_parser(fmt)           # one per request (per choice)
    for delta in text_deltas:
        events = parser.feed(delta)     # TextDelta / ToolCallStart / ToolCallArgs / ToolCallEnd
    events = parser.finish()            # decides whatever is still held back
"""

from __future__ import annotations

from collections.abc import Callable

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

__all__ = [
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

_PARSERS: dict[ToolFormat, Callable[[IdFactory], Parser]] = {
    ToolFormat.HERMES: HermesParser,
    ToolFormat.LLAMA3_JSON: Llama3JsonParser,
    ToolFormat.MISTRAL: MistralParser,
    ToolFormat.PYTHONIC: PythonicParser,
    ToolFormat.GENERIC: GenericParser,
}


def make_parser(fmt: ToolFormat, *, new_id: IdFactory | None = None) -> Parser:
    """A fresh incremental parser; ``new_id`` makes call ids deterministic in tests."""
    return _PARSERS[fmt](new_id or default_id_factory(fmt))


def parse_complete(
    fmt: ToolFormat, text: str, *, new_id: IdFactory | None = None
) -> tuple[str | None, list[ToolCall]]:
    """The non-streaming result: exactly what feeding ``text`` in any chunking would give."""
    parser = make_parser(fmt, new_id=new_id)
    return collect(parser.feed(text) + parser.finish())

"""The one JSON reader for what clients send (request bodies, WebSocket events, JSON strings
inside them such as tool-call arguments).

Python's ``json`` accepts two things the rest of the server cannot take: a lone UTF-16
surrogate escape (``"\\ud800"``) becomes a ``str`` that no tokenizer, template or encoder
accepts, and nesting is bounded only by the interpreter's recursion limit, so a deep body
raises ``RecursionError`` here or in any later walk over it. Both become a 400 at the edge,
naming where in the body they are, so nothing past this point has to think about them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlxcel.runtime.errors import InvalidRequest

# Deep enough for any real request (a JSON schema nests two levels per object property), far
# below the interpreter's recursion limit that every later walk over the body depends on.
MAX_DEPTH = 128

# A \uD800-\uDFFF escape, the only way JSON text decoded strictly as UTF-8 can carry a
# surrogate; without one the walk skips its string checks.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def loads(raw: bytes | str, *, where: str = "request body") -> Any:
    """Parse client JSON, or raise InvalidRequest naming the place that is wrong."""
    if isinstance(raw, bytes):
        try:
            # Strict UTF-8 (json.loads of bytes would pass encoded surrogates through).
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidRequest(f"Invalid UTF-8 in {where}: {error.reason}") from None
    try:
        data = json.loads(raw)
    except RecursionError:
        raise _too_deep(where) from None
    except ValueError as error:
        raise InvalidRequest(f"Invalid JSON in {where}: {error}") from None
    check(data, strings=_SURROGATE_ESCAPE.search(raw) is not None, where=where)
    return data


def loads_or_text(text: str, *, where: str) -> Any:
    """JSON carried in a string field (tool-call arguments): the parsed value, or the text
    as it is when it is not JSON; parsed JSON meets the same depth and Unicode rules."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise _too_deep(where, where) from None
    except ValueError:
        return text
    check(data, strings=_SURROGATE_ESCAPE.search(text) is not None, where=where)
    return data


def _too_deep(where: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(f"JSON in {where} nests deeper than {MAX_DEPTH} levels", param=param)


def check(data: Any, *, strings: bool = True, where: str = "request body") -> None:
    """Refuse nesting deeper than MAX_DEPTH and (with ``strings``) lone surrogates in any
    string or key. Iterative, so the check itself cannot overflow the stack."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if strings:
                _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if len(path) >= MAX_DEPTH:
            raise _too_deep(where, _top(path))
        items: Any = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if strings and isinstance(key, str):
                _check_text(key, (*path, key))
            if isinstance(item, (dict, list)) or (strings and isinstance(item, str)):
                stack.append((item, (*path, key)))


def _check_text(text: str, path: tuple[str | int, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        field = dotted(path)
        raise InvalidRequest(
            f"Invalid Unicode in '{field}': a lone surrogate escape (\\ud800-\\udfff) is not a "
            "character; pair it, or send the character itself",
            param=field,
        ) from None


def dotted(path: tuple[str | int, ...]) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content``, as our other errors write."""
    out = ""
    for key in path:
        if isinstance(key, int):
            out += f"[{key}]"
        else:
            # A key may itself hold the bad character: written escaped, never echoed raw.
            key = key.encode("utf-8", "backslashreplace").decode("utf-8")
            out += f".{key}" if out else key
    return out or "body"


def _top(path: tuple[str | int, ...]) -> str | None:
    return dotted(path[:1]) if path else None

"""The raw bytes behind a token id, for `/tokenize` pieces and logprob `bytes`.

A token can be part of a UTF-8 character (byte-level BPE splits emoji into several tokens),
so its text alone is not enough: clients get the exact bytes.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-unicode table, as the ByteLevel decoder uses it.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


def token_bytes(tokenizer: Any, token_id: int, special: bool = False) -> bytes:
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return b""
    if special or token_id in getattr(tokenizer, "all_special_ids", ()):
        return str(piece).encode()
    if is_byte_level(tokenizer):
        table = _byte_level_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    if m := _HEX_BYTE.match(piece):  # SentencePiece byte fallback
        return bytes([int(m.group(1), 16)])
    return str(piece).replace("\u2581", " ").encode()


def piece_for_json(data: bytes) -> str | list[int]:
    """llama-server's rule: valid UTF-8 comes back as text, anything else as byte values."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)

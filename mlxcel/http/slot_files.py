"""Slot save files: a slot's tokens and KV state, in a folder named by --slot-save-path.

The format is ours: llama.cpp's files hold its own KV layout and cannot be loaded by an mlx
model, nor ours by llama.cpp. A magic line, the header's length (8 bytes, little-endian), a
JSON header (format, version, the model and its dtype, the token count, each array's shape
and dtype), the tokens (int32), then each layer's keys and values, raw, shaped like mlx-lm's
KVCache buffers (1, kv heads, tokens, head dim). Reading and writing run on a worker thread,
never on the model runner's; nothing in a file is executed or unpickled.
"""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel.runtime.messages import SlotState

FORMAT = "mlxcel-slot"
VERSION = 1
MAGIC = b"MLXCELSLOT\n"


class SlotFileError(ValueError):
    """The file is missing, unreadable, or not a slot file this server can load."""


def valid_filename(name: object) -> bool:
    """A plain file name inside the save folder (llama-server's rules): no path separators,
    no `.`/`..`, no control characters, no leading or trailing space, no trailing dot."""
    if not isinstance(name, str) or not name or len(name.encode("utf-8")) > 255:
        return False
    if name in (".", "..") or name != name.strip() or name.endswith("."):
        return False
    if any(c in name for c in '/\\:*?"<>|'):
        return False
    return not any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn") for c in name)


def write(path: Path, state: SlotState, model: str) -> int:
    """Write atomically (a temporary file renamed over the name); return the bytes written.

    Each array goes to the file straight from its buffer: the write releases the GIL, so the
    model runner's thread (which needs it between its mlx calls) is not held up. (numpy's
    ``savez`` copied each array through zipfile while holding it: a 300 MB save stretched
    another slot's token gap from 0.27 s to 1 s.)"""
    arrays = [a for pair in zip(state.keys, state.values, strict=True) for a in pair]
    header = {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "tokens": len(state.tokens),
        "arrays": [{"shape": list(a.shape), "dtype": a.dtype.str} for a in arrays],
    }
    head = json.dumps(header).encode()
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(MAGIC + len(head).to_bytes(8, "little") + head)
            f.write(np.asarray(state.tokens, dtype="<i4").tobytes())
            for a in arrays:
                f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def read(path: Path, model: str) -> tuple[SlotState, int]:
    """The state in the file and its size in bytes; SlotFileError when it cannot be used."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise SlotFileError("not a slot save file")
            n_head = int.from_bytes(f.read(8), "little")
            if not 0 < n_head <= min(size, 1 << 24):
                raise SlotFileError("its header is damaged")
            header = json.loads(f.read(n_head))
            if header.get("version") != VERSION:
                raise SlotFileError(f"unsupported slot file version {header.get('version')!r}")
            if header.get("model") != model:
                raise SlotFileError(f"saved with model {header.get('model')!r}, not {model!r}")
            n_tokens = int(header["tokens"])
            specs = [
                (tuple(int(d) for d in a["shape"]), _dtype(a["dtype"])) for a in header["arrays"]
            ]
            expected = f.tell() + 4 * n_tokens
            expected += sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in specs)
            if expected != size or len(specs) % 2:
                raise SlotFileError("its size does not match its header")
            tokens = tuple(int(t) for t in np.frombuffer(f.read(4 * n_tokens), dtype="<i4"))
            arrays = []
            for shape, dtype in specs:
                a = np.empty(shape, dtype=dtype)
                if f.readinto(a.reshape(-1).view(np.uint8).data) != a.nbytes:
                    raise SlotFileError("it ends early")
                arrays.append(a)
    except SlotFileError:
        raise
    except FileNotFoundError:
        raise SlotFileError(f"no file {path.name!r}") from None
    except (OSError, KeyError, TypeError, ValueError) as error:
        # The error's own text may name server paths: only its kind goes back.
        raise SlotFileError(f"unreadable ({type(error).__name__})") from None
    keys, values = tuple(arrays[0::2]), tuple(arrays[1::2])
    for k, v in zip(keys, values, strict=True):
        if k.ndim != 4 or v.ndim != 4 or k.shape[2] != n_tokens or v.shape[2] != n_tokens:
            raise SlotFileError("its KV state does not match its tokens")
    return SlotState(tokens, keys, values), size


def _dtype(name: object) -> np.dtype[Any]:
    """Only plain floating-point arrays: a header never makes the reader build objects."""
    dtype = np.dtype(str(name))
    if dtype.kind != "f":
        raise SlotFileError(f"arrays of {dtype} are not KV state")
    return dtype

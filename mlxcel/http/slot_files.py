"""Slot save files: a slot's tokens and KV state, in a folder named by --slot-save-path.

The format is ours (a numpy ``.npz`` archive, read without pickle): llama.cpp's files hold its
own KV layout and cannot be loaded by an mlx model, nor ours by llama.cpp. It holds
``meta`` (JSON: format, version, model id), ``tokens`` (int32) and ``k<i>``/``v<i>`` per
layer, shaped like mlx-lm's KVCache buffers (1, kv heads, tokens, head dim). Reading and
writing run on a worker thread, never on the model runner's.
"""

from __future__ import annotations

import json
import os
import unicodedata
import zipfile
from pathlib import Path

import numpy as np

from mlxcel.runtime.messages import SlotState

FORMAT = "mlxcel-slot"
VERSION = 1


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


def write(path: Path, state: SlotState, model_id: str) -> int:
    """Write atomically (a temporary file renamed over the name); return the bytes written."""
    arrays: dict[str, np.ndarray] = {
        "meta": np.array(json.dumps({"format": FORMAT, "version": VERSION, "model": model_id})),
        "tokens": np.asarray(state.tokens, dtype=np.int32),
    }
    for i, (k, v) in enumerate(zip(state.keys, state.values, strict=True)):
        arrays[f"k{i}"], arrays[f"v{i}"] = k, v
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb") as f:
            np.savez(f, allow_pickle=False, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def read(path: Path, model_id: str) -> tuple[SlotState, int]:
    """The state in the file and its size in bytes; SlotFileError when it cannot be used."""
    try:
        size = path.stat().st_size
        with np.load(path, allow_pickle=False) as archive:
            meta = json.loads(str(archive["meta"]))
            if meta.get("format") != FORMAT:
                raise SlotFileError("not a slot save file")
            if meta.get("version") != VERSION:
                raise SlotFileError(f"unsupported slot file version {meta.get('version')!r}")
            if meta.get("model") != model_id:
                raise SlotFileError(f"saved with model {meta.get('model')!r}, not {model_id!r}")
            tokens = tuple(int(t) for t in archive["tokens"])
            n_layers = sum(1 for name in archive.files if name.startswith("k"))
            keys = tuple(archive[f"k{i}"] for i in range(n_layers))
            values = tuple(archive[f"v{i}"] for i in range(n_layers))
    except SlotFileError:
        raise
    except FileNotFoundError:
        raise SlotFileError(f"no file {path.name!r}") from None
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, EOFError) as error:
        # The error's own text may name server paths: only its kind goes back.
        raise SlotFileError(f"unreadable ({type(error).__name__})") from None
    for k, v in zip(keys, values, strict=True):
        if k.ndim != 4 or v.ndim != 4 or k.shape[2] != len(tokens) or v.shape[2] != len(tokens):
            raise SlotFileError("its KV state does not match its tokens")
    return SlotState(tokens, keys, values), size

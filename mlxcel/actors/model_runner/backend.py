"""The Backend protocol the model runner drives, and what a loaded backend tells the server."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import attrs

from mlxcel.runtime.messages import StepOutput, StepPlan


@attrs.frozen(kw_only=True)
class ModelInfo:
    """Facts about the served model that the Trio side needs (no mlx objects in here)."""

    model_id: str
    path: Path | None
    # A transformers tokenizer: thread-safe for encode/decode, used off the compute thread.
    tokenizer: Any
    eos_token_ids: frozenset[int]
    context_length: int
    chat_template: str | None
    description: str = ""
    # Where the model computes, as ``models.device.DeviceInfo.label`` says it: "cpu",
    # "gpu (cuda: NVIDIA H200)"; empty for a backend without mlx (the test fake).
    device: str = ""
    # llama-server's `/v1/models` meta for the model (vocab_type, n_vocab, n_ctx_train,
    # n_embd, n_params, size) and its ftype ("MLX F32", "MLX Q4", ...); empty when unknown.
    meta: dict[str, Any] = attrs.field(factory=dict)
    # A vision-language model's processor (``models.vlm.MediaProcessor``, thread-safe, no mlx
    # state): the tokenizer actor turns a prompt and its images into tokens and pixels with it.
    # None: the model reads text only.
    media: Any = None
    # At most this many rows may decode together (a vision family that cannot batch: 1);
    # None: --parallel decides.
    max_rows: int | None = None
    # --lora adapters, by id: their folders and their scales at start-up.
    lora_paths: tuple[str, ...] = ()
    lora_scales: tuple[float, ...] = ()


class Backend(Protocol):
    """Built and used only on the model runner's thread.

    ``apply`` removes, inserts, then advances every live sequence by one step: one decode
    token each, plus one prefill chunk for sequences still reading their prompt.
    """

    info: ModelInfo

    def apply(self, plan: StepPlan) -> StepOutput: ...

    def close(self) -> None: ...

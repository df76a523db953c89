"""Choose the tool-call format from what the model itself ships: its chat template first (it
shows the model the exact syntax to use), then its special tokens."""

from __future__ import annotations

import re
from collections.abc import Mapping

from mlxcel.actors.toolcalls.events import ToolFormat

# Llama 4 and the Llama 3.2 pythonic templates describe calls as "[func_name1(params_name1=...".
_PYTHONIC_HINT = re.compile(r"\[\s*func_name\d*\s*\(")


def detect(
    chat_template: str | None, tokenizer_vocab: Mapping[str, int] | None
) -> ToolFormat | None:
    """The family this model emits tool calls in, None when nothing points to one."""
    t = chat_template or ""
    if "<|channel|>" in t and "<|call|>" in t:
        return ToolFormat.GPT_OSS  # harmony: checked first, its templates mention no other syntax
    # Qwen3-Coder and GLM-4.5 also wrap calls in <tool_call>, so their own syntax is looked
    # for before Hermes' JSON.
    if "<function=" in t and "<parameter=" in t:
        return ToolFormat.QWEN3_CODER
    if "<arg_key>" in t:
        return ToolFormat.GLM45
    if "<|tool_calls_section_begin|>" in t:
        return ToolFormat.KIMI_K2
    if "<｜tool▁sep｜>" in t:
        # V3.1's NAME<｜tool▁sep｜>{json}; V3-0324 and R1 put the type before the separator and
        # the arguments in a ```json fence.
        return ToolFormat.DEEPSEEK_V3 if "```json" in t else ToolFormat.DEEPSEEK_V31
    if "<tool_call>" in t:
        return ToolFormat.HERMES
    if "[TOOL_CALLS]" in t:
        return ToolFormat.MISTRAL
    if _PYTHONIC_HINT.search(t):
        return ToolFormat.PYTHONIC
    if "<|python_tag|>" in t or ("ipython" in t and '"parameters"' in t):
        return ToolFormat.LLAMA3_JSON
    # No template evidence (or no template): a dedicated special token still says which syntax
    # the model was trained on.
    vocab = tokenizer_vocab or {}
    for token, fmt in (
        ("<|channel|>", ToolFormat.GPT_OSS),
        ("<arg_key>", ToolFormat.GLM45),  # GLM's vocabulary has <tool_call> too
        ("<|tool_calls_section_begin|>", ToolFormat.KIMI_K2),
        ("<tool_call>", ToolFormat.HERMES),
        ("[TOOL_CALLS]", ToolFormat.MISTRAL),
        ("<|python_tag|>", ToolFormat.LLAMA3_JSON),
    ):
        if token in vocab:
            return fmt
    return None

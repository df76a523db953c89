"""Chat templates for tiny test models: a Qwen 2.5-style tool template (Hermes ``<tool_call>``
wire format) and a Qwen3-style one whose generation prompt opens a ``<think>`` block."""

from __future__ import annotations

_TOOLS_SYSTEM = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions.\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- endif %}"
)
_TURNS = (
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
)

QWEN_TOOLS = (
    _TOOLS_SYSTEM + _TURNS + "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_THINKING = (
    _TOOLS_SYSTEM
    + _TURNS
    + "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

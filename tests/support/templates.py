"""Chat templates for tiny test models: a Qwen 2.5-style tool template (Hermes ``<tool_call>``
wire format), a Qwen3-style one whose generation prompt opens a ``<think>`` block, and one per
tool-call family (Qwen3-Coder, GLM-4.5)."""

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


# --- one per tool-call family, written from each model's published chat template: the parts
# that show tools, write earlier calls and tool results, and open the answer. ---

# Qwen3-Coder-30B-A3B-Instruct: tools as XML, calls as <function=...><parameter=...>, values
# raw (objects and lists as JSON), tool results as <tool_response> user turns.
QWEN3_CODER_TOOLS = (
    "{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- if not tools is defined %}{%- set tools = [] %}{%- endif %}"
    "{%- if system_message is defined %}{{- '<|im_start|>system\\n' + system_message }}"
    "{%- elif tools | length > 0 %}{{- '<|im_start|>system\\nYou are Qwen, a helpful AI "
    "assistant that can interact with a computer to solve tasks.' }}{%- endif %}"
    "{%- if tools | length > 0 %}"
    "{{- '\\n\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{%- if tool.function is defined %}{%- set tool = tool.function %}"
    "{%- endif %}"
    "{{- '\\n<function>\\n<name>' ~ tool.name ~ '</name>' }}"
    "{%- if tool.description is defined %}"
    "{{- '\\n<description>' ~ (tool.description | trim) ~ '</description>' }}{%- endif %}"
    "{{- '\\n<parameters>' }}"
    "{%- for param_name, param_fields in (tool.parameters.properties or {}) | items %}"
    "{{- '\\n<parameter>\\n<name>' ~ param_name ~ '</name>' }}"
    "{%- if param_fields.type is defined %}"
    "{{- '\\n<type>' ~ (param_fields.type | string) ~ '</type>' }}{%- endif %}"
    "{{- '\\n</parameter>' }}{%- endfor %}"
    "{{- '\\n</parameters>\\n</function>' }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format "
    "with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n"
    "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n<parameter=example_parameter_2>"
    "\\nThis is the value for the second parameter\\nthat can span\\nmultiple lines\\n"
    "</parameter>\\n</function>\\n</tool_call>' }}"
    "{%- endif %}"
    "{%- if system_message is defined or tools | length > 0 %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content is string and message.content | trim | length > 0 %}"
    "{{- '\\n' + message.content | trim + '\\n' }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for args_name, args_value in tool_call.arguments | items %}"
    "{{- '<parameter=' + args_name + '>\\n' }}"
    "{%- set args_value = args_value | tojson | safe if args_value is mapping or "
    "(args_value is sequence and args_value is not string) else args_value | string %}"
    "{{- args_value }}{{- '\\n</parameter>\\n' }}{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.previtem and loop.previtem.role != 'tool' %}{{- '<|im_start|>user\\n' }}"
    "{%- endif %}"
    "{{- '<tool_response>\\n' + message.content + '\\n</tool_response>\\n' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + "
    "'<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# GLM-4.5: tools as JSON lines, calls as <tool_call>NAME + <arg_key>/<arg_value> pairs (strings
# raw, the rest JSON), results after <|observation|>, thinking turned off by enable_thinking.
GLM45_TOOLS = (
    "[gMASK]<sop>"
    "{%- if tools -%}<|system|>\n# Tools\n\nYou may call one or more functions to assist with "
    "the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\n<tools>\n{% for tool in tools %}{{ tool | tojson(ensure_ascii=False) }}\n"
    "{% endfor %}</tools>\n\nFor each function call, output the function name and arguments "
    "within the following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}"
    "</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n"
    "<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|user|>\n{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>\n<think></think>\n"
    "{{- (m.content or '') | trim }}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- if tc.function %}{%- set tc = tc.function %}{%- endif -%}"
    "{{ '\\n<tool_call>' + tc.name + '\\n' }}"
    "{% for k, v in tc.arguments.items() %}"
    "{{ '<arg_key>' + k + '</arg_key>\\n<arg_value>' }}"
    "{{ v | tojson(ensure_ascii=False) if v is not string else v }}"
    "{{ '</arg_value>\\n' }}"
    "{% endfor %}</tool_call>"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>"
    "{%- endif %}{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- elif m.role == 'system' -%}<|system|>\n{{ m.content }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{{- '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}"
    "{%- endif -%}"
)

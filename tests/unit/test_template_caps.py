"""/props `chat_template_caps`: found by rendering probe conversations, as llama-server does."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from mlxcel.http.ops import template_caps
from tests.support.chat_templates import TOOL_THINK_TEMPLATE

# Takes system turns, knows nothing of tools.
PLAIN = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Refuses a system turn the way real templates do.
NO_SYSTEM = (
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "[{{ m.role }}] {{ m.content }}\n{% endfor %}"
)


def test_caps_of_a_tool_template_a_plain_one_and_one_without_system(
    tiny_model_dir: Path,
) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = template_caps(tok, TOOL_THINK_TEMPLATE)
    assert tools["supports_tools"] and tools["supports_tool_calls"]
    assert tools["supports_tool_responses"] and tools["supports_system_role"]
    plain = template_caps(tok, PLAIN)
    assert plain["supports_system_role"] and not plain["supports_tools"]
    assert not plain["supports_tool_calls"]
    assert template_caps(tok, NO_SYSTEM)["supports_system_role"] is False
    assert not any(template_caps(tok, None).values())


def test_a_template_that_takes_arguments_as_text_still_renders_calls(
    tiny_model_dir: Path,
) -> None:
    from tests.support.templates import DEEPSEEK_V31_TOOLS

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    caps = template_caps(tok, DEEPSEEK_V31_TOOLS)
    assert caps["supports_tool_calls"] and caps["supports_parallel_tool_calls"]
    assert caps["supports_tool_responses"] and caps["supports_tools"]

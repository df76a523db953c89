"""llama.cpp's built-in chat templates that this server knows by name (``--chat-template``),
and the one a GGUF file without ``tokenizer.chat_template`` gets, as in llama-server.

Outside ``mlxcel.models`` on purpose: the CLI reads it before OpenBLAS is loaded, which
importing that package does."""

from __future__ import annotations

__all__ = ["BUILT_IN", "GGUF_DEFAULT"]

BUILT_IN = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
        "(message['content'] or '') + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
}

# llama-server renders chats of a model file without a template as ChatML.
GGUF_DEFAULT = "chatml"

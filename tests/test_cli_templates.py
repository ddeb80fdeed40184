"""--chat-template NAME: every built-in template specrun carries renders exactly as llama.cpp's own
C implementation (llama_chat_apply_template) on the same conversations."""

from __future__ import annotations

import ctypes

import llama_cpp as L
import pytest

from specrun.cli.runtime.chat import BUILTIN_TEMPLATES, LLAMA_TEMPLATE_NAMES
from specrun.kernels.chat_template import ChatTemplate

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": " Hi there \n"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": " b "},
     {"role": "user", "content": "c"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\n"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}],
]


def llama_cpp_render(name: str, messages: list[dict], add_generation_prompt: bool) -> str:
    chat = (L.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        chat[i].role, chat[i].content = role, content
    buf = ctypes.create_string_buffer(1 << 16)
    n = L.llama_chat_apply_template(name.encode(), chat, len(messages), add_generation_prompt, buf, len(buf))
    assert 0 <= n < len(buf), (name, n)
    return buf.raw[:n].decode()


def test_the_names_are_llamacpps():
    n = L.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    L.llama_chat_builtin_templates(names, n)
    assert sorted(LLAMA_TEMPLATE_NAMES) == sorted(x.decode() for x in names)
    assert set(BUILTIN_TEMPLATES) <= set(LLAMA_TEMPLATE_NAMES)


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_builtin_template_renders_as_llamacpp(name):
    t = ChatTemplate(BUILTIN_TEMPLATES[name])
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert t.render(messages, add_generation_prompt=gen) == llama_cpp_render(name, messages, gen), \
                (name, messages, gen)

"""Chat templates: SmolLM2's own template gives the exact expected prompt, the usual globals are
there, and the sandbox refuses templates that reach for Python internals or mutate the messages."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from specrun.kernels.chat_template import ChatTemplate, TemplateError, template_for
from specrun.kernels.llama import Model

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
TWO_TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "How are you?"}]


@pytest.fixture(scope="module")
def smol(smollm_path) -> ChatTemplate:
    with Model(smollm_path) as m:
        return template_for(m)


def test_smollm2_two_turn_prompt(smol):
    assert (smol.bos_token, smol.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smol.render(TWO_TURNS) == (
        SMOL_SYSTEM
        + "<|im_start|>user\nHi<|im_end|>\n"
        + "<|im_start|>assistant\nHello!<|im_end|>\n"
        + "<|im_start|>user\nHow are you?<|im_end|>\n"
        + "<|im_start|>assistant\n")


def test_smollm2_system_prompt_replaces_the_default(smol):
    msgs = [{"role": "system", "content": "Be brief."}, *TWO_TURNS[:1]]
    assert smol.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_smollm2_history_render_is_a_prefix_of_the_next(smol):
    """What lets a chat turn reuse the KV cache: the conversation so far, rendered without the
    generation prompt, starts the render of the conversation with the next message."""
    assert smol.render(TWO_TURNS).startswith(smol.render(TWO_TURNS[:2], add_generation_prompt=False))
    assert smol.render(TWO_TURNS).startswith(smol.render(TWO_TURNS[:1]) + "Hello!<|im_end|>")


def test_globals():
    t = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ strftime_now('%Y') | length }}",
                     "<s>", "</s>")
    assert t.render([]) == "<s>|</s>|True|4"
    assert t.render([], add_generation_prompt=False) == "<s>|</s>|False|4"


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}",
    "{{ messages[0].update({'content': 'x'}) }}",
])
def test_sandbox_refuses_python_internals_and_mutation(source):
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(TemplateError, match="unsafe operation and was refused"):
        ChatTemplate(source).render(msgs)
    assert msgs == [{"role": "user", "content": "Hi"}]


def test_sandbox_renders_an_unsafe_attribute_as_nothing():
    assert ChatTemplate("[{{ messages.__class__ }}{{ raise_exception.__globals__ }}]").render([]) == "[]"


@pytest.mark.parametrize("source, words", [
    ("{{ raise_exception('system messages are not supported') }}",
     "the chat template refused the conversation: system messages are not supported"),
    ("{% for %}", "is not valid Jinja"),
    ("{{ range(10 ** 9) | list | length }}", r"failed while rendering \(OverflowError"),
    ("{{ messages[0].content + 1 }}", r"failed while rendering \(TypeError"),
    ("{{ nothing.here }}", r"failed while rendering \(UndefinedError"),
])
def test_errors_are_template_errors(source, words):
    with pytest.raises(TemplateError, match=words):
        ChatTemplate(source).render([{"role": "user", "content": "Hi"}])


@dataclass
class StubModel:
    """What template_for reads from a model."""

    path: str = "stub.gguf"
    template: str | None = None
    bos: int = 1
    eos: int = 2

    def chat_template(self) -> str | None:
        return self.template

    def token_text(self, token: int) -> str:
        return {1: "<s>", 2: "</s>"}[token]


def test_template_for_without_one_says_how_to_give_one():
    with pytest.raises(TemplateError, match=r"^stub\.gguf has no chat template \(tokenizer\.chat_template\); "
                                            r"give one with --chat-template FILE$"):
        template_for(StubModel())


def test_template_for_override_file(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}", encoding="utf-8")
    t = template_for(StubModel(template="ignored"), str(f))
    assert (t.bos_token, t.eos_token) == ("<s>", "</s>")
    assert t.render([{"role": "user", "content": "x"}]) == "user:x;"
    with pytest.raises(TemplateError, match="cannot read chat template .*missing.jinja"):
        template_for(StubModel(), str(tmp_path / "missing.jinja"))

"""Chat templates (the GGUF's `tokenizer.chat_template`, Jinja) rendered in a sandbox.

Templates come from downloaded files, so they run in jinja2's ImmutableSandboxedEnvironment:
no attribute access to Python internals (`__class__`, `__globals__`...), no mutation of the
messages. The globals are the ones Hugging Face and llama.cpp provide: `bos_token`,
`eos_token`, `raise_exception`, `add_generation_prompt`, plus `strftime_now`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specrun.gguf_spec.errors import SpecrunError


class TemplateError(SpecrunError):
    """A chat template that is missing, malformed, or that raised while rendering."""


def _raise(message: str):
    raise TemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages: [{"role": "system"|"user"|"assistant", "content": str}, ...] -> prompt text."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        try:
            tmpl = env.from_string(self.source)
            return tmpl.render(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                               add_generation_prompt=add_generation_prompt)
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"the chat template tried an unsafe operation and was refused ({e})") from None
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"the chat template is not valid Jinja: {e}") from None
        except Exception as e:  # undefined names, the sandbox's range cap, a TypeError in the template...
            raise TemplateError(f"the chat template failed while rendering ({type(e).__name__}: {e})") from None


def template_for(model, override_path: str | None = None) -> ChatTemplate:
    """The model's own template (or the file given with --chat-template)."""
    if override_path:
        try:
            with open(override_path, encoding="utf-8") as fh:
                source = fh.read()
        except OSError as e:
            raise TemplateError(f"cannot read chat template {override_path}: {e.strerror}") from None
    else:
        source = model.chat_template()
        if not source:
            raise TemplateError(f"{model.path} has no chat template (tokenizer.chat_template); "
                                "give one with --chat-template FILE")
    return ChatTemplate(source, model.token_text(model.bos), model.token_text(model.eos))

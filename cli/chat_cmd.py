"""`specrun chat` (and `specrun -m MODEL -cnv`): an interactive conversation (cli/repl.py)."""

from __future__ import annotations

import click

from .repl import chat_loop
from .runtime.console import handle_errors
from .runtime.options import model_options, sampling_options, spec_options


@click.command("chat")
@model_options
@spec_options
@sampling_options
@click.option("-sys", "--system-prompt", "system_prompt", default=None, help="the system message")
@click.option("--chat-template", "chat_template", default=None, metavar="FILE",
              help="a Jinja chat template file instead of the model's own")
@click.option("-q", "--quiet", is_flag=True, help="no statistics line after each answer")
@handle_errors
def chat(system_prompt, chat_template, quiet, **kw):
    """Chat with a model (line editing, history, /help for the slash commands)."""
    chat_loop(kw, system_prompt, chat_template, quiet)

"""`specrun chat` (and `specrun -m MODEL -cnv`): an interactive conversation (cli/repl.py)."""

from __future__ import annotations

import click

from .repl import chat_loop
from .runtime.console import handle_errors
from .runtime.help import SectionedCommand
from .runtime.options import (
    DEFAULT_CHAT_MODEL,
    chat_options,
    console_options,
    model_options,
    run_options,
    sampling_options,
    spec_options,
)


@click.command("chat", cls=SectionedCommand)
@model_options(default=DEFAULT_CHAT_MODEL)
@spec_options
@sampling_options
@chat_options
@console_options
@click.option("-q", "--quiet", is_flag=True, help="no statistics line after each answer")
@handle_errors
def chat(quiet, **kw):
    """Chat with a model (line editing, history, /help for the slash commands). Without -m:
    smollm2-135m-instruct, the known model that has a chat template."""
    chat_loop(run_options(kw, chat=True, quiet=quiet))

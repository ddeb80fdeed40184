"""`specrun run` (the default command): one-shot generation, streamed to stdout; with -cnv (or a
conversation flag such as -sys), llama-cli's conversation mode, i.e. `specrun chat`.

Without -cnv or -no-cnv, a model with a chat template enters conversation mode, as llama-cli does:
the prompt is the first user message. On a terminal the conversation then goes on; when stdin is
not a terminal (a script, a pipe), it ends after that one answer. A model without a chat template
(a base model, as gemma-3-270m) completes the raw text. --json always prints a raw completion.

Exits as llama.cpp's: 0 when the text is done; 130 with "interrupted" (and the statistics once
generation has begun) on Ctrl-C; 141, quietly and with the statistics, when stdout's reader has
gone (`| head`); 1 with one line for an error."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import click

from specrun.kernels.chat_template import TemplateError
from specrun.kernels.engine import Engine
from specrun.kernels.types import LLAMA_DEFAULT_SEED, Stops

from .repl import chat_loop, converse
from .runtime.auto import resolve_auto
from .runtime.chat import ChatFormat
from .runtime.console import (
    SoftInterrupt,
    err_console,
    exit_broken_pipe,
    exit_interrupted,
    exit_on_interrupt,
    handle_errors,
    note,
)
from .runtime.help import SectionedCommand
from .runtime.loading import open_engine
from .runtime.options import (
    AUTO,
    REVERSE_PROMPT_NOTE,
    RunOptions,
    chat_options,
    console_options,
    model_options,
    run_options,
    sampling_options,
    spec_options,
)
from .runtime.prompts import NO_PROMPT
from .runtime.text import TextRun


@click.command("run", cls=SectionedCommand)
@model_options
@spec_options
@sampling_options
@chat_options
@click.option("-p", "--prompt", default=None, help="the prompt text")
@click.option("-f", "--file", "file", default=None, help="read the prompt from a file (- for stdin)")
# --escape first: click's help names the default by the first flag ("[default: e]" with -e first)
@click.option("--escape/--no-escape", "-e", "escape", default=True, show_default=True,
              help="process escapes (\\n, \\r, \\t, \\', \\\", \\\\, \\xNN) in -p/-f and -r, as llama.cpp")
@click.option("-r", "--reverse-prompt", "reverse_prompt", multiple=True, metavar="PROMPT",
              help="stop when the text reaches PROMPT (printed, as llama.cpp; repeatable)")
@click.option("--keep", type=int, default=None, help="accepted; specrun does not shift the context")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (text, tokens, stop, stats) instead")
@click.option("-cnv/-no-cnv", "--conversation/--no-conversation", "conversation", default=None,
              help="conversation mode, as `specrun chat`: -p/-f is the first user message; -no-cnv: a raw "
                   "completion  [default: on when the model has a chat template, or with -sys, -sysf, -st, "
                   "--chat-template]")
@click.option("-i", "--interactive", "interactive", is_flag=True,
              help="llama.cpp's interactive mode: chat, as -cnv (specrun has no raw-text interactive mode)")
@console_options
@handle_errors
def run(prompt, file, escape, reverse_prompt, keep, as_json, conversation, interactive, **kw):
    """Generate text from a prompt (streamed to stdout; statistics on stderr). A model with a chat
    template chats instead, as llama-cli (-no-cnv: a raw completion)."""
    options = run_options(kw, prompt=prompt, file=file, escape=escape, reverse_prompt=reverse_prompt, keep=keep,
                          as_json=as_json, conversation=conversation, interactive=interactive)
    if options.conversation == "on":
        chat_loop(options)
        return
    with open_engine(options.model, options.params) as engine:
        fmt = _chat_format(engine, options) if options.conversation == "auto" else None
        if fmt is not None:
            converse(options, engine, fmt)
            return
        end = complete(options, engine)
    if end is not None:
        end()


def _chat_format(engine: Engine, options: RunOptions) -> ChatFormat | None:
    """Without -cnv / -no-cnv: the model's chat format when it has a chat template, and conversation
    mode is then said in one line; None when it has none (a raw completion)."""
    name = Path(engine.model.path).name
    if engine.model.chat_template() is None:
        return None
    try:
        fmt = ChatFormat.load(engine.model)
    except TemplateError as e:
        note(f"{name}'s chat template does not render here ({e}): a raw completion, not conversation mode")
        return None
    chat = options.chat
    assert chat is not None
    first = "the prompt is the first user message" if chat.first_message is not None else "type a message"
    then = ", then exit (stdin is not a terminal)" if chat.single_turn else ""
    note(f"conversation mode, as {name} has a chat template: {first}{then}; -no-cnv for a raw completion")
    if options.stops:
        note(REVERSE_PROMPT_NOTE)
    return fmt


def complete(options: RunOptions, engine: Engine) -> Callable[[], NoReturn] | None:
    """A raw completion of options.prompt, streamed to stdout; the statistics on stderr. Returns
    the exit to take once the engine is closed (a closed stdout, an interrupt), else None."""
    params, sampling, as_json = options.params, options.sampling, options.as_json
    if options.prompt is None:      # stdin is a terminal, and the model has no chat template
        raise click.UsageError(NO_PROMPT)
    prompt_tokens = engine.tokenize(options.prompt)
    if params.spec.types == AUTO:
        with exit_on_interrupt():
            engine.set_spec(resolve_auto(engine, params.spec, prompt_tokens, refresh=options.auto_refresh))
    with SoftInterrupt() as intr:
        gen = engine.generate(prompt_tokens, options.n_predict, sampling, cancel=lambda: intr.hit > 0,
                              stops=Stops.of(options.stops))
        if sampling.seed == LLAMA_DEFAULT_SEED and not sampling.greedy and not as_json:
            err_console.print(f"sampler seed: {gen.stats.seed}", style="dim", markup=False)
        run = TextRun(gen, engine.model, stops=options.stops)
        out = _Stdout(enabled=not as_json)
        try:
            for piece in run:
                out.write(piece)
                if out.broken:
                    break
        except KeyboardInterrupt:        # a second Ctrl-C: stop here
            pass
        finally:
            run.close()
    c = run.result
    shown = c.text + (c.stopping_word if c.stop == "word" else "")   # llama.cpp prints the reverse prompt
    if as_json:
        out.enabled = True
        out.write(json.dumps({"text": shown, "tokens": c.tokens, "n_prompt": len(prompt_tokens), "stop": c.stop,
                              "stats": c.stats.to_dict()}) + "\n")
    else:
        out.write(shown[len(c.text):] + "\n")
    if c.stop == "ctx":
        note(f"context full ({engine.n_ctx} tokens) => stopping; raise -c for a longer text")
    for line in c.stats.lines():
        err_console.print(line, markup=False, soft_wrap=True)
    if out.broken:
        return exit_broken_pipe
    if intr.hit or c.stop == "interrupted":
        return exit_interrupted
    return None


class _Stdout:
    """stdout for the generated text; once its reader has gone (`| head`), writes stop and
    `broken` is set, so the statistics still reach stderr before the quiet exit."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.broken = False

    def write(self, text: str) -> None:
        if not self.enabled or self.broken or not text:
            return
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            self.broken = True

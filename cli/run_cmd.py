"""`specrun run` (the default command): one-shot generation, streamed to stdout; with -cnv (or a
conversation flag such as -sys), llama-cli's conversation mode, i.e. `specrun chat`.

Exits as llama.cpp's: 0 when the text is done; 130 with "interrupted" (and the statistics once
generation has begun) on Ctrl-C; 141, quietly and with the statistics, when stdout's reader has
gone (`| head`); 1 with one line for an error."""

from __future__ import annotations

import json
import sys

import click

from specrun.kernels.types import LLAMA_DEFAULT_SEED

from .repl import chat_loop
from .runtime.auto import resolve_auto
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
    RunOptions,
    chat_options,
    console_options,
    model_options,
    run_options,
    sampling_options,
    spec_options,
)
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
              help="chat interactively, as `specrun chat`; implied by -sys, -sysf, -st and --chat-template "
                   "(-p/-f: the first message with -sys or -st, else the system prompt)")
@click.option("-i", "--interactive", "interactive", is_flag=True,
              help="llama.cpp's interactive mode: chat, as -cnv (specrun has no raw-text interactive mode)")
@console_options
@handle_errors
def run(prompt, file, escape, reverse_prompt, keep, as_json, conversation, interactive, **kw):
    """Generate text from a prompt (streamed to stdout; statistics on stderr)."""
    options = run_options(kw, prompt=prompt, file=file, escape=escape, reverse_prompt=reverse_prompt, keep=keep,
                          as_json=as_json, conversation=conversation, interactive=interactive)
    if options.chat is not None:
        chat_loop(options)
    else:
        complete(options)


def complete(options: RunOptions) -> None:
    """A raw completion of options.prompt, streamed to stdout; the statistics on stderr."""
    params, sampling, as_json = options.params, options.sampling, options.as_json
    with open_engine(options.model, params) as engine:
        prompt_tokens = engine.tokenize(options.prompt)
        if params.spec.types == AUTO:
            with exit_on_interrupt():
                engine.set_spec(resolve_auto(engine, params.spec, prompt_tokens, refresh=options.auto_refresh))
        with SoftInterrupt() as intr:
            gen = engine.generate(prompt_tokens, options.n_predict, sampling, cancel=lambda: intr.hit > 0)
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
        exit_broken_pipe()
    if intr.hit or c.stop == "interrupted":
        exit_interrupted()


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

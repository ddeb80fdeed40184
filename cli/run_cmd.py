"""`specrun run` (the default command): one-shot generation, streamed to stdout."""

from __future__ import annotations

import json
import sys

import click

from .repl import chat_loop
from .runtime.auto import resolve_auto
from .runtime.console import err_console, handle_errors, setup_logging
from .runtime.loading import open_engine
from .runtime.options import (
    AUTO,
    engine_params,
    model_options,
    sampling_options,
    sampling_params,
    spec_options,
)
from .runtime.prompts import read_prompt
from .runtime.text import TextRun


@click.command("run")
@model_options
@spec_options
@sampling_options
@click.option("-p", "--prompt", default=None, help="the prompt text")
@click.option("-f", "--file", "file", default=None, help="read the prompt from a file")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (text, tokens, stats) instead")
@click.option("-cnv", "--conversation", is_flag=True,
              help="chat interactively, as `specrun chat` (-p/-f then give the system prompt)")
@handle_errors
def run(prompt, file, as_json, conversation, **kw):
    """Generate text from a prompt (streamed to stdout; statistics on stderr)."""
    if conversation:
        if as_json:
            raise click.UsageError("--json and -cnv/--conversation do not go together")
        system = read_prompt(prompt, file) if prompt is not None or file is not None else None
        return chat_loop(kw, system_prompt=system, chat_template=None, quiet=False)
    setup_logging(kw["verbose"])
    text = read_prompt(prompt, file)
    sampling = sampling_params(kw)
    params = engine_params(kw)
    with open_engine(kw["model"], params) as engine:
        prompt_tokens = engine.tokenize(text)
        if params.spec.types == AUTO:
            engine.set_spec(resolve_auto(engine, params.spec, prompt_tokens))
        run = TextRun(engine.generate(prompt_tokens, kw["n_predict"], sampling), engine.model)
        try:
            for piece in run:
                if not as_json:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        finally:
            run.close()
        c = run.result
        if as_json:
            json.dump({"text": c.text, "tokens": c.tokens, "n_prompt": len(prompt_tokens),
                       "stats": c.stats.to_dict()}, sys.stdout)
            sys.stdout.write("\n")
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
            for line in c.stats.lines():
                err_console.print(line, markup=False, soft_wrap=True)

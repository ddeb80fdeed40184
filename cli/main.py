"""`specrun`: one click group. A bare `specrun -m MODEL -p ...` runs the default `run` command,
as `llama-cli -m MODEL -p ...` does; everything else is a subcommand. Options parse as llama.cpp's:
`-sys`, `-ngl`, `-fa` are options of their own, and an unknown one (`-foo`) is refused by name,
never read as `-f oo`."""

from __future__ import annotations

import difflib
import faulthandler
import re
import sys

import click

from specrun.gguf_spec.registry import DEFAULT_MODEL, KNOWN_MODELS

from .runtime.help import OTHER, write_sections

# `specrun --help`: the commands by section, in this order, each with one line (a command not
# listed here shows under Other, with the first sentence of its help).
COMMAND_SECTIONS: dict[str, dict[str, str]] = {
    "Generate": {
        "run": "Generate text from a prompt (the default command)",
        "chat": "Chat with a model in the terminal",
        "serve": "Serve a model over HTTP (OpenAI and Anthropic APIs)",
    },
    "Measure": {
        "bench": "Compare spec settings on one model: tokens/s, acceptance",
        "check-exact": "Check that verify batches give one-token decoding's logits",
    },
    "Models": {
        "inspect": "Show what a GGUF holds, and whether a draft fits it",
        "export": "Print this setup as a vLLM, SGLang or llama-server command",
        "extract-mtp": "Write a model's MTP heads as a GGUF of their own",
        "quantize": "Quantize a GGUF with llama.cpp's quantizer (e.g. Q4_K_M)",
        "make-test-model": "Write a synthetic qwen35 GGUF with MTP heads, for tests",
    },
    "Distributed": {
        "rpc-worker": "Serve this CPU to --rpc clients (llama.cpp's rpc-server)",
    },
}


class DefaultGroup(click.Group):
    """A group that treats an unknown first argument (e.g. `-m`) as the start of `run`'s args."""

    default_command = "run"

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = [self.default_command, *args]
        if args and args[0] in self.commands:
            refuse_unknown_multiletter(ctx, args[0], self.commands[args[0]], args[1:])
        return super().parse_args(ctx, args)

    def format_options(self, ctx, formatter):
        """The group's options, then its commands by COMMAND_SECTIONS, one line each, in one column."""
        options = [r for p in self.get_params(ctx) if (r := p.get_help_record(ctx)) is not None]
        commands = {n: c for n in self.list_commands(ctx) if (c := self.get_command(ctx, n)) and not c.hidden}
        limit = formatter.width - 6 - max(map(len, commands), default=0)
        lines = {n: line for section in COMMAND_SECTIONS.values() for n, line in section.items()}
        other = {n: c.get_short_help_str(limit) for n, c in commands.items() if n not in lines}
        write_sections(formatter, [("Options", options), *(
            (title, [(n, lines.get(n) or other[n]) for n in names if n in commands])
            for title, names in (*COMMAND_SECTIONS.items(), (OTHER, other)))])


_NUMBER = re.compile(r"-\d|-\.\d")


def refuse_unknown_multiletter(ctx: click.Context, name: str, cmd: click.Command, args: list[str]) -> None:
    """llama.cpp never bundles short options: `-sys` is one option or none. click would read an
    unknown `-sys` as `-s ys` ("Invalid value for '-s'"), so refuse it here by its own name."""
    sub = click.Context(cmd, info_name=name, parent=ctx)
    values: dict[str, int] = {}             # option name -> values it takes
    for p in cmd.get_params(sub):
        if isinstance(p, click.Option):
            n = 0 if p.is_flag or p.count else p.nargs
            values.update({o: n for o in p.opts}, **{o: 0 for o in p.secondary_opts})
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            return
        opt = tok.split("=", 1)[0]
        if opt in values:
            i += 1 + (values[opt] if "=" not in tok else 0)
            continue
        if tok.startswith("-") and not tok.startswith("--") and len(opt) > 2 and not _NUMBER.match(tok):
            near = difflib.get_close_matches(opt, list(values), n=3)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise click.UsageError(f"No such option: {opt}{hint}", ctx=sub)
        i += 1


_HELP = f"""Run GGUF models with lossless speculative decoding.

\b
specrun -m gemma-3-270m -p "def fib(n):" --spec-type ngram-simple
specrun inspect gemma-3-270m
specrun chat -m smollm2-135m-instruct

Known models (offline, from PyPI packages): {", ".join(KNOWN_MODELS)} (default {DEFAULT_MODEL}).
"""


def _print_version(ctx: click.Context, param, value: bool) -> None:
    """specrun's version, then llama.cpp's build, as `llama-cli --version` names it."""
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import version

    from specrun.kernels.llama import build_info

    b = build_info()
    click.echo(f"specrun {version('specrun')}")
    click.echo(f"llama.cpp: ggml {b.ggml}, llama-cpp-python {b.bindings}")
    click.echo(f"backends: {', '.join(b.backends)}; CPU: {' '.join(b.features)}")
    ctx.exit()


@click.group(cls=DefaultGroup, help=_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show specrun's version and the llama.cpp build it runs, then exit.")
def cli() -> None:
    pass


def _register() -> None:
    from . import check_cmd, inspect_cmd, run_cmd

    cli.add_command(run_cmd.run)
    cli.add_command(inspect_cmd.inspect)

    from . import testmodel_cmd

    cli.add_command(testmodel_cmd.make_test_model)
    cli.add_command(testmodel_cmd.quantize_cmd)
    cli.add_command(testmodel_cmd.extract_mtp_cmd)
    cli.add_command(check_cmd.check_exact)

    from . import chat_cmd

    cli.add_command(chat_cmd.chat)

    from . import serve_cmd

    cli.add_command(serve_cmd.serve)

    from . import bench_cmd

    cli.add_command(bench_cmd.bench)

    from . import rpc_cmd

    cli.add_command(rpc_cmd.rpc_worker)

    from . import export_cmd

    cli.add_command(export_cmd.export)


_register()


def main() -> None:
    # A native crash (a llama.cpp SIGSEGV / SIGILL / abort) still ends in one readable "Fatal
    # Python error: ..." line and a Python traceback on stderr. SIGINT is not among its signals.
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, OSError, RuntimeError, ValueError):   # stderr missing or without a descriptor
        pass
    cli(prog_name="specrun")


if __name__ == "__main__":
    main()

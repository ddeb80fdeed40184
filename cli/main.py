"""`specrun`: one click group. A bare `specrun -m MODEL -p ...` runs the default `run` command,
as `llama-cli -m MODEL -p ...` does; everything else is a subcommand."""

from __future__ import annotations

import click

from specrun.gguf_spec.registry import DEFAULT_MODEL, KNOWN_MODELS


class DefaultGroup(click.Group):
    """A group that treats an unknown first argument (e.g. `-m`) as the start of `run`'s args."""

    default_command = "run"

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


_HELP = f"""Run GGUF models with lossless speculative decoding.

\b
specrun -m gemma-3-270m -p "def fib(n):" --spec-type ngram-simple
specrun inspect gemma-3-270m
specrun chat -m smollm2-135m-instruct

Known models (offline, from PyPI packages): {", ".join(KNOWN_MODELS)} (default {DEFAULT_MODEL}).
"""


@click.group(cls=DefaultGroup, help=_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specrun")
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


_register()


def main() -> None:
    cli(prog_name="specrun")


if __name__ == "__main__":
    main()

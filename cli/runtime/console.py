"""Shared pieces of the CLI: the stderr console, model resolution with a progress bar,
logging set-up, and the mapping of specrun errors to one-line messages."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.registry import KNOWN_MODELS, resolve_model

err_console = Console(stderr=True, highlight=False)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def resolve(model: str) -> Path:
    """Registry name or path -> GGUF path, with a progress bar while a model is assembled."""
    if model not in KNOWN_MODELS:
        return resolve_model(model)
    progress: Progress | None = None
    task = None

    def on_progress(done: int, total: int) -> None:
        nonlocal progress, task
        if progress is None:
            progress = Progress(TextColumn(f"assembling {model}"), BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), console=err_console, transient=True)
            progress.start()
            task = progress.add_task("assemble", total=total)
        progress.update(task, completed=done)

    try:
        return resolve_model(model, on_progress)
    finally:
        if progress is not None:
            progress.stop()


def handle_errors(f):
    """Turn a SpecrunError into one line on stderr and exit code 1 (never a traceback)."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except SpecrunError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            err_console.print("[dim]interrupted[/dim]")
            sys.exit(130)

    return wrapper

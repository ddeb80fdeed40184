"""Shared pieces of the CLI: the stderr console, model resolution with a progress bar,
logging set-up, one-line notes, and the exits: specrun errors as one line (exit 1), Ctrl-C as
llama.cpp's (exit 130, "interrupted"), a closed stdout pipe quietly (exit 141, 128 + SIGPIPE)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

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


def note(text: str) -> None:
    """One line on stderr about how a flag was taken (never re-wrapped: a program may read it)."""
    err_console.print(text, style="yellow", markup=False, soft_wrap=True)


EXIT_INTERRUPTED = 130     # 128 + SIGINT, as llama.cpp's own handler exits
EXIT_BROKEN_PIPE = 141     # 128 + SIGPIPE: what a shell reports for llama-cli, which SIGPIPE kills


def exit_interrupted() -> NoReturn:
    err_console.print("interrupted", style="dim", markup=False)
    sys.exit(EXIT_INTERRUPTED)


def exit_broken_pipe() -> NoReturn:
    """stdout's reader has gone (`| head`): point fd 1 at /dev/null, so the interpreter's last flush
    cannot complain, and exit 141 without a word."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    sys.exit(EXIT_BROKEN_PIPE)


@contextlib.contextmanager
def exit_on_interrupt() -> Iterator[None]:
    """While llama.cpp loads a model or creates a context, Ctrl-C ends the process at once with
    "interrupted" and exit 130, as llama.cpp's own SIGINT handler does. (A KeyboardInterrupt raised
    there would land in llama.cpp's log callback, where ctypes prints "Exception ignored" and drops
    it.) Nothing is left to clean up: the model is only mapped. Outside the main thread: a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum, frame) -> None:
        with contextlib.suppress(Exception):
            err_console.show_cursor(True)
            err_console.print("\ninterrupted", style="dim", markup=False)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class SoftInterrupt:
    """While text is generated, the first Ctrl-C sets `hit` (the caller stops at the next accepted
    tokens, with the engine in a clean state); a second one raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.hit = 0

    def _handler(self, signum, frame) -> None:
        self.hit += 1
        if self.hit > 1:
            raise KeyboardInterrupt

    def __enter__(self) -> SoftInterrupt:
        self._prev = None
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)


def handle_errors(f):
    """A SpecrunError: one line on stderr, exit 1. Ctrl-C: "interrupted", exit 130. A closed
    stdout pipe: quiet, exit 141. Never a traceback."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except SpecrunError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            exit_interrupted()
        except BrokenPipeError:
            exit_broken_pipe()

    return wrapper

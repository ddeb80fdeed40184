"""The server's limits on the work one request may ask for, written once here.

Sizes (a 400 names the limit and the size sent). llama-server bounds none of these but by its body
size; they sit far above what a client writes or a schema library generates, and far below what
keeps a worker busy for long. llama.cpp's grammar parser takes time quadratic in a rule's
alternatives, and each logit_bias text is tokenized on its own:

    MAX_GRAMMAR_BYTES     a GBNF grammar (given, or made from a JSON schema), in UTF-8 bytes
    MAX_SCHEMA_BYTES      a json_schema or response_format schema, as compact JSON
    MAX_LOGIT_BIAS        logit_bias entries: a bias for every token of the largest vocabularies
    MAX_LOGIT_BIAS_TEXTS  logit_bias entries keyed by a text (ids are cheap; texts are tokenized)

PREPARE_THREADS: the worker threads that parse, validate, tokenize and compile requests off the
event loop at once. That work holds the GIL most of the time, so more threads would not go faster;
they would only take CPU and the GIL from the slots' generations and from the event loop.

A time limit for chat template rendering, which runs a downloaded (or user-given) Jinja program.

The sandbox refuses unsafe operations and caps range(), but a template may still loop for seconds
(nested loops, recursive macros). `time_limited(fn, seconds)` runs fn in the calling thread with a
trace function that checks the clock on every Python call and on every line of a template's
compiled code, and raises TemplateTimeout once the time is up: Jinja runs no other code, so it
stops within a line. (A single C-level operation, such as multiplying a string, is not interrupted.)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TypeVar

from specrun.kernels.chat_template import TemplateError

MAX_GRAMMAR_BYTES = 512 << 10
MAX_SCHEMA_BYTES = 512 << 10
MAX_LOGIT_BIAS = 1 << 18
MAX_LOGIT_BIAS_TEXTS = 4096
PREPARE_THREADS = 2

TEMPLATE_TIME_LIMIT_S = 2.0      # a real template renders a conversation in milliseconds
_TEMPLATE_FILE = "<template>"    # the filename Jinja compiles templates under

R = TypeVar("R")


def kib(n: int) -> str:
    """A size in bytes as the 400s write it: '786432 bytes (768 KiB)'."""
    return f"{n} bytes ({n / 1024:.0f} KiB)" if n >= 1024 else f"{n} bytes"


class TemplateTimeout(TemplateError):
    """The chat template ran past its time limit."""


def time_limited(fn: Callable[[], R], seconds: float = TEMPLATE_TIME_LIMIT_S) -> R:
    """fn() in this thread, stopped by TemplateTimeout after `seconds` of running Python code."""
    end = time.monotonic() + seconds

    def tracer(frame, event, arg):
        if time.monotonic() > end:
            raise TemplateTimeout(f"the chat template ran past its time limit of {seconds:g} s and was stopped; "
                                  "fix its loops, or give another one with --chat-template")
        return tracer if frame.f_code.co_filename == _TEMPLATE_FILE else None

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(before)

"""A time limit for chat template rendering, which runs a downloaded (or user-given) Jinja program.

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

TEMPLATE_TIME_LIMIT_S = 2.0      # a real template renders a conversation in milliseconds
_TEMPLATE_FILE = "<template>"    # the filename Jinja compiles templates under

R = TypeVar("R")


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

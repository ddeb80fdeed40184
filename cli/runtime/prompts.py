"""Prompts: reading the user's (-p / -f / stdin, with llama.cpp's escape processing) and the
built-in ones that bench and `--spec-type auto` measure with (free text, input-grounded
rewriting, a chat turn)."""

from __future__ import annotations

import re
import sys

import click

_CODE = '''\
def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


def normalise(values):
    """Scale values to [0, 1]; a constant list becomes all zeros."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [0.0 for _ in values]
    return [(v - lo) / (hi - lo) for v in values]
'''

_DOC = ("The committee met on the third of March to review the budget for the coming year. After a long "
        "discussion, the members agreed to reduce travel costs by one fifth, to keep the library open on "
        "Saturdays, and to postpone the renovation of the east wing until the autumn. The treasurer will "
        "present a revised plan at the next meeting, together with a summary of the donations received "
        "since January.")

PROMPTS = {
    "free": "Once upon a time, in a small village at the edge of a great forest, there lived",
    "code": "Here is a Python module. Repeat it exactly, keeping every line.\n\n```python\n" + _CODE
            + "```\n\nThe same module:\n\n```python\n",
    "document": "Read this passage, then quote it back word for word.\n\n\"" + _DOC
                + "\"\n\nThe passage, quoted word for word:\n\n\"",
}
CHAT_MESSAGE = "In a few sentences, explain why the sky is blue."
BUILTIN = (*PROMPTS, "chat")


NO_PROMPT = "no prompt: give one with -p TEXT or -f FILE (or pipe it on stdin)"

_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"'": b"'", b'"': b'"', b"\\": b"\\"}
_ESCAPE = re.compile(rb"\\(x[0-9A-Fa-f]{2}|[nrt'\"\\])")


def process_escapes(text: str) -> str:
    """llama.cpp's string_process_escapes (-e, on by default): \\n \\r \\t \\' \\" \\\\ and \\xNN (a byte);
    any other backslash stays as written."""
    def one(m: re.Match) -> bytes:
        e = m.group(1)
        return bytes([int(e[1:], 16)]) if e[:1] == b"x" else _ESCAPES[e]

    return _ESCAPE.sub(one, text.encode("utf-8")).decode("utf-8", errors="replace")


def read_prompt(prompt: str | None, file: str | None, escape: bool = False) -> str:
    """-p TEXT, -f FILE (- for stdin), else what is piped on stdin. escape: process llama.cpp's
    escapes in -p and -f text (as its -e), not in the piped fallback."""
    text = _read_prompt(prompt, file)
    return process_escapes(text) if escape and (prompt is not None or file is not None) else text


def _read_prompt(prompt: str | None, file: str | None) -> str:
    if prompt is not None and file is not None:
        raise click.UsageError("give the prompt with -p or -f, not both")
    if file == "-":
        return sys.stdin.read()
    if file is not None:
        try:
            with open(file, encoding="utf-8") as fh:
                return fh.read()
        except OSError as e:
            raise click.BadParameter(f"cannot read {file}: {e.strerror}", param_hint="-f/--file") from None
        except UnicodeDecodeError:
            raise click.BadParameter(f"{file} is not UTF-8 text", param_hint="-f/--file") from None
    if prompt is None:
        text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
        if not text:
            raise click.UsageError(NO_PROMPT)
        return text
    return prompt

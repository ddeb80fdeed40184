"""The chat REPL of `specrun chat` (and `specrun -m MODEL -cnv`), as llama-cli's conversation
mode, `ollama run` or `llm chat`: line editing and history on a terminal, plain lines when piped,
slash commands, Ctrl-C that stops an answer and keeps the session. The conversation itself is
runtime.chat.ChatSession."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels.engine import Engine, resolve_seed
from specrun.kernels.types import LLAMA_DEFAULT_SEED

from .runtime.auto import resolve_auto
from .runtime.chat import ChatFormat, ChatSession, Turn
from .runtime.console import SoftInterrupt, err_console, exit_on_interrupt
from .runtime.loading import open_engine
from .runtime.options import AUTO, RunOptions

HELP = """\
/help          this list
/stats         statistics of the last answer and of the session
/spec TYPE     switch the speculative decoding type (none, ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod,
               ngram-cache, draft, draft-eagle3, draft-mtp; comma-separated)
/regen         drop the last answer and generate it again (sampling: from a new seed)
/clear         forget the conversation, keep the system prompt (also /reset)
/save FILE     write the conversation as JSON
/load FILE     replace the conversation with one saved by /save
/exit          leave (also Ctrl-D)
A line that ends with \\ continues on the next line. Ctrl-C stops an answer."""


def history_path() -> Path:
    """$SPECRUN_HISTORY, else $XDG_STATE_HOME/specrun/chat_history (~/.local/state/...)."""
    if env := os.environ.get("SPECRUN_HISTORY"):
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "specrun" / "chat_history"


class LineReader:
    """Input lines: prompt_toolkit (editing, history across sessions, pastes) on a terminal,
    plain lines otherwise. read() joins lines that end with a backslash; None at end of input."""

    def __init__(self, interactive: bool) -> None:
        self.session = None
        if interactive:
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import FileHistory, InMemoryHistory
            from prompt_toolkit.output import create_output

            path = history_path()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
                if not path.is_file():     # touch() accepts a folder; prompt_toolkit would fail at each prompt
                    raise IsADirectoryError(errno.EISDIR, "not a file")
                history = FileHistory(str(path))
            except OSError as e:
                _say(f"no input history: cannot write {path} ({e.strerror})", style="dim")
                history = InMemoryHistory()
            # the prompt is interface, not generated text: it goes where stderr goes when that is a terminal
            out = create_output(stdout=sys.stderr if sys.stderr.isatty() else sys.stdout)
            self.session = PromptSession(history=history, output=out)

    def _line(self, prompt: str) -> str | None:
        if self.session is None:
            line = sys.stdin.readline()
            return line.rstrip("\n") if line else None
        try:
            return self.session.prompt(prompt)
        except EOFError:
            return None

    def read(self) -> str | None:
        lines: list[str] = []
        while True:
            try:
                line = self._line("> " if not lines else "... ")
            except KeyboardInterrupt:
                if self.session is None:
                    raise
                lines.clear()     # Ctrl-C drops what is being typed, continuation lines too (as a shell)
                continue
            if line is None:
                return "\n".join(lines) if lines else None
            if line.endswith("\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            return "\n".join(lines)


def turn_line(turn: Turn) -> str:
    """The short line after each answer."""
    st = turn.stats
    parts = [f"{st.n_gen} tokens, {st.gen_tps:.1f} tokens/s",
             f"prompt {st.n_prompt} new + {st.n_prompt_total - st.n_prompt} cached"]
    for d in st.drafters:
        if d.n_gen_drafts:
            parts.append(f"{d.spec_type}: accepted {d.n_acc_tokens}/{d.n_gen_tokens}, "
                         f"mean acc len {d.mean_acc_len:.2f}")
    if turn.stop not in ("eog", "turn"):
        parts.append({"n_predict": "stopped at -n", "ctx": "context full",
                      "interrupted": "interrupted"}.get(turn.stop, turn.stop))
    return "[" + " | ".join(parts) + "]"


def _say(text: str, style: str | None = None) -> None:
    """One status line on stderr, never re-wrapped (it may be read by a program)."""
    err_console.print(text, style=style, markup=False, soft_wrap=True)


def _command(session: ChatSession, line: str) -> bool:
    """Run a slash command; False when the session should end."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name == "/help":
        _say(HELP)
    elif name == "/stats":
        if session.last is not None:
            _say("last answer:")
            for s in session.last.stats.lines():
                _say("  " + s)
        for s in session.stats.lines():
            _say(s)
    elif name == "/spec":
        if not arg:
            _say(f"spec type: {','.join(session.engine.params.spec.types) or 'none'}")
        else:
            _say(f"spec type: {session.set_spec(arg)}")
    elif name in ("/clear", "/reset"):
        session.reset()
        _say("conversation cleared")
    elif name in ("/save", "/load"):
        if not arg:
            raise SpecrunError(f"{name} needs a file name: {name} FILE")
        if name == "/save":
            session.save(arg)
            _say(f"saved {len(session.messages)} messages to {arg}")
        else:
            n = session.load(arg)
            _say(f"loaded {n} messages from {arg}")
    else:
        raise SpecrunError(f"unknown command {name}; /help lists the commands")
    return True


def _dropped(n: int) -> None:
    _say(f"context full: dropped the oldest {n} turn(s) to make room; /reset starts over", style="yellow")


def _regen(session: ChatSession, quiet: bool) -> None:
    """/regen: the last answer dropped and generated again; when sampling, from a new seed (said)."""
    if not session.sampling.greedy:
        session.sampling = resolve_seed(replace(session.sampling, seed=LLAMA_DEFAULT_SEED))
        _say(f"sampler seed: {session.sampling.seed}", style="dim")
    _answer(session, lambda: session.regen(on_dropped=_dropped), quiet)


def _answer(session: ChatSession, send: Callable[[], Iterator[str]], quiet: bool) -> None:
    """Stream one answer (send(): the session's iterator of its pieces) to stdout, then its line."""
    before = session.last
    with SoftInterrupt() as intr:
        it = send()
        try:
            for piece in it:
                sys.stdout.write(piece)
                sys.stdout.flush()
                if intr.hit:
                    break
        except KeyboardInterrupt:
            it.close()
            session.recover()
        finally:
            it.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    turn = session.last
    if turn is None or turn is before:
        return
    if turn.stop == "ctx":
        _say(f"the context is full ({session.engine.n_ctx} tokens): the next message drops the oldest "
             "turns; /reset starts over (or raise -c)", style="yellow")
    if not quiet:
        _say(turn_line(turn), style="dim")


def chat_loop(options: RunOptions) -> None:
    """The REPL of `specrun chat` and `specrun -cnv` (options.chat: how the conversation starts):
    loads the model and its chat format, then converse()."""
    conv = options.chat
    assert conv is not None
    with open_engine(options.model, options.params) as engine:
        converse(options, engine, ChatFormat.load(engine.model, conv.chat_template, conv.chat_template_file))


def converse(options: RunOptions, engine: Engine, fmt: ChatFormat) -> None:
    """The conversation on a loaded engine: options.chat's first message, if any, then the lines
    read, until end of input, /exit or (single turn) the first answer. One random seed (printed
    before the first answer) serves the whole session, so a sampled conversation can be replayed
    with --seed; /regen draws a new one."""
    conv = options.chat
    assert conv is not None
    sampling, params = options.sampling, options.params
    seed_line = None                 # said before the first answer, the one place it matters
    if sampling.seed == LLAMA_DEFAULT_SEED and not sampling.greedy:
        sampling = resolve_seed(sampling)
        seed_line = f"sampler seed: {sampling.seed}"
    first = conv.first_message
    interactive = sys.stdin.isatty() and not (conv.single_turn and first is not None)
    quiet = conv.quiet
    if params.spec.types == AUTO:
        with exit_on_interrupt():
            engine.set_spec(resolve_auto(engine, params.spec, refresh=options.auto_refresh))
    session = ChatSession(engine, fmt, sampling, options.n_predict, conv.system_prompt)
    reader = LineReader(interactive)
    if interactive and not quiet:
        _say(f"chatting with {Path(engine.model.path).name}; /help for commands, Ctrl-D or /exit to leave",
             style="dim")
    while True:
        given = first is not None       # -p's text is a message, even one that starts with a slash
        if given:
            line, first = first, None
        else:
            line = reader.read()
        if line is None:
            break
        if not line.strip():
            if given and conv.single_turn:     # an empty -p: nothing to answer, and no stdin to wait for
                break
            continue
        command = line.startswith("/") and not given
        try:
            if command and line.strip() == "/regen":
                _regen(session, quiet)
            elif command:
                if not _command(session, line):
                    break
            else:
                if seed_line:
                    _say(seed_line, style="dim")
                    seed_line = None
                _answer(session, lambda text=line: session.send(text, on_dropped=_dropped), quiet)
        except SpecrunError as e:        # one line; the session goes on
            _say(f"error: {e}", style="red")
        if conv.single_turn and not command:
            break

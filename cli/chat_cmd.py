"""`specrun chat` (and `specrun -m MODEL -cnv`): an interactive conversation, as llama-cli's
conversation mode, `ollama run` or `llm chat`.

Each turn renders the whole conversation with the model's chat template and hands the tokens
to the engine, which evaluates only what its KV cache does not hold yet. To keep the cache
reusable, the tokens of the history are the ones the model actually produced: when the new
render extends the text of the history (the usual case), only the new text is tokenized and
appended to them.

    turn 1: [render(u1) -> tokens P1] + answer tokens A1 (incl. its end-of-turn token)
    turn 2: P1 + A1 + tokenize(render(u1, a1, u2)[len(render(u1) + a1 + eot):])
            -> the engine evaluates the last token of A1 (sampled, never decoded) + the delta

ChatSession is the testable core (no terminal); chat_loop() is the REPL around it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import click

from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels.chat_template import ChatTemplate, TemplateError, template_for
from specrun.kernels.engine import parse_spec_types
from specrun.kernels.stats import GenStats
from specrun.kernels.types import SamplingParams

from .auto import AUTO, resolve_auto
from .common import err_console, handle_errors, setup_logging
from .options import model_options, sampling_options, sampling_params, spec_options
from .run_cmd import TextStream, load_engine

ROLES = ("system", "user", "assistant")

HELP = """\
/help          this list
/stats         statistics of the last answer and of the session
/spec TYPE     switch the speculative decoding type (none, ngram-simple, draft, draft-mtp; comma-separated)
/reset         forget the conversation (keeps the system prompt)
/save FILE     write the conversation as JSON
/load FILE     replace the conversation with one saved by /save
/exit          leave (also Ctrl-D)
A line that ends with \\ continues on the next line. Ctrl-C stops an answer."""

_ANSWER, _USER = "\x1fspecrun-answer\x1f", "\x1fspecrun-user\x1f"


class ContextFull(SpecrunError):
    """A message that does not fit the context even with every earlier turn dropped."""


def turn_stop_tokens(template: ChatTemplate, model) -> frozenset[int]:
    """The control tokens of the text the template puts between an answer and the next user
    message (ChatML: <|im_end|>, <|im_start|>; Gemma: <end_of_turn>, <start_of_turn>). A model
    that emits one has finished its turn, or started the next one on its own."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _ANSWER},
            {"role": "user", "content": _USER}]
    try:
        text = template.render(msgs, add_generation_prompt=False)
    except TemplateError:
        return frozenset()
    i, j = text.find(_ANSWER), text.find(_USER)
    if i < 0 or j < i:
        return frozenset()
    sep = text[i + len(_ANSWER):j]
    return frozenset(int(t) for t in model.tokenize(sep, add_special=False)
                     if not model.piece(int(t)) and model.token_text(int(t)))


@dataclass(slots=True)
class SessionStats:
    """Sums over the turns of a session (the per-turn numbers are GenStats)."""

    turns: int = 0
    n_prompt: int = 0          # prompt tokens evaluated
    n_prompt_total: int = 0    # prompt tokens, reused from the KV cache or not
    n_gen: int = 0
    t_prompt_s: float = 0.0
    t_gen_s: float = 0.0
    n_gen_drafts: int = 0
    n_drafted: int = 0
    n_accepted: int = 0

    def add(self, st: GenStats) -> None:
        self.turns += 1
        self.n_prompt += st.n_prompt
        self.n_prompt_total += st.n_prompt_total
        self.n_gen += st.n_gen
        self.t_prompt_s += st.t_prompt_s
        self.t_gen_s += st.t_gen_s
        self.n_gen_drafts += sum(d.n_gen_drafts for d in st.drafters)
        self.n_drafted += st.n_drafted
        self.n_accepted += st.n_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_acc_len(self) -> float:
        return 1.0 + self.n_accepted / self.n_gen_drafts if self.n_gen_drafts else 0.0

    @property
    def gen_tps(self) -> float:
        return self.n_gen / self.t_gen_s if self.t_gen_s > 0 else 0.0

    def lines(self) -> list[str]:
        out = [f"session: {self.turns} answers, prompt eval {self.n_prompt} tokens "
               f"({self.n_prompt_total - self.n_prompt} reused from the KV cache), "
               f"generation {self.n_gen} tokens in {self.t_gen_s:.2f} s ({self.gen_tps:.2f} tokens/s)"]
        if self.n_gen_drafts:
            out.append(f"session: draft acceptance rate = {self.acceptance_rate:.5f} ({self.n_accepted} "
                       f"accepted / {self.n_drafted} generated), #mean acc len = {self.mean_acc_len:.2f}")
        return out


@dataclass(frozen=True, slots=True)
class Turn:
    """One answer. stop: eog | turn (the model began a new turn) | n_predict | ctx | interrupted."""

    text: str
    tokens: list[int]              # as generated, without a new-turn token that stopped it
    stop: str
    stats: GenStats
    n_dropped: int = 0             # oldest turns dropped to make room (context shift)


@dataclass(slots=True)
class _Checkpoint:
    text: str                      # a prefix of the conversation's render...
    tokens: list[int] = field(default_factory=list)   # ...and the tokens that stand for it


class ChatSession:
    """A conversation over one engine. send(text) yields the answer's text as it is accepted;
    afterwards self.last is the Turn (also when the caller closed the iterator early)."""

    def __init__(self, engine, template: ChatTemplate, sampling: SamplingParams | None = None,
                 n_predict: int = -1, system_prompt: str | None = None) -> None:
        self.engine = engine
        self.template = template
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.n_predict = n_predict
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.messages: list[dict] = list(self.system)
        self.stop_tokens = turn_stop_tokens(template, engine.model)
        self.stats = SessionStats()
        self.last: Turn | None = None
        self._checkpoints: list[_Checkpoint] = []     # longest first
        # try the template once now, so a template that cannot take this conversation fails at start
        self.template.render([*self.messages, {"role": "user", "content": "hi"}])

    # -- prompt ------------------------------------------------------------------------------
    def _tokenize_full(self, text: str) -> list[int]:
        bos = self.template.bos_token
        add = not (bos and text.startswith(bos))        # templates that write BOS themselves
        return [int(t) for t in self.engine.tokenize(text, add_special=add)]

    def prompt_for(self, messages: list[dict]) -> tuple[list[int], str]:
        """The tokens and text of messages rendered with the generation prompt, extending the
        tokens of the history when the render extends its text."""
        text = self.template.render(messages, add_generation_prompt=True)
        for cp in self._checkpoints:
            if text.startswith(cp.text):
                delta = self.engine.tokenize(text[len(cp.text):], add_special=False)
                return cp.tokens + [int(t) for t in delta], text
        return self._tokenize_full(text), text

    def _reserve(self) -> int:
        n_ctx = self.engine.n_ctx
        want = self.n_predict if self.n_predict > 0 else n_ctx
        return max(1, min(want, n_ctx // 4))

    def _fit(self, messages: list[dict]) -> tuple[list[int], str, int]:
        """Drop the oldest turns (user message and its answers) until the prompt leaves room
        for an answer, as llama-cli's context shift; the system prompt and the new message stay."""
        n_ctx, reserve, dropped = self.engine.n_ctx, self._reserve(), 0
        while True:
            tokens, text = self.prompt_for(messages)
            if len(tokens) + reserve <= n_ctx:
                return tokens, text, dropped
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            if len(users) < 2:
                if len(tokens) < n_ctx:
                    return tokens, text, dropped
                raise ContextFull(f"the message does not fit in the context ({len(tokens)} tokens, "
                                  f"ctx {n_ctx}); shorten it or raise -c")
            del messages[users[0]:users[1]]
            dropped += 1

    # -- turns -------------------------------------------------------------------------------
    def send(self, text: str) -> Iterator[str]:
        """Add a user message and yield the answer's text as the engine accepts it."""
        before = self.messages
        messages = [*before, {"role": "user", "content": text}]
        tokens, rendered, dropped = self._fit(messages)
        self.messages = messages
        model = self.engine.model
        stream = TextStream(model)
        out: list[int] = []
        pieces: list[str] = []
        stop = ""
        gen = self.engine.generate(tokens, self.n_predict, self.sampling)
        failed = False
        try:
            for toks in gen:
                n = len(toks)
                for j, t in enumerate(toks):
                    if t in self.stop_tokens and not model.is_eog(t):
                        n, stop = j, "turn"
                        break
                out.extend(toks[:n])
                s = stream.push(toks[:n])
                if s:
                    pieces.append(s)
                    yield s
                if stop:
                    break
            s = stream.flush()
            if s:
                pieces.append(s)
                yield s
        except Exception:
            failed = True
            raise
        finally:
            gen.close()
            if failed:          # an engine error: the turn did not happen
                self.messages = before
                self._checkpoints = []
            else:
                pieces.append(stream.flush())
                st = self.engine.stats
                if not stop:
                    stop = "interrupted" if st.stop in ("", "interrupted") else st.stop
                answer = "".join(pieces)
                self._finish(tokens, rendered, out, answer, Turn(answer, out, stop, st, dropped))

    def _finish(self, tokens: list[int], rendered: str, out: list[int], answer: str, turn: Turn) -> None:
        self.messages.append({"role": "assistant", "content": answer})
        eot = self.engine.model.token_text(out[-1]) if out and self.engine.model.is_eog(out[-1]) else ""
        self._checkpoints = [_Checkpoint(rendered + answer + eot, tokens + out), _Checkpoint(rendered, tokens)]
        self.stats.add(turn.stats)
        self.last = turn

    # -- commands ----------------------------------------------------------------------------
    def reset(self) -> None:
        self.messages = list(self.system)
        self._checkpoints = []
        self.engine.reset()

    def recover(self) -> None:
        """After a hard interrupt (an exception raised inside the engine), the KV cache may no
        longer match engine.kv_tokens: start the cache over; the conversation stays."""
        self._checkpoints = []
        self.engine.reset()

    def set_spec(self, types: str) -> str:
        spec = replace(self.engine.params.spec, types=parse_spec_types(types))
        self.engine.set_spec(spec)
        return ",".join(spec.types) or "none"

    def save(self, path: str) -> None:
        try:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump({"messages": self.messages}, fh, ensure_ascii=False, indent=2)
                fh.write("\n")
        except OSError as e:
            raise SpecrunError(f"cannot write {path}: {e.strerror}") from None

    def load(self, path: str) -> int:
        """Replace the conversation with the one in path (as /save writes it); returns the
        number of messages. Nothing changes when the file is not a conversation."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except OSError as e:
            raise SpecrunError(f"cannot read {path}: {e.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SpecrunError(f"{path} is not JSON ({e}); give a file written by /save") from None
        msgs = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(msgs, list):
            raise SpecrunError(f"{path} holds no conversation: expected {{\"messages\": [...]}} as /save writes")
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise SpecrunError(f"{path}: message {i} is not {{\"role\": system|user|assistant, "
                                   f"\"content\": text}}")
        self.messages = [{"role": m["role"], "content": m["content"]} for m in msgs]
        self._checkpoints = []
        return len(self.messages)


# -- the REPL ----------------------------------------------------------------------------------


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
        while True:
            try:
                return self.session.prompt(prompt)
            except KeyboardInterrupt:       # Ctrl-C at the prompt clears the line
                continue
            except EOFError:
                return None

    def read(self) -> str | None:
        lines: list[str] = []
        while True:
            line = self._line("> " if not lines else "... ")
            if line is None:
                return "\n".join(lines) if lines else None
            if line.endswith("\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            return "\n".join(lines)


class _SoftInterrupt:
    """During an answer, the first Ctrl-C sets a flag (the answer stops at the next accepted
    tokens, with the engine in a clean state); a second one raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.hit = 0

    def _handler(self, signum, frame) -> None:
        self.hit += 1
        if self.hit > 1:
            raise KeyboardInterrupt

    def __enter__(self) -> _SoftInterrupt:
        self._prev = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._prev)


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
    elif name == "/reset":
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


def _answer(session: ChatSession, text: str, quiet: bool) -> None:
    before = session.last
    with _SoftInterrupt() as intr:
        it = session.send(text)
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
    if turn.n_dropped:
        _say(f"context full: dropped the oldest {turn.n_dropped} turn(s) to make room; /reset starts over",
             style="yellow")
    if turn.stop == "ctx":
        _say(f"the context is full ({session.engine.n_ctx} tokens): the next message drops the oldest "
             "turns; /reset starts over (or raise -c)", style="yellow")
    if not quiet:
        _say(turn_line(turn), style="dim")


def chat_loop(kw: dict, system_prompt: str | None, chat_template: str | None, quiet: bool) -> None:
    setup_logging(kw["verbose"])
    sampling = sampling_params(kw)
    interactive = sys.stdin.isatty()
    with load_engine(kw) as engine:
        if kw["spec_type"] == AUTO:
            engine.set_spec(resolve_auto(engine, kw))
        template = template_for(engine.model, chat_template)
        session = ChatSession(engine, template, sampling, kw["n_predict"], system_prompt)
        reader = LineReader(interactive)
        if interactive and not quiet:
            _say(f"chatting with {Path(engine.model.path).name}; /help for commands, Ctrl-D or /exit to leave",
                 style="dim")
        while True:
            line = reader.read()
            if line is None:
                break
            if not line.strip():
                continue
            try:
                if line.startswith("/"):
                    if not _command(session, line):
                        break
                else:
                    _answer(session, line, quiet)
            except SpecrunError as e:        # one line; the session goes on
                _say(f"error: {e}", style="red")


@click.command("chat")
@model_options
@spec_options
@sampling_options
@click.option("-sys", "--system-prompt", "system_prompt", default=None, help="the system message")
@click.option("--chat-template", "chat_template", default=None, metavar="FILE",
              help="a Jinja chat template file instead of the model's own")
@click.option("-q", "--quiet", is_flag=True, help="no statistics line after each answer")
@handle_errors
def chat(system_prompt, chat_template, quiet, **kw):
    """Chat with a model (line editing, history, /help for the slash commands)."""
    chat_loop(kw, system_prompt, chat_template, quiet)

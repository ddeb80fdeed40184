"""The chat core shared by the REPL (`specrun chat`) and the server's chat endpoint.

ChatFormat turns messages into prompt tokens with the model's chat template (one BOS rule) and
knows the template's turn-stop tokens. ChatSession is a conversation over one engine: each turn
renders the whole conversation and hands the tokens to the engine, which evaluates only what its
KV cache does not hold yet. To keep the cache reusable, the tokens of the history are the ones the
model actually produced: when the new render extends the text of the history (the usual case),
only the new text is tokenized and appended to them.

    turn 1: [render(u1) -> tokens P1] + answer tokens A1 (incl. its end-of-turn token)
    turn 2: P1 + A1 + tokenize(render(u1, a1, u2)[len(render(u1) + a1 + eot):])
            -> the engine evaluates the last token of A1 (sampled, never decoded) + the delta
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels.chat_template import ChatTemplate, template_for
from specrun.kernels.engine import Engine
from specrun.kernels.llama import Model
from specrun.kernels.params import parse_spec_types
from specrun.kernels.stats import GenStats
from specrun.kernels.types import SamplingParams

from .text import TextRun

ROLES = ("system", "user", "assistant")

_ANSWER, _USER = "\x1fspecrun-answer\x1f", "\x1fspecrun-user\x1f"


class ContextFull(SpecrunError):
    """A message that does not fit the context even with every earlier turn dropped."""


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """A chat template bound to a model: messages -> prompt text -> tokens, with one BOS rule for
    every front end, and the turn-stop tokens that end an answer."""

    template: ChatTemplate
    model: Model
    stop_tokens: frozenset[int]

    @classmethod
    def of(cls, template: ChatTemplate, model: Model) -> ChatFormat:
        """Binds template to model. raises TemplateError when the template cannot render a
        two-turn probe conversation (checked at start, so no request is blamed for it later)."""
        return cls(template, model, _turn_stop_tokens(template, model))

    @classmethod
    def load(cls, model: Model, override_path: str | None = None) -> ChatFormat:
        """The model's own template, or the Jinja file given with --chat-template."""
        return cls.of(template_for(model, override_path), model)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def tokenize(self, text: str) -> list[int]:
        """A whole rendered prompt -> tokens: the model's BOS is added (when it adds one) unless
        the template already wrote it."""
        bos = self.template.bos_token
        add = not (bos and text.startswith(bos))
        return [int(t) for t in self.model.tokenize(text, add_special=add)]

    def prompt(self, messages: list[dict]) -> tuple[list[int], str]:
        """The tokens and text of messages rendered with the generation prompt."""
        text = self.render(messages)
        return self.tokenize(text), text


def _turn_stop_tokens(template: ChatTemplate, model: Model) -> frozenset[int]:
    """The control tokens of the text the template puts between an answer and the next user
    message (ChatML: <|im_end|>, <|im_start|>; Gemma: <end_of_turn>, <start_of_turn>). A model
    that emits one has finished its turn, or started the next one on its own."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _ANSWER},
            {"role": "user", "content": _USER}]
    text = template.render(msgs, add_generation_prompt=False)
    template.render(msgs[:1], add_generation_prompt=True)
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

    def __init__(self, engine: Engine, template: ChatTemplate | ChatFormat, sampling: SamplingParams | None = None,
                 n_predict: int = -1, system_prompt: str | None = None) -> None:
        self.engine = engine
        self.format = template if isinstance(template, ChatFormat) else ChatFormat.of(template, engine.model)
        self.template = self.format.template
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.n_predict = n_predict
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.messages: list[dict] = list(self.system)
        self.stats = SessionStats()
        self.last: Turn | None = None
        self._checkpoints: list[_Checkpoint] = []     # longest first
        # try the template once now, so a template that cannot take this conversation fails at start
        self.format.render([*self.messages, {"role": "user", "content": "hi"}])

    @property
    def stop_tokens(self) -> frozenset[int]:
        return self.format.stop_tokens

    # -- prompt ------------------------------------------------------------------------------
    def prompt_for(self, messages: list[dict]) -> tuple[list[int], str]:
        """The tokens and text of messages rendered with the generation prompt, extending the
        tokens of the history when the render extends its text."""
        text = self.format.render(messages)
        for cp in self._checkpoints:
            if text.startswith(cp.text):
                delta = self.engine.tokenize(text[len(cp.text):], add_special=False)
                return cp.tokens + [int(t) for t in delta], text
        return self.format.tokenize(text), text

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
        run = TextRun(self.engine.generate(tokens, self.n_predict, self.sampling), self.engine.model,
                      stop_tokens=self.stop_tokens)
        failed = False
        try:
            yield from run
        except Exception:
            failed = True
            raise
        finally:
            run.close()
            if failed:          # an engine error: the turn did not happen
                self.messages = before
                self._checkpoints = []
            else:
                c = run.result
                self._finish(tokens, rendered, c.tokens, c.text, Turn(c.text, c.tokens, c.stop, c.stats, dropped))

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

"""Tokens -> text, for every front end: UTF-8 pieces completed across tokens, OpenAI's stop
strings, and a chat template's turn-stop tokens.

    run = TextRun(engine.generate(...), model, stops=("\\n\\n",), stop_tokens=fmt.stop_tokens)
    for piece in run: ...          # text as soon as it is decided
    run.result                     # Completion: the whole text, the tokens, why it stopped, stats
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from specrun.kernels.engine import Generation
from specrun.kernels.llama import Model
from specrun.kernels.stats import GenStats


class TextStream:
    """Token pieces -> text, holding back incomplete UTF-8 sequences; end-of-generation tokens
    render as nothing."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tokens) -> str:
        return self.dec.decode(b"".join(self.model.piece(t) for t in tokens if not self.model.is_eog(t)))

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)


class StopScanner:
    """Text -> text with OpenAI's `stop`: the output ends before the first stop string, and a tail
    that could still become one is held back until it is decided (llama-server's partial stop)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.sent = 0
        self.hit: str | None = None

    def push(self, s: str) -> str:
        """Add text; return what can be sent now."""
        if self.hit is not None:
            return ""
        self.text += s
        found = [(i, w) for w in self.stops if (i := self.text.find(w, self.sent)) >= 0]
        if found:
            i, self.hit = min(found)
            self.text = self.text[:i]
            return self._release(i)
        hold = 0
        for w in self.stops:
            for k in range(min(len(w) - 1, len(self.text) - self.sent), hold, -1):
                if self.text.endswith(w[:k]):
                    hold = k
                    break
        return self._release(len(self.text) - hold)

    def flush(self) -> str:
        return self._release(len(self.text))

    def copy(self) -> StopScanner:
        c = StopScanner(self.stops)
        c.text, c.sent, c.hit = self.text, self.sent, self.hit
        return c

    def _release(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = end
        return out


@dataclass(frozen=True, slots=True)
class Completion:
    """What one generation wrote.

    text:   all of it, up to a stop string (a held-back tail included when it was cut short)
    tokens: as generated, up to and including an end-of-generation token or the token that completes
            a stop string, as plain decoding stops there (a pass's accepted tokens after it are not
            part of the output, nor of stats.n_gen); without a turn-stop token
    stop:   eog | n_predict | ctx (the engine's reasons) | word (a stop string) | turn (the model began
            a new turn: a control token of the template's turn separator) | interrupted
    """

    text: str
    tokens: list[int]
    stop: str
    stopping_word: str
    stats: GenStats


class TextRun:
    """The text of one Generation. Iterate for the pieces as they are decided; `result` is set
    once the iteration ends, breaks or is closed. cancel(): checked after each accepted chunk."""

    def __init__(self, gen: Generation, model: Model, *, stops: tuple[str, ...] = (),
                 stop_tokens: frozenset[int] = frozenset(), cancel: Callable[[], bool] | None = None) -> None:
        self.gen = gen
        self.model = model
        self.stop_tokens = stop_tokens
        self.cancel = cancel
        self.result: Completion | None = None
        self._stream = TextStream(model)
        self._scan = StopScanner(stops)
        self._tokens: list[int] = []
        self._dropped = 0                # tokens a pass emitted after the stop (not in stats.n_gen)
        self._pieces = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def close(self) -> None:
        self._pieces.close()
        if self.result is None:          # never started
            self._finish("")

    def _run(self) -> Iterator[str]:
        stop = ""
        try:
            for toks in self.gen:
                n = len(toks)
                for j, t in enumerate(toks):
                    if t in self.stop_tokens and not self.model.is_eog(t):
                        n, stop = j, "turn"
                        self._dropped = len(toks) - j - 1    # plain decoding stops at the turn token
                        break
                before = (self._stream.dec.getstate(), self._scan.copy()) if n and self._scan.stops else None
                self._tokens.extend(toks[:n])
                if out := self._scan.push(self._stream.push(toks[:n])):
                    yield out
                if self._scan.hit is not None:
                    stop = "word"
                    if before is not None:      # the tokens after the one that completed the stop string
                        k = _completing(self.model, toks[:n], *before)
                        del self._tokens[len(self._tokens) - (n - k):]
                        self._dropped = len(toks) - k
                if stop:
                    break
                if self.cancel is not None and self.cancel():
                    stop = "interrupted"
                    break
            if stop != "word":           # ended, or stopped at a turn token: release what is held
                out = self._scan.push(self._stream.flush())
                if self._scan.hit is None:
                    out += self._scan.flush()
                else:
                    stop = "word"
                if out:
                    yield out
        finally:
            self.gen.close()
            self._finish(stop)

    def _finish(self, stop: str) -> None:
        if self.result is not None:
            return
        if self._scan.hit is None:       # cut short: the text held back still belongs to the answer
            self._scan.push(self._stream.flush())
        st = self.gen.stats
        st.n_gen -= self._dropped        # set by the engine when the generation closed
        stop = stop or (st.stop if st.stop not in ("", "interrupted") else "interrupted")
        self.result = Completion(self._scan.text, self._tokens, stop, self._scan.hit or "", st)


def _completing(model: Model, toks: list[int], dec_state: tuple, scan: StopScanner) -> int:
    """How many of toks (pushed as one chunk, from the decoder state and scanner before it) it takes
    to complete the stop string the chunk completed: pushed one at a time, as plain decoding does."""
    stream = TextStream(model)
    stream.dec.setstate(dec_state)
    for k, t in enumerate(toks, 1):
        scan.push(stream.push([t]))
        if scan.hit is not None:
            return k
    return len(toks)

"""Dataclasses that cross module boundaries inside kernels and out to the CLI.

Vocabulary follows llama.cpp's common/speculative.cpp: target / draft, id_last (the last
emitted token, not yet decoded by the target), n_past (its position), n_draft, n_accept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "random seed" marker


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """llama.cpp's defaults. temp <= 0 means greedy (argmax, first index on ties).

    The controls below (llama.cpp's --repeat-penalty ... --grammar) change the target's logits
    before top-k: they are applied to every row the target computes, with the state of the
    tokens before that row (kernels.constrain), so speculative output still equals plain decoding.
    """

    temp: float = 0.8
    top_k: int = 40          # <= 0: whole vocabulary
    top_p: float = 0.95      # 1.0: off
    min_p: float = 0.05      # 0.0: off
    seed: int = LLAMA_DEFAULT_SEED
    repeat_penalty: float = 1.0        # 1.0: off
    repeat_last_n: int = 64            # the penalties' window: last n tokens of prompt + output; 0: off; >= 0
    presence_penalty: float = 0.0      # 0.0: off
    frequency_penalty: float = 0.0     # 0.0: off
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit); -inf bans it
    ignore_eos: bool = False           # end-of-generation tokens get logit -inf (llama.cpp's EOG logit bias)
    grammar: str | None = None         # GBNF (a JSON schema is converted first: kernels.grammar.schema_to_gbnf)

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether the penalties change anything (llama.cpp's early return in llama_sampler_penalties)."""
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)

    @property
    def constrained(self) -> bool:
        """Whether any control changes the target's logits (else rows are used as computed)."""
        return self.penalized or bool(self.logit_bias) or self.ignore_eos or bool(self.grammar)


@dataclass(frozen=True, slots=True)
class Draft:
    """What a drafter proposes for the positions after id_last.

    tokens: int32 [k], k may be 0 (no draft this step).
    probs:  float32 [k, n_vocab], the drafter's distribution q at each drafted position (after
            the same temperature/top-k/top-p/min-p transforms as the target), or None for a
            deterministic proposer (n-grams, greedy drafting): one-hot q.
    kind:   where a copy drafter found it ("": its one source; suffix: "own" or "global"); the
            adaptive length learns each kind's acceptance apart (DraftLength)
    """

    tokens: np.ndarray
    probs: np.ndarray | None = None
    kind: str = ""

    @staticmethod
    def empty() -> Draft:
        return _EMPTY_DRAFT

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


_EMPTY_DRAFT = Draft(np.zeros(0, dtype=np.int32), None)


def draft_head(d: Draft, k: int) -> Draft:
    """The draft's first k tokens (d itself when it has no more)."""
    return d if k >= len(d) else Draft(d.tokens[:k], None if d.probs is None else d.probs[:k], d.kind)


@dataclass(frozen=True, slots=True)
class Stops:
    """Where a request's text ends besides an end-of-generation token: its stop strings (UTF-8)
    and stop tokens (a chat template's end of turn). The caller stops there; the engine only uses
    them to verify no draft token past the end (draft_end)."""

    strings: tuple[bytes, ...] = ()
    tokens: frozenset[int] = frozenset()

    @staticmethod
    def of(strings: Sequence[str] = (), tokens: Iterable[int] = ()) -> Stops:
        return Stops(tuple(w.encode("utf-8") for w in strings if w), frozenset(tokens))


NO_STOPS = Stops()


def draft_end(draft: np.ndarray, text: np.ndarray, stops: Stops, piece: Callable[[int], bytes],
              is_eog: Callable[[int], bool]) -> int:
    """How many tokens of draft (int32 [k]) after text (int32 [n]) are worth verifying: up to and
    including the first one where plain decoding would end (an end-of-generation or stop token, or
    the token whose bytes complete a stop string, by bytes across the text's tail); k if none.
    Tokens past it are never emitted, so verifying them only costs rows. A stop string that lies
    in the text already does not count."""
    if not len(draft):
        return 0
    longest = max(map(len, stops.strings), default=0)
    tail = b""
    i = len(text)
    while longest > 1 and i > 0 and len(tail) < longest - 1:
        i -= 1
        tail = piece(int(text[i])) + tail
    for j, t in enumerate(draft.tolist()):
        if is_eog(t) or t in stops.tokens:
            return j + 1
        if longest:
            new = tail + piece(t)
            if any(new.find(w, max(0, len(tail) - len(w) + 1)) >= 0 for w in stops.strings):
                return j + 1
            tail = new[-(longest - 1):] if longest > 1 else b""
    return len(draft)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of verifying one draft.

    n_accepted: how many draft tokens were accepted (0..k).
    tokens:     int32 [n_accepted + 1]: the accepted draft tokens, then one token from the
                target: the *recovered* token at the first rejection, or the *bonus* token when
                all k were accepted.  Example: draft [a, b, c], target samples [a, x, ...] ->
                n_accepted=1, tokens=[a, x] (x recovered).  Draft [a, b], target [a, b, y] ->
                n_accepted=2, tokens=[a, b, y] (y bonus).
    """

    n_accepted: int
    tokens: np.ndarray


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """An emitted token's log-probability under the target (its raw logits at that position,
    temperature 1, before any sampling transform), and the n most likely tokens there, best first.
    In exact mode these come from bit-identical logits rows, so they are the same with any spec type.

    These are llama-server's numbers without post_sampling_probs (its default: populate_token_probs
    reads get_token_probabilities, the softmax of llama_get_logits_ith): the logit bias, penalties,
    grammar, top-k/p, min-p and temperature do not change them. So under a grammar that allows one
    token, `top` can hold tokens it forbids, and the emitted token's logprob is what the model alone
    gives it (it may be far below top[0]); a token banned by a -inf bias keeps its raw logprob."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, n_top: int = 0) -> TokenLogprob:
    """logits: float32 [n_vocab], the target's row for the position of `token`."""
    x = logits.astype(np.float64)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        idx = np.argpartition(-x, min(n_top, x.size - 1))[:n_top]
        idx = idx[np.lexsort((idx, -x[idx]))]              # best first; ties: lower id first
        top = tuple((int(i), float(x[i] - lse)) for i in idx)
    return TokenLogprob(int(token), float(x[token] - lse), top)


@dataclass(frozen=True, slots=True)
class TargetPass:
    """One target decode: tokens int32 [n] at positions pos0..pos0+n-1, of which the first n_keep
    stay in the target's KV cache (a prompt chunk keeps all; a verify pass [id_last, d1..dk] keeps
    n_accepted + 1). hidden: float32 [n, n_embd_out], the target's final-norm rows that MTP heads
    read, or None when no drafter needs them. features: float32 [n, 3 * n_embd], the inputs of an
    EAGLE-3 draft's three extract layers (low | mid | high) per token, or None. Arrays are views
    or copies valid until the next decode."""

    tokens: np.ndarray
    pos0: int
    n_keep: int
    hidden: np.ndarray | None = None
    features: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class DraftOptions:
    """How to draft during one generation.

    p_min:    greedy drafting stops when the drafter's top-1 probability falls below it.
    sampling: the target's sampling, when drafts are sampled from the drafter's distribution q
              (rejection verification at temperature > 0); None: greedy top-1 drafts.
    """

    p_min: float = 0.0
    sampling: SamplingParams | None = None


class Drafter(Protocol):
    """One lifecycle for every drafter (llama.cpp's common_speculative: begin / draft / accept).

    begin(prompt, n_keep, opts) -> int
        A generation starts. prompt: int32 [n], every token the target will hold before the first
        emitted token; the target's KV already holds prompt[:n_keep] and evaluates the rest (in
        chunks, each reported through accept()). Returns how many leading positions the drafter
        can follow from (<= n_keep); the engine re-evaluates from the smallest answer.
    propose(ctx, n_max) -> Draft
        ctx: int32 [L] = prompt + emitted tokens, ending with id_last (not yet decoded by the
        target). Returns 0..n_max tokens to follow id_last; never more than n_max.
    accept(tp)
        The target evaluated tp (a prompt chunk or a verify pass) and keeps tp.n_keep of its rows:
        drafters that follow the target's positions (MTP) take its hidden rows and drop the rest.
    close()
        Free native resources; idempotent.
    """

    spec_type: ClassVar[str]      # exactly the --spec-type string
    needs_hidden: ClassVar[bool]  # whether accept() needs the target's rows (TargetPass.hidden / .features)

    def begin(self, prompt: np.ndarray, n_keep: int, opts: DraftOptions) -> int: ...

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft: ...

    def accept(self, tp: TargetPass) -> None: ...

    def close(self) -> None: ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    a, b = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else n

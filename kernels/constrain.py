"""The logit controls of one generation, applied to every target row with the state of the
tokens before it: logit bias (and --ignore-eos), repetition penalties, a grammar.

Plain decoding transforms the row that predicts position pos with the penalty window and grammar
state after every token before pos. A verify pass over [id_last, d1..dk] computes rows 0..k;
row i predicts the token after d_i, so it is transformed with the state after id_last, d1..di:
exactly the state plain decoding has there if d1..di are what it emitted, and the verifiers only
read row i once d1..di are accepted (sample-and-match stops at the first mismatch, speculative
sampling at the first rejection). So the emitted tokens equal plain decoding's, token for token,
under the same conditions as without controls (README: exact mode, `--spec-verify match`).

Rows are transformed lazily (Rows), when the verifier reads them. Before the target pass, a
draft is cut at its first token the constrained target can never emit there (a token banned by
a -inf logit bias or by --ignore-eos, or one the grammar forbids): sample-and-match would reject
it anyway with the same target sample, and rows past it would need a grammar state that cannot
exist. Drafters propose freely: their distribution q (draft models, MTP heads) is not
constrained, and speculative sampling stays exact in distribution because it accepts with
min(1, p/q) and resamples from norm(max(0, p - q)) where p is the constrained target: any q
works, a token with p = 0 is never accepted (q only sets how often drafts are accepted).

The order is llama.cpp's (common/sampling.cpp): the grammar, then the logit bias, then the
penalties, then top-k -> top-p -> min-p -> temperature (kernels.sampling). The grammar is
llama.cpp's own sampler (kernels.grammar) and, like llama.cpp's grammar-first sampling, it
removes tokens before top-k; to keep a 262k vocabulary cheap it is asked only about the best
tokens, in growing bands, until the top-k (greedy: the best) allowed ones are known, which is all
the chain after it reads; with --top-k 0 it judges the whole vocabulary.
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from specrun.gguf_spec.errors import SpecrunError

from .grammar import Grammar
from .llama import Model
from .sampling import penalize
from .types import Draft, SamplingParams

_EOG_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FIRST_BAND = 64   # tokens the grammar judges first; the band grows x4 until top-k allowed are known
MAX_ABS = 1e6      # penalties and finite biases beyond this could overflow float32 logits (NaN rows)


def check_controls(s: SamplingParams, names: dict[str, str] | None = None) -> None:
    """llama.cpp's checks of the controls (common_sampler_init: the penalties finite in float32,
    the repeat penalty > 0 with a finite inverse; common/arg.cpp: --repeat-last-n >= 0), plus bounds
    that keep float32 logits finite: a finite temperature, top-p and min-p in 0..1 (not NaN).
    SpecrunError naming the value and the fix; names: how to call each field (default: its name,
    e.g. the CLI passes {"repeat_penalty": "--repeat-penalty"}). Token ids are checked by Constraints."""
    def name(field: str) -> str:
        return (names or {}).get(field, field)

    if not math.isfinite(s.temp):
        raise SpecrunError(f"{name('temp')} {s.temp}: give a finite temperature (<= 0: greedy)")
    for field in ("top_p", "min_p"):     # NaN passes a range check: every comparison is false
        v = getattr(s, field)
        if not 0.0 <= v <= 1.0:
            raise SpecrunError(f"{name(field)} {v}: give a number from 0 to 1")
    rp = s.repeat_penalty
    if not (math.isfinite(rp) and 1.0 / MAX_ABS <= rp <= MAX_ABS):
        raise SpecrunError(f"{name('repeat_penalty')} {rp}: give a number greater than 0 (1.0: off; between "
                           "1e-6 and 1e6)")
    for field in ("frequency_penalty", "presence_penalty"):
        v = getattr(s, field)
        if not (math.isfinite(v) and abs(v) <= MAX_ABS):
            raise SpecrunError(f"{name(field)} {v}: give a finite number (0.0: off; at most 1e6 either way)")
    if s.repeat_last_n < 0:    # llama.cpp 0.3.36 refuses it too: -1 no longer means the context size
        raise SpecrunError(f"{name('repeat_last_n')} {s.repeat_last_n}: invalid repeat-last-n (llama.cpp refuses "
                           "negative values too); give the last N tokens the penalties look at (0: off)")
    for tok, bias in s.logit_bias:
        if math.isnan(bias) or (bias != -math.inf and abs(bias) > MAX_ABS):
            raise SpecrunError(f"{name('logit_bias')} {bias} for token {tok}: give a finite number (at most 1e6 "
                               "either way), or -inf to ban the token")


def eog_ids(model: Model) -> np.ndarray:
    """int64 [n]: the model's end-of-generation tokens (computed once per model)."""
    ids = _EOG_IDS.get(model)
    if ids is None:
        ids = np.flatnonzero([model.is_eog(t) for t in range(model.n_vocab)])
        _EOG_IDS[model] = ids
    return ids


class Constraints:
    """One generation's controls and their state: the penalty window (prompt + emitted tokens)
    and the grammar state after the emitted tokens. None of it exists when sampling has none
    (Constraints.of returns None and rows are used as the target computed them)."""

    @classmethod
    def of(cls, model: Model, sampling: SamplingParams, n_ctx: int, prompt: np.ndarray) -> Constraints | None:
        return cls(model, sampling, n_ctx, prompt) if sampling.constrained else None

    def __init__(self, model: Model, sampling: SamplingParams, n_ctx: int, prompt: np.ndarray) -> None:
        self.model = model
        self.sampling = s = sampling
        check_controls(s)
        n_vocab = model.n_vocab
        ids, vals = [], []
        for tok, bias in s.logit_bias:
            if not 0 <= tok < n_vocab:
                raise SpecrunError(f"logit bias for token {tok}: the vocabulary has {n_vocab} tokens "
                                   f"(0..{n_vocab - 1}); give a token id in it")
            ids.append(tok)
            vals.append(bias)
        if s.ignore_eos:                         # llama.cpp: logit bias -INFINITY for every EOG token
            eog = eog_ids(model)
            ids.extend(eog.tolist())
            vals.extend([-np.inf] * len(eog))
        self.bias_ids = np.asarray(ids, dtype=np.int64)
        self.bias_vals = np.asarray(vals, dtype=np.float32)
        self.banned = np.zeros(n_vocab, dtype=bool)       # -inf bias: never emitted
        self.banned[self.bias_ids[self.bias_vals == -np.inf]] = True
        self.last_n = s.repeat_last_n if s.penalized else 0      # >= 0 (check_controls); n_ctx: unused
        self.history = np.asarray(prompt[-self.last_n:] if self.last_n else [], dtype=np.int64)
        # greedy reads the best token, sampling the top-k; without top-k the whole row
        self.need = 1 if s.greedy else s.top_k if 0 < s.top_k < n_vocab else n_vocab
        eos = model.eos if model.eos >= 0 else (int(eog_ids(model)[0]) if len(eog_ids(model)) else -1)
        self.end_token = eos
        self.grammar = Grammar(model, s.grammar) if s.grammar else None

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()
            self.grammar = None

    # -- one row ---------------------------------------------------------------------------
    def row(self, logits: np.ndarray, prefix: np.ndarray | None = None, grammar: Grammar | None = None) -> np.ndarray:
        """float32 [n_vocab]: logits (the target's row after the emitted tokens and prefix) under the
        controls; grammar: the grammar's state after prefix (None: this generation's current one).
        Where nothing at all may follow (a complete grammar with --ignore-eos, everything banned),
        the row holds only the end token: the text ends there, as at end of generation."""
        x = np.array(logits, dtype=np.float32, copy=True)
        if self.bias_ids.size:
            np.add.at(x, self.bias_ids, self.bias_vals)
        if self.last_n:
            window = self.history if prefix is None or len(prefix) == 0 else \
                np.concatenate([self.history, np.asarray(prefix, dtype=np.int64)])
            s = self.sampling
            x = penalize(x, window[-self.last_n:], s.repeat_penalty, s.frequency_penalty,
                         s.presence_penalty)
        g = grammar if grammar is not None else self.grammar
        if g is not None:
            self._mask(x, g)
        if not x.max() > -np.inf:
            if self.end_token < 0:
                raise SpecrunError("no token may follow here (the grammar and the logit bias forbid them all) "
                                   "and the model has no end-of-generation token; loosen the grammar or the bias")
            x[:] = -np.inf
            x[self.end_token] = 0.0
        return x

    def _mask(self, x: np.ndarray, g: Grammar) -> None:
        """Set to -inf, in place, the tokens of x the grammar forbids, judging only as many as the
        chain reads: first the best max(64, 2 * need) tokens (every x >= the threshold, ties
        included); when `need` of them are allowed, every token below is set to -inf too (none of
        them can be among the top `need` allowed ones). Otherwise the grammar is restrictive here
        (a JSON brace, a digit) and judges every remaining token."""
        finite = x > -np.inf
        n_fin = int(np.count_nonzero(finite))
        c = max(_FIRST_BAND, 2 * self.need)
        if c < n_fin:
            n = x.shape[0]
            thr = x[np.argpartition(x, n - c)[n - c]]                  # the c-th largest value
            band = np.flatnonzero(x >= thr)
            ok = g.allowed(band)
            if np.count_nonzero(ok) >= self.need:
                keep = band[ok]
                vals = x[keep]
                x[:] = -np.inf
                x[keep] = vals
                return
            rest = np.flatnonzero(finite & (x < thr))
            x[band[~ok]] = -np.inf
        else:
            rest = np.flatnonzero(finite)
        ok = g.allowed(rest)
        x[rest[~ok]] = -np.inf

    # -- a verify pass ----------------------------------------------------------------------
    def verify_pass(self, draft: Draft) -> VerifyPass:
        """The draft cut at its first token the constrained target cannot emit there, with the
        grammar state after each of its prefixes (row i of the pass reads state i)."""
        states: list[Grammar | None] = [self.grammar]
        m = len(draft)
        for i in range(len(draft)):
            t = int(draft.tokens[i])
            if self.banned[t]:
                m = i
                break
            if self.grammar is not None:
                g = states[i].then(t)
                if g is None:
                    m = i
                    break
                states.append(g)
            else:
                states.append(None)
        if m < len(draft):
            draft = Draft(draft.tokens[:m], None if draft.probs is None else draft.probs[:m])
        return VerifyPass(self, draft, states[:m + 1], states[m + 1:])

    def accept(self, tokens) -> None:
        """The emitted tokens (in order): into the penalty window and the grammar. An end-of-
        generation token ends the text, so the grammar never takes one (llama.cpp aborts on one it
        does not allow)."""
        if self.last_n:
            self.history = np.concatenate([self.history, np.asarray(tokens, dtype=np.int64)])[-self.last_n:]
        if self.grammar is not None:
            for t in tokens:
                if not self.model.is_eog(int(t)):
                    self.grammar.accept(int(t))


class VerifyPass:
    """A (possibly cut) draft and the grammar states of its prefixes; rows(raw) transforms the
    target's rows for it. close() frees the states."""

    def __init__(self, cons: Constraints, draft: Draft, states: list, unused: list) -> None:
        self.cons = cons
        self.draft = draft
        self.states = states
        for g in unused:
            g.close()

    def rows(self, raw: np.ndarray) -> Rows:
        return Rows(self, raw)

    def close(self) -> None:
        for g in self.states[1:]:
            if g is not None:
                g.close()
        self.states = []


class Rows:
    """The rows of a verify pass under the controls, transformed when read (the verifiers read
    them in order and stop early). raw: float32 [k + 1, n_vocab], the target's rows (a view,
    valid until the next decode). Indexing by row number gives float32 [n_vocab]."""

    ndim = 2

    def __init__(self, vp: VerifyPass, raw: np.ndarray) -> None:
        self.vp = vp
        self.raw = raw
        self.shape = raw.shape
        self._done: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> np.ndarray:
        row = self._done.get(i)
        if row is None:
            vp = self.vp
            grammar = vp.states[i] if vp.cons.grammar is not None else None
            row = vp.cons.row(self.raw[i], vp.draft.tokens[:i], grammar)
            self._done[i] = row
        return row

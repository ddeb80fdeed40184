"""What every drafter shares: the narrow view of the target it is built with, the model drafters'
KV rows and the rule that turns their logits into one drafted token, and the n-gram drafters'
index of the history and their way to tell which verify pass was theirs."""

from __future__ import annotations

import logging
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specrun.gguf_spec.errors import SpecrunError

from ..llama import Context, Model
from ..sampling import NonFiniteLogits, inverse_cdf, position_rng, transform
from ..types import Draft, DraftOptions, SamplingParams, TargetPass, common_prefix

_DRAFT_STREAM = 3  # random stream of draft sampling, apart from the target's (0, 1, 2)
log = logging.getLogger(__name__)
_said_non_finite = False


def _non_finite(pos: int) -> tuple[None, None]:
    """A draft row with no finite maximum (NaN weights, a broken file): stop this draft. The
    target decides every token, so the text stays plain decoding's; only the drafts are lost."""
    global _said_non_finite
    if not _said_non_finite:
        _said_non_finite = True
        log.warning("the draft's logits at position %d have no finite maximum (NaN or infinite values in the "
                    "draft model); drafts stop there, the output is the target's alone", pos)
    return None, None


@dataclass(frozen=True, slots=True)
class TargetView:
    """What a drafter may know of the target: its weights (vocabulary, width, MTP heads), its
    context (an MTP context links to it as ctx_other), and the sizes to build its own contexts with.
    Never the engine: drafters learn about the target's passes only through accept()."""

    model: Model
    ctx: Context
    n_ctx: int
    n_batch: int
    n_threads: int
    exact: bool
    fast_prefill: bool = False   # the target evaluates long prompts through kernels/prefill.py


def softmax_max(logits: np.ndarray, i: int | None = None) -> tuple[int, float]:
    """(argmax, its probability at temperature 1) of float32 [n_vocab] logits (i: the argmax, known)."""
    i = int(np.argmax(logits)) if i is None else i
    m = float(logits[i])
    return i, 1.0 / float(np.exp(logits.astype(np.float64) - m).sum())


def draft_token(logits: np.ndarray, sampling: SamplingParams | None, p_min: float,
                pos: int) -> tuple[int | None, np.ndarray | None]:
    """One drafted token from a drafter's logits (float32 [n_vocab]) for absolute position pos.

    sampling set and not greedy: drawn from q = transform(logits) with the draft stream of
    (seed, pos); returns (token, q as float32 [n_vocab]). Otherwise greedy top-1, or (None, None)
    when its probability is below p_min (stop drafting), or when the logits have no finite maximum."""
    if sampling is not None and not sampling.greedy:
        try:
            q = transform(logits, sampling)                            # [n_vocab] float64
        except NonFiniteLogits:
            return _non_finite(pos)
        u = position_rng(sampling.seed, pos, _DRAFT_STREAM).random()
        return int(inverse_cdf(q, u)), q.astype(np.float32)
    tok = int(logits.argmax())                                          # numpy: the first NaN when there is one
    if not -np.inf < logits[tok]:
        return _non_finite(pos)
    p = softmax_max(logits, tok)[1] if p_min > 0 else 1.0
    return (None, None) if p < p_min else (tok, None)


class DraftRows:
    """The rows of a draft context that reads the target's rows (draft-mtp, draft-eagle3): row p
    is (text[p + shift], hidden[p]) at position p, and the last row is id_last's. MTP's row reads
    its own token (shift 0); EAGLE-3's decoder row reads the next one (shift 1).

    The drafter tells changed(p) when hidden[p..] changed (a target pass handed over new rows);
    write() then brings the KV to the rows of the current text, evaluating only what differs."""

    def __init__(self, ctx: Context, shift: int, name: str) -> None:
        self.ctx, self.shift, self.name = ctx, shift, name
        self.tokens: list[int] = []   # the tokens of the rows in the KV, positions 0..len-1
        self.fresh = 0                # hidden[p] for p >= fresh changed since the rows were written

    def changed(self, p: int) -> None:
        self.fresh = min(self.fresh, p)

    def write(self, text: list[int], tok: int, hidden: np.ndarray, last: int, logits: str) -> None:
        """Bring the KV to rows 0..n-1 (n = len(text) - shift + 1), the last one (tok = id_last,
        hidden[n-1]), and leave that row's logits for the first draft step.

        hidden: float32 [>= n, hidden_width]. A row p is kept while its token matches and
        p < fresh; below fresh - 1 both hold (the text and the rows from fresh on are what changed),
        so only the rows from there are compared: a pass costs what it adds, not the context's
        length. The last row is always evaluated. The rows go in batches of n_batch without
        outputs, then the last `last` of them in one batch with outputs `logits` ("last", or "all"
        where the graph selects no output rows: llama.cpp then hands back a batch's first rows)."""
        n = len(text) - self.shift + 1
        lo = max(0, min(self.fresh - 1, len(self.tokens), n - 1))
        want = text[lo + self.shift:] + [tok]          # rows lo..n-1
        keep = min(lo + common_prefix(self.tokens[lo:], want), self.fresh, n - 1)
        if len(self.tokens) > keep:
            if not self.ctx.seq_rm(keep, -1):
                raise SpecrunError(f"{self.name} context could not roll back to {keep} tokens")
            del self.tokens[keep:]
        nxt = np.asarray(want[keep - lo:], dtype=np.int32)
        tail = max(0, len(nxt) - min(last, self.ctx.n_batch))
        for s in [*range(0, tail, self.ctx.n_batch), tail]:
            m = min(self.ctx.n_batch, tail - s) if s < tail else len(nxt) - tail
            self.ctx.decode_with_hidden(nxt[s:s + m], keep + s, hidden[keep + s:keep + s + m],
                                        logits="none" if s < tail else logits)
        self.tokens.extend(want[keep - lo:])
        self.fresh = n


class DraftTokens:
    """One draft of a model drafter as it grows: add(logits, pos) drafts the token of absolute
    position pos by draft_token() and returns it (None: stop drafting); draft() is the Draft."""

    def __init__(self, sampling: SamplingParams | None, p_min: float) -> None:
        self.sampling, self.p_min = sampling, p_min
        self.tokens: list[int] = []
        self._qs: list[np.ndarray] = []     # float32 [n_vocab] each, when sampled

    def add(self, logits: np.ndarray, pos: int) -> int | None:
        tok, q = draft_token(logits, self.sampling, self.p_min, pos)
        if tok is not None:
            self.tokens.append(tok)
            if q is not None:
                self._qs.append(q)
        return tok

    def __len__(self) -> int:
        return len(self.tokens)

    def draft(self) -> Draft:
        return Draft(np.asarray(self.tokens, dtype=np.int32), np.stack(self._qs) if self._qs else None)


def draft_steps(ctx: Context, opts: DraftOptions, n_max: int, n_past: int, n_vocab: int, *, chained: bool,
                shift: int = 0, on_step: Callable[[int], None] | None = None) -> Draft:
    """A model drafter's draft loop. requires: ctx's last decode left, in its last row, the logits
    of the token after id_last (text position n_past).

    Step i drafts the token of text position n_past + 1 + i by draft_token() (opts) from the first
    n_vocab logits of ctx's last row. Before it, step i > 0 decodes step i - 1's token at ctx
    position n_past + i - shift (shift 1: EAGLE-3, whose row p reads the token of p + 1): by
    decode_chained() when chained (MTP, EAGLE-3: the row carries the last row's hidden state), else by
    decode() (a draft model); on_step(i) runs before that decode (an MTP with several heads picks
    head i). At most n_max tokens; the steps decode min(len(draft), n_max - 1) of them, the first
    ones.

    Greedy, without p_min and without on_step, the loop runs in C where it is built
    (Context.draft_chain); it drafts the same tokens as the Python loop below."""
    greedy = opts.sampling is None or opts.sampling.greedy
    if greedy and opts.p_min == 0 and on_step is None:
        toks = ctx.draft_chain(n_past - shift, n_max, n_vocab, chained=chained)
        if toks is not None:
            return Draft(toks, None)
    d = DraftTokens(opts.sampling, opts.p_min)
    tok: int | None = None
    for i in range(n_max):
        if i > 0:
            if on_step is not None:
                on_step(i)
            if chained:
                ctx.decode_chained(tok, n_past + i - shift)
            else:
                ctx.decode([tok], n_past + i - shift, "last")
        if (tok := d.add(ctx.logits_rows()[-1][:n_vocab], n_past + 1 + i)) is None:
            break
    return d.draft()


class NgramIndex:
    """Start positions of every n-gram (n tokens) of a token history, ascending, so that a lookup
    is a dict access and a bisect instead of llama.cpp's backward scan.

    sync(ctx) makes it cover ctx int32 [L] (every start j with j + n <= L): incrementally when ctx
    extends the history it covers, else rebuilt; returns True when it was rebuilt."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._seen = np.zeros(0, dtype=np.int32)   # int32 [n_seen]: the history covered
        self._starts: dict[bytes, list[int]] = {}

    def sync(self, ctx: np.ndarray) -> bool:
        n, n_seen = self.n, self._seen.shape[0]
        rebuilt = not (ctx.shape[0] >= n_seen and np.array_equal(ctx[:n_seen], self._seen))
        if rebuilt:
            self._starts = {}
        starts = self._starts
        for j in range(0 if rebuilt else max(0, n_seen - n + 1), ctx.shape[0] - n + 1):
            starts.setdefault(ctx[j : j + n].tobytes(), []).append(j)
        self._seen = ctx.copy()
        return rebuilt

    def last_in(self, key: np.ndarray, lo: int, hi: int) -> int:
        """The largest start j of key (int32 [n]) with lo < j <= hi; 0 when none (lo >= 0, so 0
        is never an answer: llama.cpp's "no match")."""
        starts = self._starts.get(key.tobytes(), ())
        i = bisect_right(starts, hi) - 1
        return starts[i] if i >= 0 and starts[i] > lo else 0

    def all_in(self, key: np.ndarray, lo: int, hi: int) -> list[int]:
        """Every start j of key with lo <= j <= hi, ascending."""
        starts = self._starts.get(key.tobytes(), [])
        return starts[bisect_left(starts, lo) : bisect_right(starts, hi)]


@dataclass(frozen=True, slots=True)
class Proposed:
    """A drafter's last non-empty draft: tokens int32 [k] to follow id_last at position pos.

    llama.cpp calls accept(n_accepted) only on the drafter whose draft was verified
    (common_speculative_accept: impl_last; the others get is_other). The engine tells every
    drafter about every pass, so a drafter keeps its draft and recognises its verify pass."""

    pos: int
    tokens: np.ndarray

    def n_accepted(self, tp: TargetPass) -> int | None:
        """How many of the tokens were accepted if tp is their verify pass [id_last, d1..dj] (j <= k:
        the engine may have cut the draft); None for any other pass (a prompt chunk, another
        drafter's draft, a plain step)."""
        j = tp.tokens.shape[0] - 1
        if tp.pos0 != self.pos or not 1 <= j <= self.tokens.shape[0] or not np.array_equal(tp.tokens[1:], self.tokens[:j]):
            return None
        return tp.n_keep - 1

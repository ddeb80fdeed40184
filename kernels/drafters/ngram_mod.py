"""The `ngram-mod` drafter: llama.cpp's common_ngram_mod (common/ngram-mod.cpp), driven as its
common_speculative_impl_ngram_mod drives it (common/speculative.cpp).

No model: a fixed pool of 2^22 slots maps the hash of every n_match-gram seen to the token that
followed it; a draft chains lookups from the last n_match tokens. Deterministic.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import numpy as np

from ..params import NgramModParams, SpecParams
from ..types import Draft, DraftOptions, TargetPass
from .base import Proposed, TargetView

log = logging.getLogger(__name__)

# llama.cpp common/ngram-mod.cpp and common_speculative_impl_ngram_mod
MULT = 6364136223846793005      # the hash: h = h * MULT + token over the n-gram, mod 2^64
POOL_SIZE = 4 * 1024 * 1024     # slots; the slot of an n-gram is h % POOL_SIZE (its low 22 bits)
ADD_EVERY = 32                  # new n-grams enter the pool once more than this many tokens wait
MAX_OCCUPANCY = 0.25            # begin() empties a pool fuller than this
LOW_ACCEPT = 0.25               # a draft with fewer accepted / drafted tokens is a low one ...
LOW_STREAK = 5                  # ... and this many in a row empty the pool

_MASK = POOL_SIZE - 1
_DEFAULTS = NgramModParams()    # llama.cpp common.h's
_MULT = MULT & _MASK            # h mod 2^22 needs only MULT mod 2^22 (POOL_SIZE divides 2^64)


def slots(tokens: np.ndarray, n: int) -> np.ndarray:
    """common_ngram_mod::idx of every n-gram of tokens (int32 [L]): int64 [L - n + 1], the slot of
    tokens[i : i + n] at i."""
    k = tokens.shape[0] - n + 1
    h = np.zeros(max(k, 0), dtype=np.int64)
    for j in range(n):
        h = (h * _MULT + tokens[j : j + k]) & _MASK
    return h


class NgramMod:
    """llama.cpp's `ngram-mod` rule, exactly; ctx = inp + [id_last], cur_len = len(inp), n = n_match.

    State kept across calls and generations (llama.cpp shares one pool between all server slots;
    here it belongs to the drafter, i.e. to one engine):
        pool     slot -> token, 2^22 slots; slot(g) = (sum over g of token * MULT^(n-1-i)) mod 2^22,
                 so different n-grams may share a slot: the last write wins
        i_last   inp[:i_last + n] has been added (each n-gram with the token after it)
        n_low    consecutive drafts with a low acceptance

    begin(prompt): i_last = 0; if len(prompt) >= n, every n-gram of prompt that has a next token
    (starts 0 .. len - n - 1) writes pool[slot] = next, i_last = len - n, and a pool more than a
    quarter full is emptied (i_last stays).
    propose(ctx, n_max):
    0. n_max <= 0: no draft and no change (llama.cpp does not call the drafter then).
    1. No draft if cur_len < n.
    2. If i_last + 32 < cur_len: the n-grams at starts i_last .. cur_len - n - 1 are added (pool[slot]
       = next, in order); i_last = cur_len - n. So the text since the last add enters in chunks.
    3. w = the last n tokens of ctx (id_last included). For i = 0 .. n_max_mod - 1: t = pool[slot(w)];
       an empty slot stops the chain, and with fewer than n_min tokens so far there is no draft at
       all; else t is drafted and w rolls on by one token (slot(w) is updated in O(1):
       h' = (h - w[0] * MULT^(n-1)) * MULT + t).
    4. The draft (n_min..n_max_mod tokens, or n_max_mod when every lookup succeeds, whatever n_min)
       is cut to n_max; its uncut length is kept for accept().
    accept(tp): for the verify pass of its own draft only: accepted / uncut length < 0.25 adds 1 to
    n_low (5 in a row: the pool is emptied, n_low = 0, i_last = 0, so the next draft adds the whole
    history again), otherwise n_low = 0.

    Example (n = 2): ctx = [a, b, c, a, b] (inp = [a, b, c, a], id_last = b): begin([a, b, c, a])
    added [a, b] -> c and [b, c] -> a; w = [a, b] -> c, then [b, c] -> a, then [c, a] -> empty:
    with n_min <= 2 the draft is [c, a].
    """

    spec_type: ClassVar[str] = "ngram-mod"
    needs_hidden: ClassVar[bool] = False

    def __init__(self, n_match: int = _DEFAULTS.n_match, n_min: int = _DEFAULTS.n_min, n_max: int = _DEFAULTS.n_max):
        if not (1 <= n_match <= 1024 and 0 <= n_min <= 1024 and 0 <= n_max <= 1024):
            raise ValueError(f"ngram-mod needs 1 <= n_match <= 1024 and 0 <= n_min, n_max <= 1024 "
                             f"(got n_match={n_match}, n_min={n_min}, n_max={n_max})")
        if n_match < 16:
            log.warning("ngram_mod n_match=%d is too small - poor quality is possible, "
                        "see: https://github.com/ggml-org/llama.cpp/pull/19164", n_match)
        self.n_match, self.n_min, self.n_max = n_match, n_min, n_max
        self._top = pow(MULT, n_match - 1, POOL_SIZE)       # MULT^(n-1) mod 2^22, to roll the window
        self.pool: dict[int, int] = {}                       # slot -> token (absent: EMPTY)
        self._i_last = 0
        self._n_low = 0
        self._n_draft_last = 0
        self._proposed: Proposed | None = None

    @classmethod
    def from_spec(cls, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                  heads_path: str | None = None) -> NgramMod:
        """A drafter with spec's settings (what drafters.make_drafter calls)."""
        return cls(spec.ngram_mod.n_match, spec.ngram_mod.n_min, spec.ngram_mod.n_max)

    def begin(self, prompt: np.ndarray, n_keep: int = 0, opts: DraftOptions | None = None) -> int:
        """Adds the prompt's n-grams (see the class docstring). No model state: any KV reuse suits it."""
        prompt = np.asarray(prompt, dtype=np.int32)
        self._i_last = self._n_draft_last = 0
        self._proposed = None
        n = self.n_match
        if prompt.shape[0] >= n:
            self._add(prompt, 0, prompt.shape[0] - n)
            self._i_last = prompt.shape[0] - n
            if len(self.pool) / POOL_SIZE > MAX_OCCUPANCY:
                log.warning("ngram_mod occupancy %.2f exceeds threshold (%.2f) - resetting",
                            len(self.pool) / POOL_SIZE, MAX_OCCUPANCY)
                self.pool.clear()
        return n_keep

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        """ctx: int32 [L] = history + [id_last]. Returns 0..min(n_max, n_max_mod) tokens."""
        self._proposed = None
        if n_max <= 0:
            return Draft.empty()
        ctx = np.asarray(ctx, dtype=np.int32)
        n, cur = self.n_match, ctx.shape[0] - 1
        self._n_draft_last = 0
        if cur < n:
            return Draft.empty()
        if self._i_last + ADD_EVERY < cur:
            self._add(ctx[:cur], self._i_last, cur - n)
            self._i_last = cur - n
        w = ctx[cur + 1 - n :].tolist()
        h = int(slots(ctx[cur + 1 - n :], n)[0])
        out: list[int] = []
        for i in range(self.n_max):
            t = self.pool.get(h)
            if t is None:
                if i < self.n_min:
                    return Draft.empty()
                break
            out.append(t)
            w.append(t)
            h = ((h - w[i] * self._top) * _MULT + t) & _MASK
        self._n_draft_last = len(out)
        tokens = np.asarray(out[:n_max], dtype=np.int32)
        if tokens.shape[0]:
            self._proposed = Proposed(cur, tokens)
        return Draft(tokens, None)

    def accept(self, tp: TargetPass) -> None:
        """The low-acceptance rule, for the verify pass of this drafter's own draft only."""
        n_accepted = self._proposed.n_accepted(tp) if self._proposed is not None else None
        self._proposed = None
        if n_accepted is None or self._n_draft_last == 0:
            return
        if n_accepted / self._n_draft_last < LOW_ACCEPT:
            self._n_low += 1
            if self._n_low >= LOW_STREAK:
                log.debug("low acceptance streak (%d) - resetting ngram_mod", self._n_low)
                self.pool.clear()
                self._n_low = self._i_last = 0
        else:
            self._n_low = 0

    def close(self) -> None:
        """No native resources."""

    def _add(self, inp: np.ndarray, i0: int, i1: int) -> None:
        """pool[slot(inp[i:i+n])] = inp[i+n] for i = i0 .. i1 - 1, in order (common_ngram_mod::add)."""
        if i1 <= i0:
            return
        n = self.n_match
        s = slots(inp[i0 : i1 + n - 1], n)          # [i1 - i0]
        self.pool.update(zip(s.tolist(), inp[i0 + n : i1 + n].tolist(), strict=True))

"""The `ngram-cache` drafter: llama.cpp's lookup decoding (common/ngram-cache.cpp), driven as its
common_speculative_impl_ngram_cache drives it (common/speculative.cpp).

No model: counts of the token after every 1- to 4-gram of the context (and, optionally, of two
cache files made by llama.cpp's llama-lookup-create) give one drafted token at a time, up to 8.
Deterministic.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import numpy as np

from specrun.gguf_spec.errors import SpecrunError

from ..params import NGRAM_CACHE_N_DRAFT, SpecParams
from ..types import Draft, DraftOptions, TargetPass
from .base import TargetView

# llama.cpp common/ngram-cache.{h,cpp} and create_state_ngram_cache
NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2
N_DRAFT = NGRAM_CACHE_N_DRAFT
MIN_SAMPLES_LAX, MIN_PERCENT_LAX = (2, 2, 1, 1), (66, 50, 50, 50)          # by n-gram size 1..4
MIN_SAMPLES_STRICT, MIN_PERCENT_STRICT = (4, 3, 2, 2), (75, 66, 66, 66)
TOKEN_NULL = -1

# libstdc++'s std::unordered_map<int, int> grows its buckets (1 -> 13 -> 29 ...) when its k-th
# element is inserted, for these k (measured with g++ 12: _Prime_rehash_policy, load factor 1)
_REHASH_AT = {1: 13, 14: 29, 30: 59, 60: 127, 128: 257, 258: 541, 542: 1109, 1110: 2357, 2358: 5087,
              5088: 10273, 10274: 20753, 20754: 42043, 42044: 85229, 85230: 172933, 172934: 351061}


class Counts:
    """common_ngram_cache_part (std::unordered_map<llama_token, int32_t>): token -> count, iterated in
    libstdc++'s order, because llama.cpp breaks ties between tokens by that order.

    libstdc++ keeps one list of nodes, each bucket's nodes (bucket = token % bucket count) together;
    a node enters at the front of its bucket's run, or at the front of the list when its bucket is
    empty; a rehash re-inserts the nodes in list order by the same rule. Only insertions happen here."""

    __slots__ = ("counts", "_n_bkt", "_runs")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self._n_bkt = 1
        self._runs: dict[int, list[int]] = {}   # bucket -> tokens; both stored back to front

    def add(self, token: int, count: int = 1) -> None:
        """count more of token (a new token is inserted)."""
        if token in self.counts:
            self.counts[token] += count
            return
        grow = _REHASH_AT.get(len(self.counts) + 1)
        if grow is not None:
            order = list(self)
            self._n_bkt, self._runs = grow, {}
            for t in order:
                self._link(t)
        self._link(token)
        self.counts[token] = count

    def _link(self, token: int) -> None:
        run = self._runs.get(token % self._n_bkt)
        if run is None:
            self._runs[token % self._n_bkt] = [token]
        else:
            run.append(token)

    def __iter__(self) -> Iterator[int]:
        for b in reversed(self._runs):
            yield from reversed(self._runs[b])


Cache = dict[tuple[int, ...], Counts]      # common_ngram_cache: n-gram -> counts of the next token


def update_cache(cache: Cache, tokens: list[int]) -> None:
    """common_ngram_cache_update(cache, 1, 4, tokens, nnew = len(tokens)): every n-gram of tokens
    (n = 1..4, by n, then by position) counts the token after it."""
    for n in range(NGRAM_MIN, NGRAM_MAX + 1):
        for i in range(n, len(tokens)):
            key = tuple(tokens[i - n : i])
            counts = cache.get(key)
            if counts is None:
                cache[key] = counts = Counts()
            counts.add(tokens[i])


def load_cache(path: str, flag: str) -> Cache:
    """common_ngram_cache_load: a file of records [int32 ngram[4] (-1 padded), int32 n, n x (int32
    token, int32 count)], as llama-lookup-create and llama-lookup-merge write them."""
    try:
        data = np.fromfile(path, dtype="<i4")
    except OSError as e:
        raise SpecrunError(f"{flag} {path}: cannot read it ({e.strerror or e}); give an n-gram cache file made "
                           "by llama.cpp's llama-lookup-create") from None
    cache: Cache = {}
    i, size = 0, data.shape[0]
    while i < size:
        n = int(data[i + 4]) if i + 5 <= size else 0
        pairs = data[i + 5 : i + 5 + 2 * n]
        if n <= 0 or pairs.shape[0] != 2 * n or (pairs[1::2] <= 0).any():
            raise SpecrunError(f"{flag} {path}: not an n-gram cache file (a bad record at byte {4 * i} of "
                               f"{4 * size}); give one made by llama.cpp's llama-lookup-create")
        key = tuple(int(t) for t in data[i : i + 4] if t != TOKEN_NULL)
        counts = cache.setdefault(key, Counts())     # llama.cpp's emplace keeps a repeated n-gram's first record
        if not counts.counts:
            for t, c in pairs.reshape(n, 2).tolist():
                counts.add(t, c)
        i += 5 + 2 * n
    return cache


def _try_primary(cache: Cache, ngrams: list[tuple[int, ...] | None], static: Counts | None,
                 min_samples: tuple[int, ...], min_percent: tuple[int, ...]) -> int | None:
    """try_draft over the context or dynamic cache: the longest n-gram first; its most frequent next
    token (count x 100 x its static count, or x 1 when the static cache has none; ties: the first in
    iteration order) if the n-gram was seen often enough and that token holds enough of its count."""
    for i in range(len(ngrams) - 1, -1, -1):
        counts = cache.get(ngrams[i]) if ngrams[i] is not None else None
        if counts is None:
            continue
        best, best_c, best_s, total = TOKEN_NULL, 0, 0, 0
        for t in counts:
            c = counts.counts[t]
            s = 100 * static.counts[t] if static is not None and t in static.counts else 1
            if c * s > best_c * best_s:
                best, best_c, best_s = t, c, s
            total += c
        if total < min_samples[i] or 100 * best_c < min_percent[i] * total:
            continue
        return best
    return None


def _try_static(static: Counts | None) -> int | None:
    """try_draft over the static cache alone (its 2-gram): the most frequent token, lax thresholds."""
    if static is None:
        return None
    best, best_c, total = TOKEN_NULL, 0, 0
    for t in static:
        c = static.counts[t]
        if c > best_c:
            best, best_c = t, c
        total += c
    i = NGRAM_STATIC - 1
    if total < MIN_SAMPLES_LAX[i] or 100 * best_c < MIN_PERCENT_LAX[i] * total:
        return None
    return best


class NgramCache:
    """llama.cpp's `ngram-cache` rule, exactly; ctx = inp + [id_last], L = len(ctx).

    State kept across calls and generations (llama.cpp keeps it per server slot; begin() does nothing):
        context  n-gram (1..4 tokens) -> counts of the next token, from this drafter's history
        dynamic  the same, read from -lcd (never updated nor saved, in this llama.cpp)
        static   the same, read from -lcs; only its 2-grams are looked up
        size     how much of the history `context` has seen (cache_size)

    propose(ctx, n_max):
    0. n_max <= 0: no draft and no change (llama.cpp does not call the drafter then).
    1. If size < L: update `context` with ctx[size:] ALONE (n-grams that straddle size are never
       counted, so while generating only runs of several tokens accepted in one step add anything);
       size = L. The first call therefore counts the whole prompt.
    2. No draft if L < 2. Then up to 8 times, with s = ctx + the tokens drafted so far:
       a. static = the static cache's counts after s[-2:];
       b. try the context cache with s[-4:], s[-3:], s[-2:], s[-1:] in that order, each accepted if
          its counts total at least (2, 2, 1, 1)[n-1] and its best token (count x 100 x static count,
          or x 1 when static has none of it) holds at least (66, 50, 50, 50)[n-1] % of the total;
       c. else the dynamic cache, the same with (4, 3, 2, 2) and (75, 66, 66, 66) %;
       d. else the static cache alone: its most frequent token after s[-2:], at least 2 in total
          and 50 %;
       e. nothing: stop. Ties go to the first token in std::unordered_map's iteration order
          (libstdc++'s, reproduced by Counts): two tokens seen once each after an n-gram of 2..4
          tokens is such a tie, and it drafts.
    3. The draft is cut to n_max. An n-gram that would start before ctx (L + drafted < 4) is not
       looked up (llama.cpp reads outside its buffer there).
    accept(tp): nothing (llama.cpp's is a no-op).

    Example: for ctx = [a, b, c, a, b] the first call counts [a] -> b twice, [a, b] -> c once ...;
    [b, c, a, b] and [c, a, b] were never followed, [a, b] -> c once is below 2 samples and so is
    [b] -> c: no draft. For ctx = [a, b, c, a, b, c, a, b], [b, c, a, b] -> c once suffices (4-grams
    need 1 sample), then [c, a, b, c] -> a, [a, b, c, a] -> b ...: [c, a, b, c, a, b, c, a].
    """

    spec_type: ClassVar[str] = "ngram-cache"
    needs_hidden: ClassVar[bool] = False

    def __init__(self, lookup_cache_static: str | None = None, lookup_cache_dynamic: str | None = None):
        self.static: Cache = load_cache(lookup_cache_static, "--lookup-cache-static") if lookup_cache_static else {}
        self.dynamic: Cache = load_cache(lookup_cache_dynamic, "--lookup-cache-dynamic") if lookup_cache_dynamic else {}
        self.context: Cache = {}
        self.size = 0

    @classmethod
    def from_spec(cls, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                  heads_path: str | None = None) -> NgramCache:
        """A drafter with spec's settings (what drafters.make_drafter calls)."""
        return cls(spec.ngram_cache.lookup_cache_static, spec.ngram_cache.lookup_cache_dynamic)

    def begin(self, prompt: np.ndarray, n_keep: int = 0, opts: DraftOptions | None = None) -> int:
        """Nothing (llama.cpp's is a no-op): the cache and its size carry over. No model state."""
        return n_keep

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        """ctx: int32 [L] = history + [id_last]. Returns 0..min(n_max, 8) tokens (class docstring)."""
        if n_max <= 0:
            return Draft.empty()
        s = np.asarray(ctx, dtype=np.int32).tolist()
        L = len(s)
        if self.size < L:
            update_cache(self.context, s[self.size :])
            self.size = L
        out: list[int] = []
        if L < NGRAM_STATIC:
            return Draft.empty()
        while len(out) < min(N_DRAFT, n_max):
            end = len(s)
            static = self.static.get(tuple(s[end - NGRAM_STATIC :]))
            ngrams = [tuple(s[end - n :]) if end >= n else None for n in range(NGRAM_MIN, NGRAM_MAX + 1)]
            t = _try_primary(self.context, ngrams, static, MIN_SAMPLES_LAX, MIN_PERCENT_LAX)
            if t is None:
                t = _try_primary(self.dynamic, ngrams, static, MIN_SAMPLES_STRICT, MIN_PERCENT_STRICT)
            if t is None:
                t = _try_static(static)
            if t is None:
                break
            out.append(t)
            s.append(t)
        return Draft(np.asarray(out, dtype=np.int32), None)

    def accept(self, tp: TargetPass) -> None:
        """Nothing (llama.cpp's is a no-op)."""

    def close(self) -> None:
        """No native resources."""

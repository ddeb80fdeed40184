"""The `ngram-simple` drafter: llama.cpp's common_ngram_simple_draft (common/ngram-map.cpp).

No model: it looks the last size_n tokens up in the token history and proposes what followed
their last earlier occurrence. Deterministic (Draft.probs is None).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..types import Draft, DraftOptions, TargetPass
from .base import NgramIndex

# llama.cpp common.h, common_params_speculative_ngram_map
SIZE_N_DEFAULT = 12
SIZE_M_DEFAULT = 48
MIN_HITS_DEFAULT = 1


class NgramSimple:
    """llama.cpp's `ngram-simple` rule, exactly; ctx = history + [id_last], L = len(ctx).

    llama.cpp calls common_ngram_simple_draft(tokens = ctx[:-1], sampled = id_last); with
    n = size_n, m = size_m:

    1. No draft if L <= n + m + 2 (its `cur_len <= n + m + 1`, cur_len = L - 1).
    2. pattern = the last n tokens of ctx (id_last included).
    3. match_pos = the LARGEST j in [1, L - n - 2] with ctx[j : j + n] == pattern. Position 0
       never matches (it means "no match" there), and the search starts two positions before the
       current occurrence (which starts at L - n), so an occurrence at L - n - 1 is skipped too.
    4. copy_max = min(m, (L - 1) - (match_pos + n)); no draft if copy_max < n. The last
       occurrence wins even when it is too recent to give n tokens: llama.cpp does not fall back
       to an earlier one (a run of one repeated token never drafts).
    5. draft = ctx[match_pos + n : match_pos + n + copy_max] (never includes id_last), then
       common_speculative_draft truncates it to n_max.
    So a draft is 0 tokens or between n and m tokens (fewer only when n_max < n).

    min_hits is accepted for parity with --spec-ngram-simple-min-hits, but llama.cpp's
    ngram-simple ignores it (common_ngram_simple_config has only size_ngram / size_mgram;
    min_hits is used by ngram-map-k / k4v), so it changes nothing here either.

    Example, n = 2, m = 3, ctx = [x, a, b, c, d, e, y, z, a, b] (L = 10 > n + m + 2 = 7):
    pattern = [a, b]; the largest j in [1, 6] with ctx[j:j+2] == [a, b] is 1; copy_max =
    min(3, 9 - 3) = 3 >= 2; draft = ctx[3:6] = [c, d, e]. For ctx = [a, b, c, d, e, f, g, z, a, b]
    the only earlier [a, b] starts at 0, which never counts: no draft.

    Cost: an NgramIndex {n-gram -> ascending start positions} is kept incrementally across calls
    (ctx only grows between begin() calls; any other change rebuilds it), so propose() is
    O(new tokens * n) plus one O(L) prefix check in numpy, not llama.cpp's O(L * n) scan.
    """

    spec_type: ClassVar[str] = "ngram-simple"
    needs_hidden: ClassVar[bool] = False

    def __init__(self, size_n: int = SIZE_N_DEFAULT, size_m: int = SIZE_M_DEFAULT, min_hits: int = MIN_HITS_DEFAULT):
        if size_n < 1 or size_m < 1:
            raise ValueError(f"ngram-simple needs size_n >= 1 and size_m >= 1 (got size_n={size_n}, size_m={size_m})")
        self.size_n = size_n
        self.size_m = size_m
        self.min_hits = min_hits  # unused, as in llama.cpp's ngram-simple
        self._index = NgramIndex(size_n)

    def begin(self, prompt: np.ndarray, n_keep: int = 0, opts: DraftOptions | None = None) -> int:
        """A new sequence: index `prompt` (keeping the index of a prefix it extends). No model
        state, so any reuse of the target's KV suits it."""
        self._index.sync(np.asarray(prompt, dtype=np.int32))
        return n_keep

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        """ctx: int32 [L] = prompt + emitted so far, ending with id_last. Returns a Draft of 0 or
        min(n_max, copy_max) tokens (see the class docstring); n_max <= 0 -> empty."""
        ctx = np.asarray(ctx, dtype=np.int32)
        self._index.sync(ctx)
        n, m = self.size_n, self.size_m
        L = ctx.shape[0]
        if n_max <= 0 or L <= n + m + 2:
            return Draft.empty()
        match_pos = self._index.last_in(ctx[L - n :], 0, L - n - 2)  # the last start in [1, L - n - 2]
        if match_pos == 0:
            return Draft.empty()
        copy_max = min(m, (L - 1) - (match_pos + n))
        if copy_max < n:
            return Draft.empty()
        begin = match_pos + n
        return Draft(ctx[begin : begin + min(copy_max, n_max)].copy(), None)

    def accept(self, tp: TargetPass) -> None:
        """Nothing to roll back: the history arrives with the next propose() (llama.cpp: a no-op)."""

    def close(self) -> None:
        """No native resources."""

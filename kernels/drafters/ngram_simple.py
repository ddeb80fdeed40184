"""The `ngram-simple` drafter: llama.cpp's common_ngram_simple_draft (common/ngram-map.cpp).

No model: it looks the last size_n tokens up in the token history and proposes what followed
their last earlier occurrence. Deterministic (Draft.probs is None).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..params import SpecParams
from ..types import Draft, DraftOptions, TargetPass
from .base import NgramIndex, TargetView

_DEFAULTS = SpecParams()   # llama.cpp common.h's (common_params_speculative_ngram_map)
MATCHES = ("last", "longest")   # which earlier occurrence a draft copies from (see NgramSimple)
BACK_MAX = 64          # "longest": preceding tokens compared per occurrence
CANDIDATES_MAX = 256   # "longest": the latest occurrences weighed (bounds a pass's lookup on a long context)


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

    match="longest" (specrun's, what `--spec-type auto` runs; not llama.cpp's): of the earlier
    occurrences in [1, L - n - 2] with room for at least n tokens (copy_max >= n), the one whose
    preceding tokens equal those before the current occurrence for the longest stretch (up to
    BACK_MAX, among the CANDIDATES_MAX latest); ties go to the latest. Where the last n tokens
    follow several contexts (", and she was very" after two different sentences), it copies from
    the occurrence that continues the same sentence. Replayed on 39 model texts with the adaptive
    length (benchmarks/draft_length_replay.py, modeled x none, geometric mean): 1.835 against 1.753
    with "last" (Gemma's 25 texts 2.197 against 2.028: verbatim copies 1.27 -> 1.93, a log summary
    2.03 -> 3.05; SmolLM2's chat texts 1.454 against 1.451, each within 0.07); breaking ties by the
    room to copy instead read 1.831. Example, n = 2, m = 2, ctx = [x, c, a, b, y, z, d, a, b, w, v,
    c, a, b] (L = 14): the earlier a, b start at 2 and 7; "last" copies [w, v] (after the one at
    7); "longest" sees the current a, b preceded by c, as the one at 2 is (then x against v: a
    stretch of 1), not as the one at 7 (d): it copies [y, z].

    Cost: an NgramIndex {n-gram -> ascending start positions} is kept incrementally across calls
    (ctx only grows between begin() calls; any other change rebuilds it), so propose() is
    O(new tokens * n) plus one O(L) prefix check in numpy, not llama.cpp's O(L * n) scan
    ("longest": plus one numpy comparison of at most CANDIDATES_MAX x BACK_MAX tokens).
    """

    spec_type: ClassVar[str] = "ngram-simple"
    needs_hidden: ClassVar[bool] = False

    def __init__(self, size_n: int = _DEFAULTS.ngram_size_n, size_m: int = _DEFAULTS.ngram_size_m,
                 min_hits: int = _DEFAULTS.ngram_min_hits,
                 match: str = "last"):
        if size_n < 1 or size_m < 1:
            raise ValueError(f"ngram-simple needs size_n >= 1 and size_m >= 1 (got size_n={size_n}, size_m={size_m})")
        if match not in MATCHES:
            raise ValueError(f"ngram-simple match {match!r}: use one of {', '.join(MATCHES)}")
        self.size_n = size_n
        self.size_m = size_m
        self.min_hits = min_hits  # unused, as in llama.cpp's ngram-simple
        self.match = match
        self._index = NgramIndex(size_n)

    @classmethod
    def from_spec(cls, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                  heads_path: str | None = None) -> NgramSimple:
        """A drafter with spec's settings (what drafters.make_drafter calls)."""
        return cls(spec.ngram_size_n, spec.ngram_size_m, spec.ngram_min_hits, spec.ngram_match or "last")

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
        if self.match == "longest":
            match_pos = self._longest(ctx, L, n, m)
        else:
            match_pos = self._index.last_in(ctx[L - n :], 0, L - n - 2)  # the last start in [1, L - n - 2]
        if match_pos == 0:
            return Draft.empty()
        copy_max = min(m, (L - 1) - (match_pos + n))
        if copy_max < n:
            return Draft.empty()
        begin = match_pos + n
        return Draft(ctx[begin : begin + min(copy_max, n_max)].copy(), None)

    def _longest(self, ctx: np.ndarray, L: int, n: int, m: int) -> int:
        """The start "longest" copies from (class docstring); 0 when no occurrence has room for n tokens."""
        # room: copy_max = min(m, L - 1 - (j + n)) >= n  <=>  j <= L - 1 - 2n
        starts = np.asarray(self._index.all_in(ctx[L - n :], 1, min(L - n - 2, L - 1 - 2 * n))[-CANDIDATES_MAX:],
                            dtype=np.int64)                                   # [k], ascending
        if starts.size == 0:
            return 0
        back = np.arange(1, BACK_MAX + 1)                                     # [B]
        here = L - n - back                                                   # [B]: before the current occurrence
        there = starts[:, None] - back[None, :]                               # [k, B]
        ok = (there >= 0) & (here[None, :] >= 0)
        same = ok & (ctx[np.maximum(there, 0)] == ctx[np.maximum(here, 0)][None, :])
        run = np.cumprod(same, axis=1).sum(axis=1)                            # [k]: matching stretch
        return int(starts[len(run) - 1 - int(np.argmax(run[::-1]))])        # the latest of the longest

    def accept(self, tp: TargetPass) -> None:
        """Nothing to roll back: the history arrives with the next propose() (llama.cpp: a no-op)."""

    def close(self) -> None:
        """No native resources."""

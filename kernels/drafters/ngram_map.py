"""The `ngram-map-k` and `ngram-map-k4v` drafters: llama.cpp's common_ngram_map (common/ngram-map.cpp),
driven as its common_speculative_impl_ngram_map_k drives it (common/speculative.cpp).

No model: the last size_n tokens (the key) are looked up in the history, through a hash table of
earlier keys, and the size_m tokens after the match are proposed. Per key the map remembers how many
tokens of its last draft were accepted, and k4v counts which m-grams follow it. Deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..params import NgramMapParams, SpecParams
from ..types import Draft, DraftOptions, TargetPass
from .base import NgramIndex, Proposed, TargetView

_DEFAULTS = NgramMapParams()   # llama.cpp common.h's

# llama.cpp common/ngram-map.{h,cpp}
LCG_FACTOR = 2654435761
HASH_MAP_SIZE = 262144        # COMMON_NGRAM_HASH_MAP_SIZE (2^18)
MAX_VALUES = 4                # COMMON_NGRAM_MAX_VALUES: m-grams tracked per key
MAX_VALUE_COUNT = 16380       # COMMON_NGRAM_MAX_VALUE_COUNT: key_num and value_num saturate here


@dataclass(slots=True)
class _Value:
    """common_ngram_map_value: an m-gram seen after a key."""

    value_idx: int = 0        # its start in the history; 0: an unused slot
    value_num: int = 0        # times it followed the key (as counted, see step 5)
    n_accepted: int = -1      # tokens accepted of its last draft: the next draft's bound


@dataclass(slots=True)
class _Key:
    """common_ngram_map_key: a key that matched, with its statistics."""

    key_idx: int              # the match that created it
    stat_idx: int = 0         # k4v: occurrences before this start are counted
    key_num: int = 0          # lookups that matched it
    values: list[_Value] = field(default_factory=list)


def lcg_hashes(ctx: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    """common_ngram_map_hash of the n-grams of ctx (int32 [L]) at starts (int [k]): h = h * 2654435761
    + token over the n tokens, mod 2^32. Returns uint64 [k], each < 2^32."""
    h = np.zeros(starts.shape[0], dtype=np.uint64)
    for k in range(n):
        h = (h * np.uint64(LCG_FACTOR) + ctx[starts + k].astype(np.uint64)) & np.uint64(0xFFFFFFFF)
    return h


class NgramMap:
    """llama.cpp's common_ngram_map rule, exactly; ctx = inp + [id_last], cur_len = len(inp) = L - 1,
    n = size_n, m = size_m, key = ctx[-n:] (id_last included). Positions are starts in inp.

    State kept across calls and generations (llama.cpp keeps one map per server slot):
        table    the hash table: table[h] = the first start stored under hash h (0: empty)
        T        the last start put in the table (key_map_last_idx)
        B        len(prompt) at the last begin() (size_last_begin)
        keys     every key that matched, in creation order, with key_num, stat_idx and 4 value slots

    propose(ctx, n_max) (common_ngram_map_draft, then truncation to n_max):
    0. n_max <= 0: no draft and no change (llama.cpp does not call the drafter then).
    1. No draft if cur_len < 2n + m.
    2. match = a start j of key in inp, j <= hi = cur_len - n - m - 1, found by the first of:
       a. the table: j = table[lcg(key) % 2^18] if j != 0, j < hi and inp[j:j+n] == key;
       b. the largest j in (T, B - n - m - 1] (only when B > n + m + 1);
       c. the largest j in (max(B, T), hi].
       Starts in (B - n - m - 1, B] are never searched nor hashed.
    3. The starts of b's range, then of c's, each from the top down, go into empty table slots only
       (so a hash keeps the first start stored: the newest of the prompt, not of the text after it);
       T = max(T, hi).
    4. No match: no draft. Else the key's entry (found by tokens; a new one starts with every slot's
       n_accepted = m) gets key_num += 1: a count of lookups, not of occurrences.
    5. ngram-map-k: draft = inp[match + n : match + n + min(m, values[0].n_accepted)]. min_hits is
       not read (llama.cpp's key-only branch returns before its check).
       ngram-map-k4v:
       - no draft while key_num < min_hits;
       - each occurrence i of key in [stat_idx, match] (stat_idx itself included, so the occurrence
         counted last time counts again) files the m-gram inp[i+n : i+n+m] into the first slot that
         holds the same m-gram or is empty (new: n_accepted = m) and adds 1 to its value_num; a
         fifth distinct m-gram is dropped. Then stat_idx = match.
       - s = the first slot with the largest value_num; no draft if the other slots' sum is > 0 and
         value_num[s] < 2 * that sum;
       - draft = inp[match + n : match + n + min(m, values[s].n_accepted)]: the tokens after the
         match, not those of slot s (llama.cpp's code; they differ when the last occurrence was
         followed by a minority m-gram).
    6. The draft is cut to n_max.

    accept(tp): only the verify pass of this drafter's own draft counts (llama.cpp's impl_last): the
    slot used gets n_accepted = the tokens accepted. A key's drafts therefore never grow again, and a
    key whose draft was wholly rejected drafts nothing from then on.

    begin(prompt): when the prompt is shorter than the last history looked at (a new request), the
    table slots, keys and value slots at starts >= C are dropped, C = the previous B, or
    len(prompt) - n - m when the prompt is shorter than that; T = C - 1. Then B = len(prompt).
    A longer prompt keeps everything (a conversation that goes on).

    Example (k, n = 2, m = 2), ctx = [x, a, b, c, d, y, z, w, a, b]: cur_len = 9 >= 2n + m = 6, hi = 4;
    the table is empty and B = 0, so c. finds the start 1 of [a, b] in (0, 4]: draft [c, d]; the
    table then holds the starts 1..4. If the target accepts 1 of it, the next draft after [a, b]
    is 1 token long.
    """

    spec_type: ClassVar[str] = "ngram-map-k"
    key_only: ClassVar[bool] = True
    needs_hidden: ClassVar[bool] = False

    def __init__(self, size_n: int = _DEFAULTS.size_n, size_m: int = _DEFAULTS.size_m,
                 min_hits: int = _DEFAULTS.min_hits):
        if not (1 <= size_n <= 1024 and 1 <= size_m <= 1024) or min_hits < 1:
            raise ValueError(f"{self.spec_type} needs 1 <= size_n, size_m <= 1024 and min_hits >= 1 "
                             f"(got size_n={size_n}, size_m={size_m}, min_hits={min_hits})")
        self.size_n, self.size_m, self.min_hits = size_n, size_m, min_hits
        self._table = np.zeros(HASH_MAP_SIZE, dtype=np.uint32)   # uint32 [2^18]: hash -> start
        self._T = 0                   # key_map_last_idx
        self._B = 0                   # size_last_begin
        self._last_check = 0          # idx_last_check: the history length last looked at
        self._keys: list[_Key] = []
        self._key_of: dict[bytes, int] = {}    # key tokens -> index in _keys (llama.cpp scans _keys)
        self._index = NgramIndex(size_n)
        self._proposed: tuple[Proposed, _Value] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def begin(self, prompt: np.ndarray, n_keep: int = 0, opts: DraftOptions | None = None) -> int:
        """common_ngram_map_begin (see the class docstring). No model state: any KV reuse suits it."""
        prompt = np.asarray(prompt, dtype=np.int32)
        n, m, size = self.size_n, self.size_m, prompt.shape[0]
        cut = self._B
        if cut > size:
            cut = size - n - m if size > n + m else 0
        if size < self._last_check:
            self._table[self._table >= max(cut, 1)] = 0
            self._T = max(cut - 1, 0)
            for i in range(len(self._keys) - 1, -1, -1):
                key = self._keys[i]
                if key.key_idx >= cut:
                    del self._keys[i]
                    continue
                if self.key_only:
                    continue
                vals = key.values
                for j in range(MAX_VALUES - 1, -1, -1):
                    if vals[j].value_idx != 0 and vals[j].value_idx >= cut:
                        vals[j : MAX_VALUES - 1] = vals[j + 1 :]          # shift left; the last slot is cleared
                        vals[-1] = _Value(0, 0, vals[-1].n_accepted)
                if vals[0].value_idx == 0:
                    del self._keys[i]
        self._last_check = self._B = size
        self._proposed = None
        self._index.sync(prompt)
        self._rekey(prompt)
        return n_keep

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        """ctx: int32 [L] = history + [id_last]. Returns 0..min(n_max, size_m) tokens (class docstring)."""
        self._proposed = None
        if n_max <= 0:
            return Draft.empty()
        ctx = np.asarray(ctx, dtype=np.int32)
        if self._index.sync(ctx):
            self._rekey(ctx)
        n, m = self.size_n, self.size_m
        cur = ctx.shape[0] - 1
        if cur < 2 * n + m:
            return Draft.empty()
        self._last_check = cur
        key, hi, B, T = ctx[cur + 1 - n :], cur - n - m - 1, self._B, self._T
        j = int(self._table[int(lcg_hashes(key, np.zeros(1, dtype=np.int64), n)[0]) % HASH_MAP_SIZE])
        match = j if j != 0 and j < hi and np.array_equal(ctx[j : j + n], key) else 0
        if match == 0 and B > n + m + 1:
            match = self._index.last_in(key, T, B - n - m - 1)
        if match == 0:
            match = self._index.last_in(key, max(B, T), hi)
        if B > n + m + 1:
            self._hash_starts(ctx, B - n - m - 1, T)
        self._hash_starts(ctx, hi, max(B, T))
        self._T = max(hi, T)
        if match == 0:
            return Draft.empty()

        kb = key.tobytes()
        if kb not in self._key_of:
            self._key_of[kb] = len(self._keys)
            self._keys.append(_Key(match, values=[_Value(n_accepted=m) for _ in range(MAX_VALUES)]))
        entry = self._keys[self._key_of[kb]]
        entry.key_num = min(entry.key_num + 1, MAX_VALUE_COUNT)
        if self.key_only:
            value = entry.values[0]
        else:
            if entry.key_num < self.min_hits:
                return Draft.empty()
            value = self._count_values(ctx, key, entry, match)
            if value is None:
                return Draft.empty()
        k = min(m, value.n_accepted, n_max)
        tokens = ctx[match + n : match + n + max(k, 0)].copy()
        if tokens.shape[0]:
            self._proposed = (Proposed(cur, tokens), value)
        return Draft(tokens, None)

    def accept(self, tp: TargetPass) -> None:
        """common_ngram_map_accept, for the verify pass of this drafter's own draft only."""
        if self._proposed is not None:
            proposed, value = self._proposed
            n_accepted = proposed.n_accepted(tp)
            if n_accepted is not None:
                value.n_accepted = n_accepted
        self._proposed = None

    def close(self) -> None:
        """No native resources."""

    # -- steps -------------------------------------------------------------------------------
    def _count_values(self, ctx: np.ndarray, key: np.ndarray, entry: _Key, match: int) -> _Value | None:
        """k4v's statistics of the m-grams after key (step 5): the slot to draft with, or None."""
        n, m = self.size_n, self.size_m
        vals = entry.values
        for i in self._index.all_in(key, entry.stat_idx, match):
            v0 = i + n
            for val in vals:
                if val.value_idx == 0:
                    val.value_idx, val.value_num, val.n_accepted = v0, 0, m
                elif not np.array_equal(ctx[v0 : v0 + m], ctx[val.value_idx : val.value_idx + m]):
                    continue
                val.value_num = min(val.value_num + 1, MAX_VALUE_COUNT)
                break
        entry.stat_idx = match
        s = 0
        for v in range(1, MAX_VALUES):
            if vals[v].value_num > vals[s].value_num:
                s = v
        others = sum(val.value_num for v, val in enumerate(vals) if v != s)
        if others > 0 and vals[s].value_num < 2 * others:
            return None
        return vals[s]

    def _hash_starts(self, ctx: np.ndarray, top: int, above: int) -> None:
        """Put the starts top, top - 1, ..., above + 1 into empty table slots, in that order."""
        if top <= above:
            return
        starts = np.arange(top, above, -1, dtype=np.int64)                      # [k], descending
        slots = (lcg_hashes(ctx, starts, self.size_n) % np.uint64(HASH_MAP_SIZE)).astype(np.int64)
        slots, first = np.unique(slots, return_index=True)                      # the first start per slot
        starts = starts[first]
        empty = self._table[slots] == 0
        self._table[slots[empty]] = starts[empty]

    def _rekey(self, ctx: np.ndarray) -> None:
        """The key-tokens index of _keys over this history (the first entry wins, as llama.cpp's scan)."""
        n = self.size_n
        self._key_of = {}
        for i, key in enumerate(self._keys):
            if key.key_idx + n <= ctx.shape[0]:
                self._key_of.setdefault(ctx[key.key_idx : key.key_idx + n].tobytes(), i)


class NgramMapK(NgramMap):
    """`ngram-map-k`: keys only; a key drafts the m tokens after its match (see NgramMap)."""

    spec_type: ClassVar[str] = "ngram-map-k"
    key_only: ClassVar[bool] = True

    @classmethod
    def from_spec(cls, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                  heads_path: str | None = None) -> NgramMapK:
        """A drafter with spec's settings (what drafters.make_drafter calls)."""
        return cls(spec.ngram_map_k.size_n, spec.ngram_map_k.size_m, spec.ngram_map_k.min_hits)


class NgramMapK4V(NgramMap):
    """`ngram-map-k4v`: keys with up to four m-grams counted; drafts when one dominates (see NgramMap)."""

    spec_type: ClassVar[str] = "ngram-map-k4v"
    key_only: ClassVar[bool] = False

    @classmethod
    def from_spec(cls, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                  heads_path: str | None = None) -> NgramMapK4V:
        """A drafter with spec's settings (what drafters.make_drafter calls)."""
        return cls(spec.ngram_map_k4v.size_n, spec.ngram_map_k4v.size_m, spec.ngram_map_k4v.min_hits)

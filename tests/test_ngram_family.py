"""ngram-map-k, ngram-map-k4v, ngram-mod and ngram-cache against llama.cpp (common/ngram-*.cpp).

Hand-worked tables for each rule; the same rules against llama.cpp's own code of the pinned version
(compiled with g++ from tests/vendor/llama.cpp: random histories, drafts and acceptances, token
for token); the flags; and (slow) output equal to `none` on real models with some tokens accepted.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specrun.cli.main import cli
from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels.drafters import NgramCache, NgramMapK, NgramMapK4V, NgramMod, draft_n_max, make_drafter
from specrun.kernels.drafters import ngram_mod as mod_module
from specrun.kernels.drafters.base import Proposed
from specrun.kernels.drafters.ngram_cache import Counts
from specrun.kernels.drafters.ngram_mod import MULT, POOL_SIZE, slots
from specrun.kernels.params import (
    NgramCacheParams,
    NgramMapParams,
    NgramModParams,
    SpecParams,
    parse_spec_types,
)
from specrun.kernels.types import Draft, TargetPass

A, B, C, D, E, F, G, H, P, Q, R, S, U, V, W, X, Y, Z = range(10, 28)
VENDOR = Path(__file__).parent / "vendor" / "llama.cpp"     # common/ngram-*.{h,cpp} and shim headers


def i32(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def verify_pass(ctx: list[int], draft: list[int], n_accepted: int) -> TargetPass:
    """The engine's TargetPass for verifying draft after ctx (id_last = ctx[-1])."""
    return TargetPass(i32([ctx[-1], *draft]), len(ctx) - 1, n_accepted + 1)


def play(drafter, steps, prompt=()) -> list[list[int]]:
    """begin(prompt), then for each step (ctx, n_max, n_accepted | None): propose, and when a number
    is given, the verify pass of that draft accepting it. Returns the drafts."""
    drafter.begin(i32(prompt), 0, None)
    out = []
    for ctx, n_max, n_acc in steps:
        draft = drafter.propose(i32(ctx), n_max)
        assert isinstance(draft, Draft) and draft.probs is None and draft.tokens.dtype == np.int32
        out.append(draft.tokens.tolist())
        if n_acc is not None:
            drafter.accept(verify_pass(ctx, out[-1], n_acc))
    return out


# ---- the accept routing --------------------------------------------------------------------------


def test_proposed_recognises_only_its_own_verify_pass():
    p = Proposed(9, i32([C, D, E]))
    assert p.n_accepted(TargetPass(i32([B, C, D, E]), 9, 2)) == 1          # its pass, 1 accepted
    assert p.n_accepted(TargetPass(i32([B, C]), 9, 2)) == 1                # the engine cut it to 1 token
    assert p.n_accepted(TargetPass(i32([B, C, D, E]), 8, 4)) is None       # another position
    assert p.n_accepted(TargetPass(i32([B, C, Q]), 9, 1)) is None          # another drafter's draft
    assert p.n_accepted(TargetPass(i32([B]), 9, 1)) is None                # a plain step
    assert p.n_accepted(TargetPass(i32([B, C, D, E, F]), 9, 5)) is None    # longer than its draft


# ---- ngram-map-k ---------------------------------------------------------------------------------

CTX_A = [X, A, B, C, D, Y, Z, W, A, B]              # cur_len 9, hi = 4: [A, B] at 1
CTX_DEAD = [X, Y, Z, W, V, A, B, C, D, E, F, G, A, B]   # [A, B] at 5, hi = 8

# (name, prompt, [(ctx, n_max, n_accepted | None)], drafts); n = 2, m = 2
MAP_K = [
    ("match-found", [], [(CTX_A, 16, None)], [[C, D]]),
    ("n_max-cap", [], [(CTX_A, 1, None)], [[C]]),
    ("history-shorter-than-2n+m", [], [([X, A, B, C, A, B], 16, None)], [[]]),
    ("value-must-end-before-hi", [], [([X, Y, Z, A, B, C, A, B], 16, None)], [[]]),
    ("position-0-never-matches", [], [([A, B, C, D, X, Y, Z, A, B], 16, None)], [[]]),
    ("no-match", [], [([X, A, B, C, D, Y, Z, W, A, C], 16, None)], [[]]),
    ("newest-occurrence-when-the-table-misses", [], [([X, A, B, C, D, Y, A, B, E, F, Z, W, A, B], 16, None)],
     [[E, F]]),
    # the first call hashes starts 1..3; the second finds [A, B] at 1 through the table, not the newer 9
    ("table-keeps-the-first-stored-start", [],
     [([X, A, B, C, D, Y, Z, W, V], 16, None), ([X, A, B, C, D, Y, Z, W, V, A, B, E, F, R, S, P, U, A, B], 16, None)],
     [[], [C, D]]),
    # begin(prompt) with len 9: starts (9 - 2 - 2 - 1, 9] = 5..9 are never searched nor hashed
    ("prompt-end-gap", [X, Y, Z, W, V, A, B, C, D], [([X, Y, Z, W, V, A, B, C, D, E, F, G, A, B], 16, None)], [[]]),
    ("no-gap-without-a-prompt", [], [([X, Y, Z, W, V, A, B, C, D, E, F, G, A, B], 16, None)], [[C, D]]),
    # n_accepted caps the key's next draft: 1 accepted -> 1 token next time
    ("accepted-caps-the-next-draft", [],
     [(CTX_A, 16, 1), ([*CTX_A, C, R, S, P, U, A, B], 16, None)], [[C, D], [C]]),
    ("a-wholly-rejected-key-never-drafts-again", [],
     [(CTX_DEAD, 16, 0), ([*CTX_DEAD, H, P, Q, R, S, A, B], 16, None), ([*CTX_DEAD, H, P, Q, R, S, A, B, C, A, B], 16, None)],
     [[C, D], [], []]),
]


@pytest.mark.parametrize(("prompt", "steps", "want"), [pytest.param(*c[1:], id=c[0]) for c in MAP_K])
def test_map_k(prompt, steps, want):
    assert play(NgramMapK(2, 2), steps, prompt) == want


def test_map_k_ignores_min_hits_like_llama_cpp():
    for prompt, steps, want in (c[1:] for c in MAP_K):
        assert play(NgramMapK(2, 2, min_hits=5), steps, prompt) == want


def test_map_k_counts_only_its_own_verify_pass():
    d = NgramMapK(2, 2)
    d.begin(i32([]), 0, None)
    assert d.propose(i32(CTX_A), 16).tokens.tolist() == [C, D]
    d.accept(TargetPass(i32([B, Q]), len(CTX_A) - 1, 1))     # another drafter's draft was verified: no change
    assert d.propose(i32([*CTX_A, C, R, S, P, U, A, B]), 16).tokens.tolist() == [C, D]


def test_map_k_begin_with_a_shorter_prompt_forgets_what_came_after():
    """A new request (prompt shorter than the history last seen) drops keys and table entries from
    the previous begin()'s length on: here all of them, so the dead key drafts again."""
    d = NgramMapK(2, 2)
    steps = [(CTX_DEAD, 16, 0), ([*CTX_DEAD, H, P, Q, R, S, A, B], 16, None)]
    assert play(d, steps) == [[C, D], []]
    longer = [*CTX_DEAD, H, P, Q, R, S, A]                 # not shorter than the history: all kept
    assert play(d, [([*longer, B], 16, None)], prompt=longer) == [[]]
    assert play(d, [(CTX_DEAD, 16, None)], prompt=[X]) == [[C, D]]


# ---- ngram-map-k4v --------------------------------------------------------------------------------

# (name, min_hits, [(ctx, n_max, n_accepted | None)], drafts); n = 2, m = 2
MAP_K4V = [
    # [A, B] at 1, 6, 11 (match 11): [C, D] twice, [E, F] once -> 2 >= 2 * 1, and the draft is the
    # tokens after the match, [E, F], not the majority m-gram [C, D]
    ("drafts-after-the-match-not-the-majority", 1,
     [([X, A, B, C, D, Y, A, B, C, D, Z, A, B, E, F, W, V, U, A, B], 16, None)], [[E, F]]),
    ("majority-after-the-match", 1,
     [([X, A, B, E, F, Y, A, B, C, D, Z, A, B, C, D, W, V, U, A, B], 16, None)], [[C, D]]),
    ("one-occurrence", 1, [(CTX_A, 16, None)], [[C, D]]),
    ("no-dominant-m-gram", 1, [([X, A, B, C, D, Y, A, B, E, F, Z, W, V, A, B], 16, None)], [[]]),
    # the second lookup counts the occurrence at stat_idx (6) again: [E, F] 2, [C, D] 1 -> drafts
    ("the-last-counted-occurrence-counts-again", 1,
     [([X, A, B, C, D, Y, A, B, E, F, Z, W, V, A, B], 16, None)] * 2, [[], [E, F]]),
    # key_num counts lookups: min_hits 2 drafts from the second lookup on
    ("min-hits-counts-lookups", 2, [(CTX_A, 16, None)] * 2, [[], [C, D]]),
    ("min-hits-3", 3, [(CTX_A, 16, None)] * 3, [[], [], [C, D]]),
    ("accepted-caps-the-next-draft", 1, [(CTX_A, 16, 1), ([*CTX_A, C, R, S, P, U, A, B], 16, None)], [[C, D], [C]]),
]


@pytest.mark.parametrize(("min_hits", "steps", "want"), [pytest.param(*c[1:], id=c[0]) for c in MAP_K4V])
def test_map_k4v(min_hits, steps, want):
    assert play(NgramMapK4V(2, 2, min_hits), steps) == want


def test_map_k4v_drops_a_fifth_m_gram():
    """Four distinct m-grams fill the slots; a fifth, [C, D], is never counted though seen 3 times."""
    ctx = [X, A, B, E, F, Y, A, B, G, H, Y, A, B, P, Q, Y, A, B, R, S,
           Y, A, B, C, D, Y, A, B, C, D, Y, A, B, C, D, W, V, U, A, B]
    d = NgramMapK4V(2, 2)
    assert play(d, [(ctx, 16, None)]) == [[]]                # E F, G H, P Q, R S once each: C D not kept
    entry = d._keys[0]
    assert [(v.value_idx, v.value_num) for v in entry.values] == [(3, 1), (8, 1), (13, 1), (18, 1)]


@pytest.mark.parametrize("cls", [NgramMapK, NgramMapK4V])
def test_map_defaults_and_bad_sizes(cls):
    d = cls()
    assert (d.size_n, d.size_m, d.min_hits) == (12, 48, 1)
    for bad in (dict(size_n=0), dict(size_m=0), dict(size_n=1025), dict(min_hits=0)):
        with pytest.raises(ValueError, match="size_n, size_m <= 1024 and min_hits >= 1"):
            cls(**bad)


# ---- ngram-mod ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [[0], [7], [1, 2], [49151, 3, 262143], list(range(100, 124)), [2**22 + 5]])
def test_mod_slot_is_llama_cpp_hash(tokens):
    """idx = (res = res * 6364136223846793005 + token, mod 2^64) % 2^22, computed in full width."""
    res = 0
    for t in tokens:
        res = (res * MULT + t) % 2**64
    assert slots(i32(tokens), len(tokens)).tolist() == [res % POOL_SIZE]


def test_mod_rolling_slot_equals_rehashing():
    rng = np.random.default_rng(3)
    seq = rng.integers(0, 262144, 200).astype(np.int32)
    n = 24
    d = NgramMod(n, 0, 8)
    h = int(slots(seq[:n], n)[0])
    for i in range(len(seq) - n):          # the roll propose() uses
        h = ((h - int(seq[i]) * d._top) * (MULT % POOL_SIZE) + int(seq[i + n])) % POOL_SIZE
        assert h == int(slots(seq[i + 1 : i + 1 + n], n)[0])


# (name, n_match, n_min, n_max, prompt, [(ctx, n_max, n_accepted | None)], drafts)
MOD = [
    ("chain", 2, 0, 8, [A, B, C, A], [([A, B, C, A, B], 16, None)], [[C, A]]),
    ("engine-n_max-cuts", 2, 0, 8, [A, B, C, A], [([A, B, C, A, B], 1, None)], [[C]]),
    ("chain-shorter-than-n_min", 2, 3, 8, [A, B, C, A], [([A, B, C, A, B], 16, None)], [[]]),
    ("n_max-mod-bounds-the-chain", 2, 0, 1, [A, B, C, A], [([A, B, C, A, B], 16, None)], [[C]]),
    # every lookup succeeds: n_max tokens even below n_min (n_min is checked only where the chain breaks)
    ("n_min-above-n_max", 1, 10, 3, [A, A, A, A], [([A, A, A, A, A], 16, None)], [[A, A, A]]),
    ("history-shorter-than-n", 4, 0, 8, [], [([A, B, C], 16, None)], [[]]),
    ("empty-pool", 2, 0, 8, [], [([A, B, C, A, B], 16, None)], [[]]),
    # n = 1: slot(t) = t, so t and t + 2^22 share a slot and the last write wins
    ("collision-last-write-wins", 1, 0, 1, [A, C, A + 2**22, D], [([X, A], 16, None)], [[D]]),
    # the prompt's last n-gram has no next token yet; the generated ones enter when > 32 wait
    ("id_last-n-gram-is-not-in-the-pool", 2, 0, 8, [X, A, B], [([X, A, B, Y], 16, None)], [[]]),
]


@pytest.mark.parametrize(("n", "n_min", "n_max", "prompt", "steps", "want"), [pytest.param(*c[1:], id=c[0]) for c in MOD])
def test_mod(n, n_min, n_max, prompt, steps, want):
    assert play(NgramMod(n, n_min, n_max), steps, prompt) == want


def test_mod_adds_generated_text_in_chunks_of_more_than_32():
    text = [*range(100, 110), 1, 2, 3, *range(200, 260)]     # a 10-token prompt, then generated text
    d = NgramMod(2, 0, 3)
    d.begin(i32(text[:10]), 0, None)                          # i_last = 8
    ctx = [*text[:39], 1, 2]                                  # cur_len 40: 8 + 32 < 40 is false, nothing added
    assert d.propose(i32(ctx), 16).tokens.tolist() == []
    ctx = [*text[:40], 1, 2]                                  # cur_len 41: starts 8..38 added, [1, 2] -> 3 among them
    assert d.propose(i32(ctx), 16).tokens.tolist() == [3, 200, 201]


def test_mod_low_acceptance_streak_empties_the_pool():
    """5 drafts in a row with accepted / drafted < 0.25 empty the pool and rewind i_last: the next
    draft adds the whole history again (more than 32 tokens here)."""
    seq = [*range(100, 140), A, B, C, D, E]                  # 45 tokens: [D, E] has no next token yet
    d = NgramMod(2, 0, 4)
    d.begin(i32(seq), 0, None)
    ctx = [*seq, A, B]
    for k in range(5):
        draft = d.propose(i32(ctx), 16).tokens.tolist()
        assert draft == [C, D, E]
        d.accept(verify_pass(ctx, draft, 0))
        assert (len(d.pool) == 0) == (k == 4)
    assert d.propose(i32(ctx), 16).tokens.tolist() == [C, D, E, A]   # all re-added from 0, [D, E] -> A too


def test_mod_an_accepted_draft_breaks_the_streak():
    seq = [*range(100, 140), A, B, C, D, E]
    d = NgramMod(2, 0, 4)
    d.begin(i32(seq), 0, None)
    ctx = [*seq, A, B]
    for n_acc in (0, 0, 0, 0, 1, 0, 0, 0, 0):                 # 1 of 3 is not low (< 0.25 is)
        draft = d.propose(i32(ctx), 16).tokens.tolist()
        d.accept(verify_pass(ctx, draft, n_acc))
    assert len(d.pool) > 0


def test_mod_pool_outlives_a_generation_and_fills_up(monkeypatch):
    d = NgramMod(2, 0, 4)
    d.begin(i32([X, A, B, C, D]), 0, None)
    d.begin(i32([Y, Z, A]), 0, None)                                      # another request, the same pool
    assert d.propose(i32([Y, Z, A, B]), 16).tokens.tolist() == [C, D]
    monkeypatch.setattr(mod_module, "MAX_OCCUPANCY", 0.0)
    d.begin(i32([X, A, B, C, D]), 0, None)                                # over the occupancy: emptied
    assert d.pool == {} and d.propose(i32([Y, Z, A, B]), 16).tokens.tolist() == []


def test_mod_defaults_and_bad_values():
    d = NgramMod()
    assert (d.n_match, d.n_min, d.n_max) == (24, 48, 64)
    for bad in (dict(n_match=0), dict(n_match=1025), dict(n_min=-1), dict(n_max=1025)):
        with pytest.raises(ValueError, match="1 <= n_match <= 1024 and 0 <= n_min, n_max <= 1024"):
            NgramMod(**bad)


# ---- ngram-cache ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("inserts", "order"), [
    ([5], [5]),
    ([1, 14, 2], [2, 14, 1]),             # 13 buckets: 14 joins 1's bucket in front of it; 2 opens a bucket at the front
    ([5, 18, 31], [31, 18, 5]),
    ([C, D], [D, C]),                     # two tokens: the newer first
])
def test_counts_iterate_like_libstdcxx(inserts, order):
    c = Counts()
    for t in inserts:
        c.add(t)
    assert list(c) == order


def write_cache(path: Path, entries: dict[tuple[int, ...], list[tuple[int, int]]]) -> str:
    """common_ngram_cache_save's format: int32 ngram[4] (-1 padded), int32 n, n x (token, count)."""
    with open(path, "wb") as f:
        for ngram, pairs in entries.items():
            f.write(struct.pack("<4i", *ngram, *[-1] * (4 - len(ngram))))
            f.write(struct.pack("<i", len(pairs)))
            for t, c in pairs:
                f.write(struct.pack("<2i", t, c))
    return str(path)


# (name, ctx, static entries, dynamic entries, n_max, draft)
CACHE = [
    ("cycle", [A, B, C, A, B, C, A, B], {}, {}, 16, [C, A, B, C, A, B, C, A]),
    ("n_max", [A, B, C, A, B, C, A, B], {}, {}, 3, [C, A, B]),
    ("a-3-gram-seen-once-drafts", [A, B, C, D, E, A, B, C], {}, {}, 16, [D, E, A, B, C, D, E, A]),
    ("a-2-gram-or-1-gram-seen-once-does-not", [A, B, C, X, A, B], {}, {}, 16, []),
    # [A, B] -> C once, D once: 2 samples, 50 %: a tie, and the newer token D comes first in iteration
    ("tie-goes-to-iteration-order", [A, B, C, X, A, B, D, Y, A, B], {}, {}, 16, [D, Y, A, B, D, Y, A, B]),
    # the longest n-gram decides: [B, C] -> D twice, but [A, B, C] -> E once
    ("longest-n-gram-first", [X, B, C, D, Y, B, C, D, A, B, C, E, Z, A, B, C], {}, {}, 1, [E]),
    # the static 2-gram [A, B] -> C x5 weighs C by 500: C beats D despite the order
    ("static-validates", [A, B, C, X, A, B, D, Y, A, B], {(A, B): [(C, 5)]}, {}, 1, [C]),
    ("static-alone", [X, A, B], {(A, B): [(C, 3), (D, 1)]}, {}, 1, [C]),
    ("static-alone-needs-2-samples", [X, A, B], {(A, B): [(C, 1)]}, {}, 1, []),
    ("static-alone-needs-50-percent", [X, A, B], {(A, B): [(C, 1), (D, 1), (E, 1)]}, {}, 1, []),
    ("dynamic-is-strict", [X, A, B], {}, {(A, B): [(C, 2)]}, 1, []),
    ("dynamic-3-samples", [X, A, B], {}, {(A, B): [(C, 3)]}, 1, [C]),
    ("dynamic-66-percent", [X, A, B], {}, {(A, B): [(C, 3), (D, 2)]}, 1, []),
    ("context-before-dynamic", [A, B, C, A, B, C, A, B], {}, {(A, B): [(D, 9)]}, 1, [C]),
    ("too-short", [A], {(A,): [(C, 9)]}, {}, 16, []),
]


@pytest.mark.parametrize(("ctx", "static", "dynamic", "n_max", "want"), [pytest.param(*c[1:], id=c[0]) for c in CACHE])
def test_cache(tmp_path, ctx, static, dynamic, n_max, want):
    s = write_cache(tmp_path / "static.bin", static) if static else None
    d = write_cache(tmp_path / "dynamic.bin", dynamic) if dynamic else None
    assert play(NgramCache(s, d), [(ctx, n_max, None)]) == [want]


def test_cache_counts_generated_text_only_in_runs():
    """Each call counts the tokens since the last one ALONE: grown one token at a time, the history
    below never yields [A, B, C] -> D; counted at once, it does."""
    seq = [P, Q, A, B, C, D, A, B, C]
    d = NgramCache()
    d.begin(i32(seq[:2]), 0, None)
    drafts = [d.propose(i32(seq[:k]), 16).tokens.tolist() for k in range(2, len(seq) + 1)]
    assert drafts[-1] == [] and d.context.keys() == {(P,)}
    assert NgramCache().propose(i32(seq), 16).tokens.tolist() == [D, A, B, C, D, A, B, C]


def test_cache_state_outlives_a_generation():
    d = NgramCache()
    assert d.propose(i32([A, B, C, A, B, C, A, B]), 1).tokens.tolist() == [C]
    d.begin(i32([X, Y]), 0, None)                           # shorter: nothing new is counted
    assert d.propose(i32([X, Y, A, B, C]), 1).tokens.tolist() == [A]   # [B, C] -> A from the first request


def test_cache_files_bad_and_missing(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(struct.pack("<5i", A, B, -1, -1, 2) + struct.pack("<2i", C, 1))   # 2 pairs announced, 1 given
    with pytest.raises(SpecrunError, match=r"^--lookup-cache-static .*bad.bin: not an n-gram cache file"):
        NgramCache(str(bad))
    with pytest.raises(SpecrunError, match=r"^--lookup-cache-dynamic .*none.bin: cannot read it"):
        NgramCache(None, str(tmp_path / "none.bin"))


# ---- the factory and the types --------------------------------------------------------------------


def test_types_parse_in_llama_cpp_order():
    assert parse_spec_types("draft-mtp,ngram-cache,ngram-mod,ngram-map-k4v,ngram-map-k,ngram-simple") == (
        "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-mtp")


def test_factory_builds_each_with_its_own_flags(tmp_path):
    path = write_cache(tmp_path / "s.bin", {(A, B): [(C, 2)]})
    spec = SpecParams(ngram_map_k=NgramMapParams(3, 7, 2), ngram_map_k4v=NgramMapParams(4, 9, 3),
                      ngram_mod=NgramModParams(16, 2, 20), ngram_cache=NgramCacheParams(path, None))
    k, k4v = make_drafter("ngram-map-k", None, spec), make_drafter("ngram-map-k4v", None, spec)
    assert (type(k), k.size_n, k.size_m, k.min_hits) == (NgramMapK, 3, 7, 2)
    assert (type(k4v), k4v.size_n, k4v.size_m, k4v.min_hits) == (NgramMapK4V, 4, 9, 3)
    m = make_drafter("ngram-mod", None, spec)
    assert (m.n_match, m.n_min, m.n_max) == (16, 2, 20)
    assert make_drafter("ngram-cache", None, spec).static[(A, B)].counts == {C: 2}
    # llama.cpp's common_speculative_n_max: each n-gram type's own bound
    assert [draft_n_max(t, spec) for t in ("ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")] == [7, 9, 20, 8]


# ---- against llama.cpp's own code -----------------------------------------------------------------


class Ref:
    """tests/data/ngram_ref.cpp over llama.cpp's common/ngram-*.cpp, as a child process."""

    def __init__(self, exe: Path) -> None:
        self.proc = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, *words) -> None:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()

    def ask(self, *words) -> list[int]:
        self.send(*words)
        return [int(t) for t in self.proc.stdout.readline().split()[1:]]

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=10) == 0


@pytest.fixture(scope="session")
def ref_exe(tmp_path_factory) -> Path:
    """tests/data/ngram_ref.cpp and the vendored llama.cpp sources, compiled once a session."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to compile llama.cpp's n-gram sources (tests/vendor/llama.cpp)")
    exe = tmp_path_factory.mktemp("ngram_ref") / "ngram_ref"
    sources = [Path(__file__).parent / "data" / "ngram_ref.cpp"]
    sources += [VENDOR / "common" / f"{name}.cpp" for name in ("ngram-map", "ngram-mod", "ngram-cache")]
    r = subprocess.run(["g++", "-O1", "-std=c++17", "-I", str(VENDOR / "common"), "-I", str(VENDOR / "shim"),
                        "-o", str(exe), *map(str, sources)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


def scenario(rng, drafter, ref: Ref, alphabet: int | tuple[int, ...], n_steps: int) -> int:
    """Several generations over one drafter (a new prompt sometimes extends the history, sometimes
    cuts it), each grown by drafts that are partly accepted; every draft compared. alphabet: the
    tokens (a count: 0..count-1). Returns the number of tokens drafted."""
    tokens = np.arange(alphabet) if isinstance(alphabet, int) else np.asarray(alphabet)

    def some(k: int) -> list[int]:
        return rng.choice(tokens, k).tolist()

    history = some(int(rng.integers(1, 40)))
    n_drafted = 0
    for _ in range(3):
        cut = int(rng.integers(1, len(history) + 1)) if rng.random() < 0.5 else len(history)
        prompt = history[:cut] + some(int(rng.integers(0, 20)))
        drafter.begin(i32(prompt), 0, None)
        ref.send("begin", len(prompt), *prompt)
        ctx = prompt + some(1)
        for _ in range(n_steps):
            n_max = int(rng.integers(1, 20))
            got = drafter.propose(i32(ctx), n_max).tokens.tolist()
            assert got == ref.ask("draft", n_max, len(ctx), *ctx), (ctx, n_max)
            n_acc = int(rng.integers(0, len(got) + 1)) if got else 0
            drafter.accept(verify_pass(ctx, got, n_acc))
            if got:
                ref.send("accept", n_acc)
            n_drafted += len(got)
            follow = rng.random() < 0.8      # low entropy: mostly the drafted tokens, then the history's
            ctx = ctx + got[:n_acc] + ([got[n_acc]] if follow and n_acc < len(got) else some(1))
        history = ctx[:-1]
    return n_drafted


@pytest.mark.parametrize(("kind", "args", "alphabet"), [
    ("k", (2, 3, 1), 3), ("k", (1, 4, 1), 4), ("k", (3, 2, 1), 2), ("k", (2, 2, 1), 5),
    ("k4v", (2, 3, 1), 3), ("k4v", (1, 2, 2), 3), ("k4v", (2, 2, 3), 2), ("k4v", (3, 4, 1), 4),
    ("mod", (2, 0, 8), 3), ("mod", (1, 2, 5), 4), ("mod", (3, 1, 16), 2), ("mod", (4, 0, 3), 5),
    # tokens that share hash slots: t and t + 2^18 in map's table (n = 1, 2), t and t + 2^22 in mod's pool
    ("k", (1, 2, 1), (0, 1, 2, 2**18, 2**18 + 1)), ("k4v", (2, 2, 1), (0, 1, 2**18, 2**18 + 1)),
    ("mod", (1, 0, 6), (0, 1, 2, 2**22, 2**22 + 1)), ("mod", (2, 1, 6), (0, 1, 2**22, 2**22 + 1)),
])
def test_map_and_mod_equal_llama_cpp(ref_exe, kind, args, alphabet):
    rng = np.random.default_rng([ord(kind[-1]), *args, *np.atleast_1d(alphabet).tolist()])
    n_drafted = 0
    for _ in range(4):
        ref = Ref(ref_exe)
        ref.send("init", kind, *args)
        drafter = {"k": NgramMapK, "k4v": NgramMapK4V, "mod": NgramMod}[kind](*args)
        n_drafted += scenario(rng, drafter, ref, alphabet, 60)
        ref.close()
    assert n_drafted > 0


@pytest.mark.parametrize(("alphabet", "files"), [(3, False), (6, False), (12, False), (4, True), (8, True)])
def test_cache_equals_llama_cpp(ref_exe, tmp_path, alphabet, files):
    rng = np.random.default_rng(100 * alphabet + files)

    def random_cache(path):
        entries = {}
        for _ in range(60):
            ngram = tuple(rng.integers(0, alphabet, int(rng.integers(1, 5))).tolist())
            toks = rng.choice(alphabet, int(rng.integers(1, alphabet)), replace=False).tolist()
            entries[ngram] = [(t, int(rng.integers(1, 4))) for t in toks]
        return write_cache(path, entries)

    n_drafted = 0
    for i in range(4):
        s = random_cache(tmp_path / f"s{i}.bin") if files else None
        d = random_cache(tmp_path / f"d{i}.bin") if files else None
        ref = Ref(ref_exe)
        ref.send("init", "cache", s or "-", d or "-")
        n_drafted += scenario(rng, NgramCache(s, d), ref, alphabet, 40)
        ref.close()
    assert n_drafted > 0


def test_counts_order_equals_libstdcxx(ref_exe):
    """Iteration order after up to 700 insertions (buckets 13 -> 29 -> ... -> 1109), spread and clustered ids."""
    rng = np.random.default_rng(5)
    ref = Ref(ref_exe)
    for k, hi in ((3, 40), (14, 30), (30, 100), (61, 262144), (200, 1000), (700, 5000)):
        toks = rng.choice(hi, k, replace=False).tolist()
        c = Counts()
        for t in toks:
            c.add(t)
        assert list(c) == ref.ask("order", k, *toks)
    ref.close()


# ---- the flags --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("flag", "value", "shown"), [
    ("--spec-ngram-map-k-size-n", "0", "0 is not in the range 1<=x<=1024"),
    ("--spec-ngram-map-k-size-m", "1025", "1025 is not in the range 1<=x<=1024"),
    ("--spec-ngram-map-k-min-hits", "0", "0 is not in the range x>=1"),
    ("--spec-ngram-map-k4v-size-n", "0", "0 is not in the range 1<=x<=1024"),
    ("--spec-ngram-map-k4v-size-m", "0", "0 is not in the range 1<=x<=1024"),
    ("--spec-ngram-map-k4v-min-hits", "0", "0 is not in the range x>=1"),
    ("--spec-ngram-mod-n-match", "0", "0 is not in the range 1<=x<=1024"),
    ("--spec-ngram-mod-n-min", "-1", "-1 is not in the range 0<=x<=1024"),
    ("--spec-ngram-mod-n-max", "2000", "2000 is not in the range 0<=x<=1024"),
    ("--spec-ngram-mod-n-max", "x", "'x' is not a valid integer range"),
])
def test_bad_flag_values_are_one_line(flag, value, shown):
    r = CliRunner().invoke(cli, ["-m", "smollm2-135m-instruct", "--spec-type", "ngram-map-k", flag, value,
                                 "-p", "hi", "-n", "1"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.output.strip().splitlines()[-1] == f"Error: Invalid value for '{flag}': {shown}."


def test_missing_lookup_cache_file_is_one_line(tmp_path):
    r = CliRunner().invoke(cli, ["-m", "smollm2-135m-instruct", "--spec-type", "ngram-cache", "-lcs",
                                 str(tmp_path / "none.bin"), "-p", "hi", "-n", "1"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.output.strip().splitlines()[-1].startswith("Error: Invalid value for '-lcs' / '--lookup-cache-static': File ")


def test_unknown_type_lists_the_family():
    r = CliRunner().invoke(cli, ["--spec-type", "ngram-map", "-p", "hi"])
    assert r.exit_code == 2
    assert "valid types: none, draft-simple, draft-eagle3, draft-mtp, ngram-simple, ngram-map-k, ngram-map-k4v, " \
           "ngram-mod, ngram-cache, suffix, draft" in r.output


# ---- output equal to none on real models (slow) -------------------------------------------------------

_CODE = (Path(__file__).parent / "data" / "copy_source.txt").read_text()
COPY_PROMPT = "Copy this file verbatim.\n\n" + _CODE[:1200] + "\n\nCopy:\n\n" + _CODE[:200]
FAMILY = {   # settings small enough to draft within 48 tokens of a short copy task
    "ngram-map-k": SpecParams(types=("ngram-map-k",), ngram_map_k=NgramMapParams(3, 12)),
    "ngram-map-k4v": SpecParams(types=("ngram-map-k4v",), ngram_map_k4v=NgramMapParams(2, 8, 1)),
    "ngram-mod": SpecParams(types=("ngram-mod",), ngram_mod=NgramModParams(4, 2, 16)),
    "ngram-cache": SpecParams(types=("ngram-cache",)),
    "combined": SpecParams(types=("ngram-map-k", "ngram-mod", "ngram-cache"), ngram_map_k=NgramMapParams(3, 12),
                           ngram_mod=NgramModParams(4, 2, 16)),
}


@pytest.fixture(scope="module")
def engines(smollm_path, gemma_path):
    """model name -> (engine, {temp: plain decoding's output}), each loaded once for the module
    when a test first names it."""
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams

    paths, loaded = {"smollm": smollm_path, "gemma": gemma_path}, {}

    def get(model: str):
        if model not in loaded:
            loaded[model] = (Engine(str(paths[model]), EngineParams(n_ctx=2048)), {})
        return loaded[model]

    yield get
    for e, _ in loaded.values():
        e.close()


# make test: each type alone on SmolLM2, greedy and seeded; the types combined, and Gemma, in the tail
@pytest.mark.slow
@pytest.mark.parametrize("model, name, temp", [
    pytest.param(model, name, temp, id=f"{model}-{name}-{temp}",
                 marks=() if model == "smollm" and name != "combined" else pytest.mark.full)
    for model in ("smollm", "gemma") for name in sorted(FAMILY) for temp in (0.0, 0.8)])
def test_family_equals_none(engines, model, name, temp):
    from specrun.kernels.types import SamplingParams

    engine, plains = engines(model)
    prompt = engine.tokenize(COPY_PROMPT)
    sampling = SamplingParams(temp=temp, seed=1234)

    def run(spec):
        gen = engine.generate(prompt, 48, sampling, spec=spec)
        return [t for toks in gen for t in toks], gen.stats

    if temp not in plains:
        plains[temp] = run(SpecParams())[0]
    got, st = run(FAMILY[name])
    assert got == plains[temp]
    assert st.n_drafted > 0 and st.n_accepted > 0, (st.n_drafted, st.n_accepted)
    assert st.n_target_passes < st.n_gen - 1


# under 256 tokens: the CLI's prompt path stays the exact one (what is tested here is the flags and the statistics)
CLI_PROMPT = "Copy this file verbatim.\n\n" + _CODE[:500] + "\n\nCopy:\n\n" + _CODE[:150]


@pytest.mark.slow
@pytest.mark.full
def test_cli_ngram_map_k_prints_the_text_of_none(smollm_path):
    args = ["-m", str(smollm_path), "-p", CLI_PROMPT, "-n", "32", "--temp", "0", "-c", "1024", "-no-cnv"]
    none = CliRunner().invoke(cli, [*args, "--spec-type", "none"])
    got = CliRunner().invoke(cli, [*args, "--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                                   "--spec-ngram-map-k-size-m", "12", "--spec-ngram-map-k-min-hits", "1"])
    assert none.exit_code == 0 and got.exit_code == 0, got.output
    assert got.stdout == none.stdout and len(none.stdout) > 20
    assert re.search(r"^statistics +ngram-map-k: #gen drafts = [1-9]", got.stderr, re.M), got.stderr


def test_flags_reach_spec_params(monkeypatch, tmp_path):
    """run's flags -> SpecParams (stopped before loading the model)."""
    import specrun.cli.runtime.options as run_cmd  # run_options, which builds run's EngineParams

    seen = []
    real = run_cmd.engine_params

    def capture(kw, spec=None):
        seen.append(real(kw, spec).spec)
        raise SpecrunError("stop here")

    monkeypatch.setattr(run_cmd, "engine_params", capture)
    path = write_cache(tmp_path / "s.bin", {(A, B): [(C, 2)]})
    r = CliRunner().invoke(cli, ["--spec-type", "ngram-cache,ngram-mod,ngram-map-k4v,ngram-map-k", "-p", "hi",
                                 "--spec-ngram-map-k-size-n", "3", "--spec-ngram-map-k-size-m", "9",
                                 "--spec-ngram-map-k-min-hits", "2", "--spec-ngram-map-k4v-size-n", "4",
                                 "--spec-ngram-map-k4v-size-m", "5", "--spec-ngram-map-k4v-min-hits", "6",
                                 "--spec-ngram-mod-n-match", "7", "--spec-ngram-mod-n-min", "0",
                                 "--spec-ngram-mod-n-max", "1024", "-lcs", path, "--lookup-cache-dynamic", path])
    assert r.output.strip().splitlines()[-1] == "Error: stop here"
    (spec,) = seen
    assert spec.types == ("ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
    assert (spec.ngram_map_k, spec.ngram_map_k4v, spec.ngram_mod, spec.ngram_cache) == (
        NgramMapParams(3, 9, 2), NgramMapParams(4, 5, 6), NgramModParams(7, 0, 1024), NgramCacheParams(path, path))
    r = CliRunner().invoke(cli, ["--spec-type", "ngram-mod", "-p", "hi"])
    assert seen[-1].ngram_mod == NgramModParams(24, 48, 64) and seen[-1].ngram_map_k == NgramMapParams(12, 48, 1)


def test_bench_runs_each_n_gram_type_once_with_its_flags():
    from specrun.cli.bench_cmd import parse_settings

    family = dict(ngram_mod=NgramModParams(4, 2, 16), ngram_map_k=NgramMapParams(3, 12, 1))
    s = parse_settings("ngram-map-k,ngram-mod+ngram-cache,draft-mtp", "1,3", 12, 48, family)
    assert [(x.label, x.spec.n_max) for x in s] == [
        ("none", 3), ("ngram-map-k", 1), ("ngram-mod+ngram-cache", 1), ("draft-mtp", 1), ("draft-mtp", 3)]
    assert s[1].spec.ngram_map_k == NgramMapParams(3, 12, 1) and s[2].spec.ngram_mod == NgramModParams(4, 2, 16)

"""NgramSimple against llama.cpp's common_ngram_simple_draft (common/ngram-map.cpp)."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.kernels.drafters import NgramSimple
from specrun.kernels.types import Draft, TargetPass


def llama_ngram_simple(ctx: list[int], n: int, m: int, n_max: int) -> list[int]:
    """common_ngram_simple_draft(tokens = ctx[:-1], sampled = ctx[-1]) line by line, then
    common_speculative_draft's truncation to n_max (specrun: n_max <= 0 means no draft)."""
    tokens, sampled = ctx[:-1], ctx[-1]
    cur_len = len(tokens)
    if cur_len <= n + m + 1:
        return []
    pattern = [tokens[j] for j in range(cur_len - n + 1, cur_len)] + [sampled]
    match_pos = 0
    for j in range(cur_len - n - 1, 0, -1):
        if all(tokens[j + k] == pattern[k] for k in range(n)):
            match_pos = j
            break
    if match_pos == 0:
        return []
    copy_max = min(m, cur_len - (match_pos + n))
    if copy_max < n:
        return []
    draft = [tokens[match_pos + n + j] for j in range(copy_max)]
    return draft[:n_max] if n_max > 0 else []


def propose(ctx: list[int], n: int = 2, m: int = 3, n_max: int = 16, min_hits: int = 1) -> list[int]:
    drafter = NgramSimple(size_n=n, size_m=m, min_hits=min_hits)
    drafter.begin(np.asarray(ctx[:-1], dtype=np.int32))
    draft = drafter.propose(np.asarray(ctx, dtype=np.int32), n_max)
    assert isinstance(draft, Draft) and draft.probs is None and draft.tokens.dtype == np.int32
    return draft.tokens.tolist()


X, Y, Z, A, B, C, D, E, F, G, W = range(10, 21)

# (ctx ending with id_last, size_n, size_m, n_max, expected draft)
CASES = [
    pytest.param([X, A, B, C, D, E, Y, Z, A, B], 2, 3, 16, [C, D, E], id="match-found"),
    pytest.param([X, A, B, C, D, E, Y, A, B, F, G, Z, A, B], 2, 3, 16, [F, G, Z], id="last-occurrence-wins"),
    pytest.param([X, A, B, C, D, E, Y, Z, F, G, E, A, B, G, D, A, B], 2, 4, 16, [G, D, A], id="copy-stops-at-history-end"),
    pytest.param([X, A, B, C, D, E, F, G, A, B, A, B], 2, 3, 16, [], id="last-too-recent-no-fallback"),
    pytest.param([A, B, C, D, E, F, G, Z, A, B], 2, 3, 16, [], id="position-0-never-matches"),
    pytest.param([X, A, B, C, D, E, Y, Z, F, G], 2, 3, 16, [], id="no-match"),
    pytest.param([X, A, B, C, D, E, Y, Z, A, C], 2, 3, 16, [], id="partial-match-only"),
    pytest.param([X] + [A] * 12, 2, 3, 16, [], id="repeated-token-never-drafts"),
    pytest.param([X, A, B, C, D, E, Y, Z, A, B], 2, 3, 2, [C, D], id="n_max-cap"),
    pytest.param([X, A, B, C, D, E, Y, Z, A, B], 2, 3, 1, [C], id="n_max-below-size_n"),
    pytest.param([X, A, B, C, D, E, Y, Z, A, B], 2, 3, 0, [], id="n_max-zero"),
    pytest.param([X, A, B, C, D, A, B], 2, 3, 16, [], id="short-context-L=n+m+2"),
    pytest.param([X, A, B, C, D, Y, A, B], 2, 3, 16, [C, D, Y], id="context-L=n+m+3"),
    pytest.param([X, A, B, C, D, E, F, Y, A, B], 2, 6, 16, [], id="short-context-bigger-m"),
    pytest.param([X, A, C, D, Y, Z, A], 1, 2, 16, [C, D], id="unigram"),
    pytest.param([X, A, B, C, D, E, Y, Z, A, B], 3, 2, 16, [], id="size_m-below-size_n-never-drafts"),
    pytest.param([W, X, Y, A, B, C, D, E, F, G, Z, X, Y, A, B], 4, 5, 16, [C, D, E, F, G], id="4-gram"),
    pytest.param([X, Y, A, B, C, D, E, F, G, Z, X, Y, A, B], 4, 5, 16, [], id="4-gram-at-position-0"),
]


@pytest.mark.parametrize(("ctx", "n", "m", "n_max", "want"), CASES)
def test_constructed(ctx, n, m, n_max, want):
    assert llama_ngram_simple(ctx, n, m, n_max) == want  # the table agrees with llama.cpp's rule
    assert propose(ctx, n, m, n_max) == want


@pytest.mark.parametrize(("ctx", "n", "m", "n_max", "want"), CASES)
def test_min_hits_is_ignored_like_llama_cpp(ctx, n, m, n_max, want):
    assert propose(ctx, n, m, n_max, min_hits=5) == want


def test_defaults_match_llama_cpp():
    d = NgramSimple()
    assert (NgramSimple.spec_type, d.size_n, d.size_m, d.min_hits) == ("ngram-simple", 12, 48, 1)
    text = list(range(100, 200))  # 100 distinct tokens, then the first 12 again
    ctx = [7, *text, *text[:12]]
    assert propose(ctx, 12, 48, 64) == text[12:60]  # capped at size_m = 48
    assert propose(ctx, 12, 48, 5) == text[12:17]


@pytest.mark.parametrize("bad", [dict(size_n=0), dict(size_m=0)])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="size_n >= 1 and size_m >= 1"):
        NgramSimple(**bad)


@pytest.mark.parametrize(("alphabet", "n", "m"), [(2, 1, 1), (3, 2, 3), (3, 3, 8), (4, 2, 5), (2, 4, 4), (5, 1, 6)])
def test_equals_brute_force_incrementally(alphabet, n, m):
    """Random low-entropy sequences grown token by token (the incremental index), random n_max,
    with begin() on a prompt and the drafter told about accepted tokens like the loop does."""
    rng = np.random.default_rng(1000 * alphabet + 10 * n + m)
    for _ in range(5):
        prompt = rng.integers(0, alphabet, int(rng.integers(1, 30))).tolist()
        drafter = NgramSimple(size_n=n, size_m=m)
        drafter.begin(np.asarray(prompt, dtype=np.int32))
        ctx = list(prompt)
        n_drafted = 0
        for _ in range(150):
            n_max = int(rng.integers(0, m + 3))
            draft = drafter.propose(np.asarray(ctx, dtype=np.int32), n_max).tokens.tolist()
            assert draft == llama_ngram_simple(ctx, n, m, n_max), (ctx, n_max)
            n_drafted += len(draft)
            # emit 1..3 tokens, sometimes following the draft (so repeats keep coming)
            emitted = draft[: int(rng.integers(0, len(draft) + 1))] + rng.integers(0, alphabet, 1).tolist()
            batch = np.asarray([ctx[-1], *draft], dtype=np.int32)   # the verify pass [id_last, d1..dk]
            drafter.accept(TargetPass(batch, len(ctx) - 1, len(emitted)))
            ctx.extend(emitted)
        assert n_drafted > 0


def test_equals_brute_force_when_context_is_not_an_extension():
    """A ctx that rewrites history (or shrinks) rebuilds the index instead of trusting it."""
    rng = np.random.default_rng(7)
    drafter = NgramSimple(size_n=2, size_m=4)
    drafter.begin(np.zeros(0, dtype=np.int32))
    for _ in range(300):
        ctx = rng.integers(0, 3, int(rng.integers(1, 80))).tolist()
        n_max = int(rng.integers(1, 6))
        assert drafter.propose(np.asarray(ctx, dtype=np.int32), n_max).tokens.tolist() == llama_ngram_simple(ctx, 2, 4, n_max)


def test_begin_forgets_the_previous_sequence():
    drafter = NgramSimple(size_n=2, size_m=3)
    first = [X, A, B, C, D, E, Y, Z, A, B]
    drafter.begin(np.asarray(first[:-1], dtype=np.int32))
    assert drafter.propose(np.asarray(first, dtype=np.int32), 8).tokens.tolist() == [C, D, E]
    second = [X, A, B, F, G, E, Y, Z, A, B]  # same length, same prefix token: must not reuse the old index
    drafter.begin(np.asarray(second[:-1], dtype=np.int32))
    assert drafter.propose(np.asarray(second, dtype=np.int32), 8).tokens.tolist() == [F, G, E]


def test_long_context_with_default_sizes():
    """A few thousand tokens of repetitive text with the defaults, grown step by step."""
    rng = np.random.default_rng(11)
    phrases = [rng.integers(0, 500, int(rng.integers(20, 80))).tolist() for _ in range(6)]
    ctx: list[int] = []
    while len(ctx) < 3000:
        ctx += phrases[int(rng.integers(0, 6))] + rng.integers(0, 500, 3).tolist()
    drafter = NgramSimple()
    drafter.begin(np.asarray(ctx[:200], dtype=np.int32))
    n_drafts = 0
    for L in range(201, len(ctx), 7):
        draft = drafter.propose(np.asarray(ctx[:L], dtype=np.int32), 16).tokens.tolist()
        assert draft == llama_ngram_simple(ctx[:L], 12, 48, 16)
        n_drafts += bool(draft)
    assert n_drafts > 50


# ---- match="longest" (specrun's; what --spec-type auto runs) ----------------------------------------


def longest_ngram_simple(ctx: list[int], n: int, m: int, n_max: int, back_max: int = 64) -> list[int]:
    """The rule, spelled out: of the starts j in [1, L - n - 2] of the last n tokens with
    copy_max = min(m, L - 1 - (j + n)) >= n, the one whose preceding tokens equal those before the
    current occurrence for the longest stretch (at most back_max), the latest among equals."""
    L = len(ctx)
    if n_max <= 0 or L <= n + m + 2:
        return []
    best, best_run = 0, -1
    for j in range(1, L - n - 1):
        if ctx[j:j + n] != ctx[L - n:] or min(m, L - 1 - (j + n)) < n:
            continue
        run_ = 0
        while run_ < back_max and j - 1 - run_ >= 0 and ctx[j - 1 - run_] == ctx[L - n - 1 - run_]:
            run_ += 1
        if run_ >= best_run:
            best, best_run = j, run_
    if best == 0:
        return []
    return ctx[best + n:best + n + min(m, L - 1 - (best + n), n_max)]


LONGEST_CASES = [
    # the a, b at 2 is preceded by c, as the current one is; the one at 7 by d: copy after 2
    pytest.param([X, C, A, B, Y, Z, D, A, B, W, F, C, A, B], 2, 2, [Y, Z], [W, F], id="same-context-wins"),
    # no occurrence shares a preceding token: the latest, as "last"
    pytest.param([X, C, A, B, Y, Z, D, A, B, W, F, E, A, B], 2, 2, [W, F], [W, F], id="tie-latest"),
    # the latest is too recent for n tokens: "last" gives nothing, "longest" the one with room
    pytest.param([X, A, B, C, D, E, F, G, A, B, A, B], 2, 3, [C, D, E], [], id="too-recent-skipped"),
    # a longer stretch beats a shorter one
    pytest.param([X, E, C, A, B, Y, Z, D, C, A, B, W, F, G, E, C, A, B], 2, 2, [Y, Z], [W, F], id="longer-stretch"),
    # equal stretches (64 tokens, the most compared): the latest, as "last" (a periodic text)
    pytest.param([A, B, C] * 40 + [A, B], 2, 4, [C, A], [C, A], id="periodic-latest"),
]


@pytest.mark.parametrize("ctx, n, m, want_longest, want_last", LONGEST_CASES)
def test_longest_match_worked_cases(ctx, n, m, want_longest, want_last):
    for match, want in (("longest", want_longest), ("last", want_last)):
        d = NgramSimple(size_n=n, size_m=m, match=match)
        d.begin(np.asarray(ctx[:-1], dtype=np.int32))
        assert d.propose(np.asarray(ctx, dtype=np.int32), 16).tokens.tolist() == want, match
    assert longest_ngram_simple(ctx, n, m, 16) == want_longest


@pytest.mark.parametrize(("alphabet", "n", "m"), [(2, 1, 1), (3, 2, 3), (3, 3, 8), (4, 2, 5), (2, 4, 4)])
def test_longest_equals_its_rule_incrementally(alphabet, n, m):
    rng = np.random.default_rng(7 * alphabet + 3 * n + m)
    for _ in range(4):
        ctx = rng.integers(0, alphabet, int(rng.integers(1, 20))).tolist()
        d = NgramSimple(size_n=n, size_m=m, match="longest")
        d.begin(np.asarray(ctx, dtype=np.int32))
        for _ in range(120):
            n_max = int(rng.integers(0, m + 3))
            got = d.propose(np.asarray(ctx, dtype=np.int32), n_max).tokens.tolist()
            assert got == longest_ngram_simple(ctx, n, m, n_max), (ctx, n_max)
            ctx += (got[: int(rng.integers(0, len(got) + 1))] + rng.integers(0, alphabet, 1).tolist())


def test_longest_on_a_long_repetitive_context():
    """Thousands of occurrences of the pattern (the latest CANDIDATES_MAX are weighed, each the same
    64 tokens back): the latest with room, as "last"; a different sentence among them is found."""
    ctx = np.asarray(([A, B, C] * 3000) + [D, E, A, B, F, G] + ([A, B, C] * 50) + [D, E, A, B], dtype=np.int32)
    for match, want in (("longest", [F, G, A, B, C, A, B, C, A, B, C, A, B, C, A, B]), ("last", [C, D, E, A])):
        d = NgramSimple(size_n=2, size_m=16, match=match)
        d.begin(ctx[:-1])
        assert d.propose(ctx, 16).tokens.tolist() == want, match


def test_match_is_checked():
    with pytest.raises(ValueError, match="ngram-simple match 'first': use one of last, longest"):
        NgramSimple(2, 3, match="first")

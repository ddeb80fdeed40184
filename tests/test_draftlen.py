"""The cost-aware draft length (kernels/draftlen.py), against hand-worked numbers."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.kernels.draftlen import (
    DECAY,
    HELD_SHARE,
    MAX_IDLE,
    Acceptance,
    DraftLength,
    PassCost,
    best_length,
    curve_rows,
    expected_tokens,
    score_shadow,
    share_rows,
    ubatch_rows,
)


def test_expected_tokens():
    assert expected_tokens(1.0, 7) == 8.0
    assert expected_tokens(0.0, 7) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def cost(c0: float, c1: float) -> PassCost:
    c = PassCost()
    c.record(1, c0 + c1)
    c.record(9, c0 + 9 * c1)
    return c


def test_curve_rows_time_both_sides_of_every_4th_row():
    assert curve_rows(1) == [1] and curve_rows(3) == [1, 2, 3]
    assert curve_rows(17) == [1, 2, 4, 5, 8, 9, 12, 13, 16, 17]
    assert curve_rows(49) == [1, 2, 4, 5, 8, 9, 12, 13, 16, 17, 32, 33, 49]
    assert curve_rows(63)[-3:] == [32, 33, 63]


# SmolLM2 in exact mode on the Xeon, 2 threads, 200-token context: ms of a pass of r rows (blocks of 4)
XEON_SMOLLM2 = {1: 11.7, 2: 15.9, 3: 19.5, 4: 23.3, 5: 29.7, 6: 33.5, 7: 37.5, 8: 39.4, 9: 45.8, 10: 49.9,
                11: 53.9, 12: 54.6, 13: 60.8, 14: 64.5, 15: 68.3, 16: 70.2, 17: 77.3}


def test_a_sure_copy_stops_before_the_row_that_starts_a_block():
    """Read through curve_rows, t(r) shows the step at 17 rows: a copy sure to be right is drafted
    to 15 tokens (16 rows, 16 tokens in 70.2 ms) rather than 16 (17 in 77.3). Through 1, 2, 4, 8, 16
    only, 17 rows read as the slope past 16 and the 16-token draft looked better."""
    def read_at(rows):
        c = PassCost()
        for r in rows:
            c.record(r, XEON_SMOLLM2[r] / 1e3)
        return c
    assert best_length(1.0, read_at(curve_rows(17)), 16, 0) == 15
    assert best_length(1.0, read_at((1, 2, 4, 8, 16)), 16, 0) == 16
    # and 11 tokens (12 rows: 54.6 ms) where a 12-token draft (13 rows, 60.8) would cost more per token
    assert best_length(1.0, read_at(curve_rows(17)), 12, 0) == 11


def test_pass_cost_line_and_prior():
    assert PassCost().line() == (1.0, 0.25)
    c = cost(0.75, 0.25)
    assert c.line() == pytest.approx((0.75, 0.25)) and c.at(5) == pytest.approx(2.0)
    one = PassCost()
    one.record(5, 2.25)                    # one point: through it, the prior's slope ratio
    assert one.line() == pytest.approx((1.0, 0.25))
    flat = PassCost()
    flat.record(1, 1.0)
    flat.record(9, 0.5)                    # a decreasing fit is clamped to a flat cost
    assert flat.line() == pytest.approx((0.75, 0.0))


def test_pass_cost_plain_steps_at_a_longer_context_raise_the_whole_curve():
    # SmolLM2 in exact mode: the probe near position 0, then plain steps at a 2,300-token context
    c = PassCost()
    for r, ms in ((1, 10.0), (2, 19.0), (4, 28.0), (8, 47.0), (16, 90.0), (17, 95.0)):
        c.record(r, ms / 1e3)
    assert c.scale == 1.0 and c.at(17) == pytest.approx(0.095)     # each count once: no level yet
    for _ in range(40):
        c.record(1, 0.025)
    assert c.at(1) == pytest.approx(0.025, rel=0.01)
    assert c.at(17) / c.at(1) > 8.5               # the probe's shape (9.5), not 95 ms / 25 ms
    assert c.at(2) / c.at(1) > 1.8
    # a copy whose first token is a coin flip and then right at 0.9: E(16) = 5.07 tokens for
    # 17 rows, at 9.1 times a row's cost here: held back. A fresh t(1) (25 ms) against the probe's
    # stale t(4) (28 ms) would have drafted 3 (E(3) = 2.36 tokens for 28 ms)
    a = [0.5] + [0.9] * 15
    assert best_length(a, c, 16, k_min=0) == 0
    stale = PassCost({r: [1, ms / 1e3] for r, ms in ((1, 25.0), (2, 19.0), (4, 28.0), (8, 47.0), (16, 90.0),
                                                     (17, 95.0))})
    assert best_length(a, stale, 16, k_min=0) == 3
    # a pass of a count seen before moves the level half way to its ratio, and its base by 1/16
    t1, t17, base17 = c.at(1), c.at(17), c.sums[17][1]
    c.record(17, 2 * t17)
    assert c.at(1) == pytest.approx(1.5 * t1) and c.sums[17][1] == pytest.approx(base17 * (1 + 1 / 48))


@pytest.mark.parametrize(("a", "c0", "c1", "cap", "want"), [
    (1.0, 1.0, 0.25, 16, 16),     # a verbatim copy: the longest draft pays
    (0.999, 1.0, 0.25, 62, 62),
    (0.0, 1.0, 0.25, 16, 1),      # never right: the least (1, to keep learning)
    (0.5, 1.0, 0.25, 16, 1),      # k=1: 1.5/1.5 = k=2: 1.75/1.75 = 1.0 -> the shorter
    (0.8, 1.0, 0.25, 16, 4),      # 3.3616/2.25 = 1.494 beats k=3 (1.476) and k=5 (1.476)
    (0.8, 1.0, 0.25, 3, 3),       # within the cap
    (0.8, 1.0, 0.0, 16, 16),      # free rows: always the longest
    (0.8, 1.0, 1.0, 16, 2),       # rows as dear as a pass: 2.44/4 = 0.61 beats 1.8/3 and 2.952/5
])
def test_best_length(a, c0, c1, cap, want):
    assert best_length(a, cost(c0, c1), cap) == want


@pytest.mark.parametrize(("a", "c0", "c1", "want"), [
    (0.148, 1.0, 0.25, 0),        # 1.148 / 1.5 = 0.765 < 1 / 1.25: a plain step pays more
    (0.21, 1.0, 0.25, 1),         # 1.21 / 1.5 = 0.807 > 0.8
    (0.0, 1.0, 0.0, 0),           # free rows but never right: ties go to the shorter
    (0.9, 1.0, 0.25, 7),          # 5.695 / 3 = 1.898: as with k_min 1
])
def test_best_length_may_hold_a_free_drafter_back(a, c0, c1, want):
    assert best_length(a, cost(c0, c1), 16, k_min=0) == want


def test_shadow_drafts_are_scored_once_decided():
    sh = (3, np.asarray([7, 8, 9], np.int32))
    assert score_shadow(sh, [0, 1, 2]) == (0, False)              # nothing emitted yet
    assert score_shadow(sh, [0, 1, 2, 7, 8]) == (2, False)        # right so far
    assert score_shadow(sh, [0, 1, 2, 7, 8, 9, 4]) == (3, True)   # all of it
    assert score_shadow(sh, [0, 1, 2, 7, 5]) == (1, True)         # wrong at its 2nd token
    assert score_shadow(sh, [0, 1, 2, 6]) == (0, True)


def test_acceptance_by_position():
    acc = Acceptance()
    assert acc.rates(3) == [0.5, 0.5, 0.5]                   # the prior; unreached positions follow
    acc.record(4, 0)                                         # wrong at its first token
    acc.record(4, 4)                                         # then a whole copy
    r0 = (0.8 * 0.8 * 1 + 1) / (0.8 * 0.8 * 2 + 0.8 + 1)     # prior and both drafts, decayed
    r1 = (1 + r0) / (1 + 1)                                  # one draft reached token 2 and got it
    assert acc.rates(2) == pytest.approx([r0, r1])
    for _ in range(6):                                       # a copy that is wrong at its start
        acc.record(16, 0)                                    # half the time and then right
        acc.record(16, 16)
    a = acc.rates(16)
    assert a[0] < 0.6 and min(a[1:]) > 0.85
    # the longest draft pays (E(16) = 1 + 16 / 2 = 9 tokens for 5.25 against 6 for 3.75 at k = 10);
    # one rate for every position, accepted / (accepted + rejections) = 16 / 17, stops short of it
    assert best_length(a, PassCost(), 16) == 16
    assert best_length(16 / 17, PassCost(), 16) < 16


def test_a_copy_seen_to_end_once_far_out_does_not_make_a_coin_flip_of_every_token_past_it():
    """A position no draft has reached takes the best rate before it, not the one right before it:
    among copies right to their 11th (and last) token, one proposal that ended at its 11th lowers
    that position, and the positions past it, never reached, stay where the copies were."""
    acc = Acceptance.of_copies()
    for _ in range(4):
        acc.record(11, 11)
    acc.record(16, 10)                                       # tokens 1-10 right, the 11th wrong
    a = acc.rates(16)
    assert a[10] < 0.8 < min(a[:10])
    assert a[11:] == [max(a[1:10])] * 5 and a[11] > 0.95     # (the one before: a[10], under 0.8)


def test_acceptance_follows_the_text():
    acc = Acceptance()
    assert acc.rate == 0.5
    for _ in range(10):
        acc.record(8, 8)                   # a copy: every draft accepted
    assert acc.rate > 0.95
    assert best_length(acc.rate, PassCost(), 16) == 16
    for _ in range(5):
        acc.record(8, 0)                   # the copy ended
    assert acc.rate < 0.8 and best_length(acc.rate, PassCost(), 16) <= 4


def test_prior_of_copies():
    """A free drafter's prior: its first token right half the time, a copy right so far right at
    its next token with 0.9; a model drafter's stays 0.5 everywhere."""
    assert DraftLength(16, True, 0).acc.rates(3) == pytest.approx([0.5, 0.9, 0.9])
    assert DraftLength(16, True, 1).acc.rates(3) == [0.5, 0.5, 0.5]


def copy_run(period: int, n_tokens: int = 210, cap: int = 16) -> list[tuple[int, int]]:
    """(drafted, accepted) of each verify pass of an adaptive free drafter over a text whose
    earlier copy is right for period - 1 tokens and then wrong once, again and again: the text is
    0, 1, 2, ...; the copy has -1 where i % period == period - 1. The target keeps the draft's
    right prefix and adds its own token (the bonus or the recovered one), as the engine does."""
    dl, c = DraftLength(cap, True, 0), PassCost()
    for r in (1, 9):
        c.record(r, 1 + r / 4)
    dl.start(c)
    ctx, passes = [0], []
    while len(ctx) < n_tokens:
        pos = len(ctx)
        proposal = np.asarray([-1 if i % period == period - 1 else i for i in range(pos, pos + cap)], np.int32)
        k = len(dl.take(proposal, pos, cap, c))
        n_acc = next((j for j in range(k) if proposal[j] != pos + j), k)
        ctx += list(range(pos, pos + n_acc + 1))
        if k:
            passes.append((k, n_acc))
            dl.record(k, n_acc, c)                           # as the engine does after a verify
        dl.score(ctx, c)
    return passes


def test_free_drafter_learns_whole_copies_not_its_cut():
    """A free drafter learns from its whole proposals, scored against the emitted text, not from
    the cut that was verified (which says nothing past the cut: the next draft of the same copy
    would start mid-copy and fail early, read as copies failing at their token 3)."""
    c = PassCost()
    dl = DraftLength(16, True, 0)
    dl.start(c)                                              # the prior line 1 + r / 4: it drafts
    before = (list(dl.acc.reached), list(dl.acc.accepted))
    assert len(dl.take(np.arange(100, 116, dtype=np.int32), 4, 16, c)) == dl.n > 0
    dl.record(dl.n, dl.n, c)                                 # the cut, all accepted: not learned from
    assert (dl.acc.reached, dl.acc.accepted) == before
    dl.score([0, 1, 2, 3, *range(100, 106), 7], c)           # the whole proposal: right for 6 of 16
    assert dl.shadow is None and len(dl.acc.reached) == 16 and dl.acc.accepted[5] > dl.acc.accepted[6] == 0
    # copies right for 6 tokens: the cut settles at 6 (7 tokens a pass at 2.75, against 4 at 1.75
    # for 3) and stays there; right for longer than the cap: the whole cap
    assert copy_run(7)[-10:] == [(6, 6)] * 10
    assert copy_run(13)[-5:] == [(12, 12)] * 5
    assert copy_run(10_000)[-5:] == [(16, 16)] * 5


def test_a_held_back_copy_that_proves_right_is_drafted_from_where_it_is():
    """Held back at 0 (a copy's first token was wrong three times), a pending copy right for its
    first j tokens is judged from position j on: drafted, not left to run out in plain steps."""
    dl, c = DraftLength(16, True, 0), PassCost()
    for r in (1, 9):
        c.record(r, 1 + r / 4)
    for _ in range(3):
        dl.acc.record(16, 0)
    dl.start(c)
    assert dl.n == 0
    copy = np.arange(100, 116, dtype=np.int32)
    assert len(dl.take(copy, 10, 16, c)) == 0                # pending now, held back
    ctx = list(range(10)) + [100, 101]                       # the target wrote its first two
    dl.score(ctx, c)
    assert dl.shadow is not None                             # still pending: right so far
    cont = dl.take(copy[2:], 12, 16, c)                      # its continuation: drafted
    assert len(cont) >= 3 and list(cont) == list(copy[2:2 + len(cont)])
    # a proposal from another copy: the pending one's rest is drafted (a held-back drafter's
    # ngram lookup may find another match while the copy it proposed before goes on being right)
    assert list(dl.take(np.arange(7, 23, dtype=np.int32), 12, 16, c)) == list(cont)
    assert len(dl.take(copy[2:], 12, 2, c)) == 2             # within the engine's limit
    dl.score([*ctx, 5], c)                                   # the copy ended
    assert dl.shadow is None
    new = dl.take(np.arange(7, 23, dtype=np.int32), 13, 16, c)   # a new copy: judged from its start
    assert len(new) == dl.n and dl.shadow[0] == 13


def test_a_proposal_that_goes_on_from_a_copy_right_to_its_end_is_judged_as_its_continuation():
    """A copy right to its end (the cap cut it, not a mismatch) and a new proposal where it ended:
    the text is still copying, so the new one is judged and scored from a copy's second token,
    not held back as a fresh copy's uncertain first token."""
    dl, c = DraftLength(8, True, 0), PassCost()
    for r in (1, 9):
        c.record(r, 1 + r)               # t(r) = 1 + r, rows dear: a fresh copy is held back
    for _ in range(3):
        dl.acc.record(8, 0)
    dl.start(c)
    first = np.arange(100, 108, dtype=np.int32)
    assert len(dl.take(first, 10, 8, c)) == 0                # a fresh copy: held back
    ctx = list(range(10))
    for t in first:                                          # the text copies it to its end
        ctx.append(int(t))
        dl.score(ctx, c)
        if dl.shadow is not None:
            dl.take(first[len(ctx) - 10:], len(ctx), 8, c)
    assert dl.shadow is None and dl.run_end == 18
    reached = list(dl.acc.reached)
    nxt = np.arange(108, 116, dtype=np.int32)
    assert len(dl.take(nxt, 18, 8, c)) > 0 and dl.at == 1  # its continuation: drafted
    dl.score([*ctx, *range(108, 112), 0], c)                 # right for 4, then wrong
    assert dl.acc.reached[0] == pytest.approx(reached[0] * DECAY)   # scored from token 2 on
    assert dl.acc.reached[1] == pytest.approx(reached[1] * DECAY + 1) and dl.run_end == -1
    assert len(dl.take(nxt, 23, 8, c)) == 0 and dl.at == 0  # a fresh copy again


def xeon() -> PassCost:
    c = PassCost()
    for r, ms in XEON_SMOLLM2.items():
        c.record(r, ms / 1e3)
    return c


def test_a_held_back_free_drafter_is_asked_every_few_steps():
    """Held back, a free drafter is asked as seldom as keeps its proposals at HELD_SHARE of a
    plain step's time (at most MAX_IDLE steps skipped); once it drafts it is asked every step.
    A model drafter is always asked."""
    c = cost(0.01, 0.0)                              # t(r) = 10 ms
    dl = DraftLength(16, True, 0)

    def asked(n: int) -> list[bool]:
        return [dl.ask() for _ in range(n)]

    dl.pace(0, 0.0004, c)                            # 0.4 ms: 4 % of a step -> 4 steps skipped
    assert asked(6) == [False] * 4 + [True, True]
    dl.pace(3, 0.0004, c)                            # drafted: the next step asks
    assert asked(2) == [True, True]
    dl.pace(0, 0.00005, c)                           # 0.05 ms: under the share -> every step
    assert asked(2) == [True, True]
    dl.pace(0, 1.0, c)                               # slow: still asked every MAX_IDLE + 1 steps
    assert asked(MAX_IDLE + 1) == [False] * MAX_IDLE + [True]
    model = DraftLength(16, True, 1)
    model.pace(0, 1.0, c)
    assert model.ask()
    assert HELD_SHARE == 0.01


def one_pass(c: PassCost):
    """pass_time for share_rows when every row shares one ubatch: t(all rows)."""
    return lambda ks: c.at(len(ks) + sum(ks))


def streams(c: PassCost, sids=None):
    """pass_time for share_rows as llama.cpp runs a decode over a KV stream per sequence: the sum
    of its ubatches (sequence ids 0..n-1 unless given)."""
    return lambda ks: c.split_at(ubatch_rows([(i, 1 + k) for i, k in zip(sids or range(len(ks)), ks, strict=True)], 512))


def test_one_sequence_shares_rows_as_best_length_cuts():
    """Alone in a step, share_rows picks best_length's draft (its own row is the base row)."""
    for a in (1.0, 0.9, 0.6, 0.2):
        rates = [a] * 16
        assert share_rows([rates], [16], [0], streams(xeon())) == [best_length(rates, xeon(), 16, 0)]


def test_rows_go_to_the_likeliest_copies_first():
    """Two sure copies and an unlikely one: the sure ones get rows, the unlikely one none."""
    k = share_rows([[1.0] * 8, [1.0] * 8, [0.1] * 8], [8, 8, 8], [0, 0, 0], one_pass(xeon()))
    assert k[0] > 0 and k[1] > 0 and k[2] == 0


def test_drafts_shrink_as_the_batch_grows_and_stop_at_a_large_one():
    """Copies right 70 % of the time, on the Xeon's curve: fewer rows each as sequences join, and
    none once the one-token rows alone cost as much per row as a draft's likely tokens return."""
    c = xeon()
    for r in range(18, 65):       # past 17: the slope of the last blocks
        c.record(r, (77.3 + (r - 17) * 3.9) / 1e3)
    each = []
    for n in (1, 2, 4, 8, 16):
        k = share_rows([[0.7] * 16] * n, [16] * n, [0] * n, one_pass(c))
        each.append(max(k))
    assert each == sorted(each, reverse=True) and each[0] > each[-1]
    assert share_rows([[0.2] * 16] * 16, [16] * 16, [0] * 16, one_pass(c)) == [0] * 16


def test_a_model_drafter_keeps_its_least_row():
    """k_min 1 (a model drafter, which learns only from drafts verified) keeps one row even when
    its rate says none pays; a proposal shorter than k_min is all it gets."""
    assert share_rows([[0.0] * 4, [0.0] * 4], [4, 0], [1, 1], streams(xeon())) == [1, 0]


def test_ubatches_follow_llamas_split_over_kv_streams():
    """llama_batch_allocr::split_equal(sequential): consecutive sequence ids, equal rows from each."""
    assert ubatch_rows([(0, 1), (1, 1), (2, 1), (3, 1)], 512) == [4]
    assert ubatch_rows([(0, 1), (2, 1), (3, 1)], 512) == [1, 2]          # a gap: two ubatches
    assert ubatch_rows([(0, 1), (1, 5), (2, 1)], 512) == [3, 4]          # a draft past the others
    assert ubatch_rows([(0, 5), (1, 5)], 512) == [10]                    # equal drafts: one
    assert ubatch_rows([(1, 2), (2, 9), (3, 1)], 512) == [3, 2, 7]
    assert ubatch_rows([(0, 600)], 512) == [512, 88]
    assert ubatch_rows([(0, 300), (1, 300)], 512) == [512, 88]
    assert ubatch_rows([(0, 0), (1, 3)], 512) == [3]


def test_a_batched_step_is_priced_in_stream_order():
    """Slots need not hold their streams in slot order ((0, 2, 3, 1) after an admission). The decode
    sorts its rows by stream, so four one-token rows are one ubatch; priced in slot order they were
    three, which made the plain step look dear and drafts look cheap."""
    from types import SimpleNamespace

    from specrun.kernels.batch import BatchEngine
    c = cost(1.0, 0.25)
    eng = SimpleNamespace(pass_cost=c, ctx=SimpleNamespace(n_ubatch=512))
    assert BatchEngine.step_cost(eng, [0, 2, 3, 1], [0, 0, 0, 0]) == pytest.approx(c.at(4))
    assert BatchEngine.step_cost(eng, [0, 2, 3, 1], [0, 4, 4, 0]) == pytest.approx(c.at(4) + c.at(8))
    assert BatchEngine.step_cost(eng, [0, 2], [0, 0]) == pytest.approx(2 * c.at(1))     # a gap stays a gap


def test_a_lone_draft_beside_many_plain_rows_is_a_ubatch_of_its_own():
    """Eight sequences, one with a copy right 90 % of the time: counted as rows of one pass, four
    rows pay; as llama.cpp runs them (a second ubatch, a whole pass more) none do. Two sure copies
    side by side draft alike, so that their rows share one ubatch."""
    c = xeon()
    rates = [[0.9] * 16] + [[0.0] * 16] * 7
    lengths = [16] + [0] * 7
    assert share_rows(rates, lengths, [0] * 8, one_pass(c))[0] > 0
    assert share_rows(rates, lengths, [0] * 8, streams(c)) == [0] * 8
    k = share_rows([[1.0] * 8] * 2, [8, 8], [0, 0], streams(c))
    assert k[0] == k[1] > 0
    assert share_rows([[1.0] * 8] * 2, [8, 8], [0, 0], streams(c, [0, 2])) != [0, 0]   # apart: each its own


def test_a_split_decode_moves_the_level_not_the_curve():
    """A decode that ran as two ubatches says nothing of one pass of all its rows: t(8) keeps what
    one-ubatch passes said; the level follows its time."""
    c = cost(0.01, 0.001)
    t8 = c.at(8)
    c.record_split([4, 4], 2 * c.at(4))               # as predicted: nothing moves
    assert c.at(8) == pytest.approx(t8)
    c.record_split([4, 4], 4 * c.at(4))               # twice the prediction: the level rises
    assert c.at(8) > t8 and c.at(8) / c.at(1) == pytest.approx(t8 / cost(0.01, 0.001).at(1))
    assert c.split_at([4, 4]) == pytest.approx(2 * c.at(4))


# ---- in the engine ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.full     # make test keeps the held-back n-gram test below
def test_adaptive_length_long_when_right_short_when_wrong_and_output_unchanged(smollm_path):
    from pathlib import Path

    from drafters import FixedCost, OracleDraft, ShiftedDraft

    from specrun.kernels.drafters import DraftModel
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams, SpecParams
    from specrun.kernels.types import SamplingParams

    code = (Path(__file__).parent / "data" / "copy_source.txt").read_text()[:700]
    greedy = SamplingParams(temp=0.0)
    with Engine(str(smollm_path), EngineParams(n_ctx=2048)) as e:
        e.pass_cost = FixedCost()
        prompt = e.tokenize("Copy this file verbatim.\n\n" + code + "\n\nCopy:\n\n" + code[:120])

        def run(spec, drafters=None):
            gen = e.generate(prompt, 96, greedy, spec=spec, drafters=drafters)
            return [t for c in gen for t in c], gen.stats

        plain, _ = run(SpecParams(verify="match"))
        ngram = SpecParams(types=("ngram-simple",), ngram_size_n=3, ngram_size_m=24, verify="match", adaptive=True)
        out, st = run(ngram)
        assert out == plain and st.drafters[0].n_acc_tokens > 0
        out, st = run(SpecParams(types=("draft-simple",), n_max=16, verify="match", adaptive=True),
                      [OracleDraft(plain, len(prompt))])
        assert out == plain
        d = st.drafters[0]
        # long when right: from the prior's length up to the cap within 4 drafts, and there after
        assert d.n_acc_tokens == d.n_gen_tokens and d.acc_per_pos[15] >= d.n_gen_drafts - 5 >= 3, d
        wrong = ShiftedDraft(DraftModel(e.target, str(smollm_path)), e.model.n_vocab)
        try:
            out, st = run(SpecParams(types=("draft-simple",), n_max=8, verify="match", adaptive=True), [wrong])
        finally:
            wrong.close()
        assert out == plain
        d = st.drafters[0]
        assert d.n_acc_tokens == 0 and d.n_gen_tokens / d.n_gen_drafts < 1.5       # back to 1 at once


@pytest.mark.slow
def test_adaptive_ngram_drafter_is_held_back_when_wrong_and_output_unchanged(smollm_path):
    """An always-wrong n-gram drafter (free proposals): after a few wrong drafts a plain step pays
    more, so it stops drafting; its shadow drafts keep being scored, never verified."""
    from pathlib import Path

    from drafters import FixedCost, ShiftedDraft

    from specrun.kernels.drafters import NgramSimple
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams, SpecParams
    from specrun.kernels.types import SamplingParams

    code = (Path(__file__).parent / "data" / "copy_source.txt").read_text()[:700]
    greedy = SamplingParams(temp=0.0)
    with Engine(str(smollm_path), EngineParams(n_ctx=2048)) as e:
        e.pass_cost = FixedCost()
        prompt = e.tokenize("Copy this file verbatim.\n\n" + code + "\n\nCopy:\n\n" + code[:120])
        plain = [t for c in e.generate(prompt, 64, greedy) for t in c]
        spec = SpecParams(types=("ngram-simple",), ngram_size_n=3, ngram_size_m=16, verify="match", adaptive=True)
        wrong = ShiftedDraft(NgramSimple(3, 16, 1), e.model.n_vocab)
        gen = e.generate(prompt, 64, greedy, spec=spec, drafters=[wrong])
        assert [t for c in gen for t in c] == plain
        d = gen.stats.drafters[0]
        assert d.n_acc_tokens == 0 and 1 <= d.n_gen_drafts <= 3, d
        assert gen.stats.n_target_passes == 63                       # every other step a plain one
        right = NgramSimple(3, 16, 1)                                # the real one on a copy: drafts and is right
        gen = e.generate(prompt, 64, greedy, spec=spec, drafters=[right])
        assert [t for c in gen for t in c] == plain and gen.stats.drafters[0].n_acc_tokens > 0


def test_the_engines_probe_times_the_curve_rows_once(smollm_path):
    """Before its first adaptive generation the engine times one target pass of each curve_rows size
    up to the longest draft's pass (ngram-simple size-m 16: 17 rows), leaves the KV as it was (the
    text is plain's), and does not time them again for the next generation."""
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams, SpecParams
    from specrun.kernels.types import SamplingParams

    greedy = SamplingParams(temp=0.0)
    with Engine(str(smollm_path), EngineParams(n_ctx=1024)) as e:
        prompt = e.tokenize("def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
        plain = [t for c in e.generate(prompt, 24, greedy) for t in c]
        probed: list[int] = []
        measure = e._measure_pass_cost
        e._measure_pass_cost = lambda max_rows, **k: (probed.append(max_rows), measure(max_rows, **k))
        spec = SpecParams(types=("ngram-simple",), ngram_size_n=3, ngram_size_m=16, verify="match", adaptive=True)
        for _ in range(2):
            assert [t for c in e.generate(prompt, 24, greedy, spec=spec) for t in c] == plain
        assert probed == [17] and set(curve_rows(17)) <= set(e.pass_cost.sums)


def test_best_cut_values_a_draft_that_pays_above_a_plain_step():
    """best_cut's value is E(k) / t(k + 1) of take()'s cut; held back, a plain step's 1 / t(1). Of two
    free drafters, the one with the higher value drafts (the engines compare these)."""
    c = PassCost()
    for r in (1, 9):
        c.record(r, 1 + r / 4)
    sure, unsure = DraftLength(16, True, 0), DraftLength(16, True, 0)
    for dl, right in ((sure, 16), (unsure, 0)):
        dl.start(c)
        for _ in range(6):                                   # whole proposals right for `right` tokens
            dl.candidates(np.arange(16, dtype=np.int32), 0)
            dl.score([*range(right), -1] if right < 16 else list(range(16)), c)
    proposal = np.arange(100, 116, dtype=np.int32)
    v, a, cut = sure.best_cut(proposal, 0, 16, c)
    assert len(cut) == 16 and np.array_equal(cut, sure.take(proposal, 0, 16, c))
    assert v == pytest.approx(expected_tokens(a, 16) / c.at(17)) and v > 1 / c.at(1)
    v0, _, cut0 = unsure.best_cut(proposal, 0, 16, c)
    assert len(cut0) == 0 and v0 == pytest.approx(1 / c.at(1)) and v0 < v


def test_each_kind_of_proposal_is_judged_by_its_own_acceptance():
    """suffix's copies of earlier answers (kind "global") and of the request's own text ("own") are
    scored apart: a drafter whose own-text copies keep failing is held back on them, and still drafts
    a global copy in full; the kinds do not touch each other's counts or the kindless acceptance."""
    c = PassCost()
    for r in (1, 9):
        c.record(r, 1 + r / 4)
    dl = DraftLength(16, True, 0)
    dl.start(c)
    base = (list(dl.acc.reached), list(dl.acc.accepted))
    for i in range(6):
        p0 = 32 * i
        dl.candidates(np.arange(p0, p0 + 16, dtype=np.int32), p0, "global")     # right to its end
        dl.score([*range(p0 + 16)], c)
        dl.candidates(np.arange(16, dtype=np.int32), p0 + 20, "own")             # wrong at its first token
        dl.score([*range(p0 + 20), -1], c)
    assert (dl.acc.reached, dl.acc.accepted) == base
    assert dl.of_kind("global").rates(1)[0] > 0.9 > 0.1 > dl.of_kind("own").rates(1)[0]
    proposal = np.arange(500, 516, dtype=np.int32)
    assert len(dl.best_cut(proposal, 1000, 16, c, "own")[2]) == 0
    dl.shadow = None                                                              # a new step, nothing pending
    assert len(dl.best_cut(proposal, 1000, 16, c, "global")[2]) == 16

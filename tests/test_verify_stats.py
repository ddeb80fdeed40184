"""Statistical check that rejection sampling (and sample-and-match) emit tokens distributed as p.

Setup: a small vocabulary (V = 12), target rows p_i = transform(target logits, PARAMS) (top-k
leaves two tokens at p = 0), drafter rows q_i = 0.5 p_i + 0.5 noise (positive everywhere, so the
drafter proposes tokens the target forbids). One verification step per trial.

Bound. For N draws from a distribution P with empirical frequencies P_hat,
    E[TV(P_hat, P)] <= 1/2 sum_i sqrt(P_i (1 - P_i) / N) <= 1/2 sqrt(V / N)     (Cauchy-Schwarz)
and TV(P_hat, P) moves by at most 1/N when one draw changes, so by McDiarmid
    P(TV >= E[TV] + t) <= exp(-2 N t^2),   t = sqrt(ln(1/delta) / (2 N)).
With delta = 1e-6 the bound is 1/2 sqrt(V/N) + sqrt(ln(1e6) / (2N)): 0.0097 for N = 200,000 and
0.031 for N = 20,000. A correct rule stays under it except with probability 1e-6 (and the seeds
are fixed, so the test is deterministic). Each wrong rule below has an exact output
distribution whose TV from p is several times the bound, and the test shows the measured TV
exceeding the bound too, so the bound has teeth.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from specrun.kernels.sampling import inverse_cdf, transform
from specrun.kernels.types import SamplingParams
from specrun.kernels.verify import rejection_step, verify_match, verify_rejection

V = 12
N = 200_000
N_CALLS = 20_000  # trials through the public verify_* functions, one call each
DELTA = 1e-6
PARAMS = SamplingParams(temp=0.9, top_k=10, top_p=0.97, min_p=0.01, seed=0)


def tv_bound(n: int) -> float:
    return 0.5 * math.sqrt(V / n) + math.sqrt(math.log(1.0 / DELTA) / (2.0 * n))


def tv(tokens: np.ndarray, p: np.ndarray) -> float:
    freq = np.bincount(tokens, minlength=V) / tokens.shape[0]
    return 0.5 * float(np.abs(freq - p).sum())


def _setup():
    rng = np.random.default_rng(0)
    target_logits = (rng.standard_normal((3, V)) * 1.5).astype(np.float32)  # [k + 1, V], k = 2
    p = np.stack([transform(row, PARAMS) for row in target_logits])  # float64 [3, V]
    noise = np.exp(rng.standard_normal((2, V)) * 1.5)
    noise /= noise.sum(axis=1, keepdims=True)
    q = (0.5 * p[:2] + 0.5 * noise).astype(np.float32)  # [k, V], the drafter's distributions
    return target_logits, p, q


TARGET_LOGITS, P, Q = _setup()
Q64 = Q.astype(np.float64)


# --- the rule under test and three wrong ones, all (p, q, d, u_accept, u_recover) -> (accepted, token)
def correct(p, q, d, u_acc, u_rec):
    return rejection_step(p, q, d, u_acc, u_rec)  # the code verify_rejection runs


def accept_q_over_p(p, q, d, u_acc, u_rec):
    """Wrong: accept with min(1, q/p) instead of min(1, p/q)."""
    accepted = u_acc * p[d] < q[d]
    residual = np.maximum(p - q, 0.0)
    return accepted, np.where(accepted, d, inverse_cdf(residual, u_rec))


def resample_from_p(p, q, d, u_acc, u_rec):
    """Wrong: on rejection draw from p instead of norm(max(0, p - q))."""
    accepted = (q[d] > 0) & (u_acc * q[d] < p[d])
    return accepted, np.where(accepted, d, inverse_cdf(p, u_rec))


def reuse_uniform(p, q, d, u_acc, u_rec):
    """Wrong glue: the accept test's uniform reused for the recovered token (one stream, not two)."""
    return rejection_step(p, q, d, u_acc, u_acc)


def exact_output(rule, p, q):
    """The exact distribution of the emitted token under `rule` (None when not closed-form)."""
    r = np.maximum(p - q, 0.0)
    r /= r.sum()
    if rule is correct:
        m = np.minimum(p, q)
        return m + (1.0 - m.sum()) * r
    if rule is accept_q_over_p:
        acc = q * np.minimum(1.0, q / np.where(p > 0, p, np.inf)) + np.where(p > 0, 0.0, q)
        return acc + (1.0 - acc.sum()) * r
    if rule is resample_from_p:
        m = np.minimum(p, q)
        return m + (1.0 - m.sum()) * p
    return None


def run_two_positions(rule, seed: int = 1):
    """N trials of a 2-token draft: (first emitted token [N], second emitted token [n_acc1])."""
    rng = np.random.default_rng(seed)
    d1 = inverse_cdf(Q64[0], rng.random(N))  # the drafter samples d_i ~ q_i
    d2 = inverse_cdf(Q64[1], rng.random(N))
    acc1, tok1 = rule(P[0], Q64[0], d1, rng.random(N), rng.random(N))
    n2 = int(acc1.sum())
    _, tok2 = rule(P[1], Q64[1], d2[acc1], rng.random(n2), rng.random(n2))
    return tok1, tok2


def test_exact_distribution_of_correct_rule_is_p():
    for i in range(2):
        np.testing.assert_allclose(exact_output(correct, P[i], Q64[i]), P[i], atol=1e-12)


def test_rejection_reproduces_p():
    tok1, tok2 = run_two_positions(correct)
    b1, b2 = tv_bound(tok1.shape[0]), tv_bound(tok2.shape[0])
    print(f"correct: TV1 = {tv(tok1, P[0]):.5f} (bound {b1:.5f}), TV2 = {tv(tok2, P[1]):.5f} (bound {b2:.5f}, n = {tok2.shape[0]})")
    assert tok2.shape[0] > N // 2  # the accepted prefix is common enough to measure
    assert tv(tok1, P[0]) < b1
    assert tv(tok2, P[1]) < b2
    assert (P[0][tok1] > 0).all() and (P[1][tok2] > 0).all()  # never a token the target forbids


@pytest.mark.parametrize("rule", [accept_q_over_p, resample_from_p, reuse_uniform], ids=lambda r: r.__name__)
def test_wrong_rules_exceed_the_bound(rule):
    tok1, tok2 = run_two_positions(rule)
    b1, b2 = tv_bound(tok1.shape[0]), tv_bound(tok2.shape[0])
    t1, t2 = tv(tok1, P[0]), tv(tok2, P[1])
    print(f"{rule.__name__}: TV1 = {t1:.5f} (bound {b1:.5f}), TV2 = {t2:.5f} (bound {b2:.5f})")
    for i in range(2):
        exact = exact_output(rule, P[i], Q64[i])
        if exact is not None:  # the wrong rule is provably far from p, by several bounds
            assert 0.5 * np.abs(exact - P[i]).sum() > 3 * tv_bound(N // 2)
    assert t1 > b1
    assert t2 > b2


def test_match_is_rejection_with_one_hot_q():
    """A deterministic drafter (one-hot q at d): accept w.p. p(d), else recover from p without d."""
    rng = np.random.default_rng(2)
    for d_tok in (int(np.argmax(P[0])), int(np.argsort(P[0])[-3]), int(np.flatnonzero(P[0] == 0)[0])):
        q = np.zeros(V)
        q[d_tok] = 1.0
        _, tok = rejection_step(P[0], q, np.full(N, d_tok), rng.random(N), rng.random(N))
        assert tv(tok, P[0]) < tv_bound(N)


def _seeded(seed: int) -> SamplingParams:
    return dataclasses.replace(PARAMS, seed=seed)


def test_verify_match_reproduces_p_through_real_calls():
    """Sample-and-match with a fixed draft, one verify_match call per seed."""
    draft = np.asarray([np.argmax(P[0]), np.argsort(P[1])[-2]], dtype=np.int32)
    verdicts = [verify_match(draft, TARGET_LOGITS, _seeded(s), 7) for s in range(N_CALLS)]
    first = np.asarray([v.tokens[0] for v in verdicts])
    second = np.asarray([v.tokens[1] for v in verdicts if v.n_accepted >= 1])
    print(f"match: TV1 = {tv(first, P[0]):.5f}, TV2 = {tv(second, P[1]):.5f} (n = {second.shape[0]})")
    assert tv(first, P[0]) < tv_bound(N_CALLS)
    assert tv(second, P[1]) < tv_bound(second.shape[0])


def test_verify_rejection_reproduces_p_through_real_calls():
    """The glue (per-position streams 1 and 2, the loop, the bonus) through verify_rejection."""
    rng = np.random.default_rng(3)
    d1 = inverse_cdf(Q64[0], rng.random(N_CALLS))
    d2 = inverse_cdf(Q64[1], rng.random(N_CALLS))
    verdicts = [
        verify_rejection(np.asarray([a, b], dtype=np.int32), Q, TARGET_LOGITS, _seeded(s), 7)
        for s, (a, b) in enumerate(zip(d1, d2, strict=True))
    ]
    first = np.asarray([v.tokens[0] for v in verdicts])
    second = np.asarray([v.tokens[1] for v in verdicts if v.n_accepted >= 1])
    bonus = np.asarray([v.tokens[2] for v in verdicts if v.n_accepted == 2])
    print(f"rejection: TV1 = {tv(first, P[0]):.5f}, TV2 = {tv(second, P[1]):.5f} (n = {second.shape[0]}), "
          f"bonus TV = {tv(bonus, P[2]):.5f} (n = {bonus.shape[0]})")
    assert tv(first, P[0]) < tv_bound(N_CALLS)
    assert tv(second, P[1]) < tv_bound(second.shape[0])
    assert tv(bonus, P[2]) < tv_bound(bonus.shape[0])

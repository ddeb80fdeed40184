"""kernels/verify.py on constructed logits (vLLM style: +100 on the target's token, -100 elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.kernels.sampling import sample
from specrun.kernels.types import Draft, SamplingParams
from specrun.kernels.verify import rejection_step, verify, verify_match, verify_rejection

N_VOCAB = 32
SEEDED = SamplingParams(temp=0.8, seed=42)
GREEDY = SamplingParams(temp=0.0, seed=42)


def peaked(tokens: list[int], n_vocab: int = N_VOCAB) -> np.ndarray:
    """float32 [len(tokens), n_vocab]: row i is +100 at tokens[i], -100 elsewhere (one-hot p)."""
    logits = np.full((len(tokens), n_vocab), -100.0, dtype=np.float32)
    logits[np.arange(len(tokens)), tokens] = 100.0
    return logits


def one_hot(tokens: list[int], n_vocab: int = N_VOCAB) -> np.ndarray:
    q = np.zeros((len(tokens), n_vocab), dtype=np.float32)
    q[np.arange(len(tokens)), tokens] = 1.0
    return q


# (draft, the target's token at each of the k + 1 rows, n_accepted, emitted tokens)
CASES = [
    pytest.param([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4], id="perfect-match-plus-bonus"),
    pytest.param([1, 2, 3], [1, 5, 3, 4], 1, [1, 5], id="early-mismatch"),
    pytest.param([1, 2, 3], [1, 2, 6, 4], 2, [1, 2, 6], id="last-mismatch"),
    pytest.param([1, 2, 3], [7, 8, 9, 4], 0, [7], id="all-rejected"),
    pytest.param([], [4], 0, [4], id="empty-draft"),
    pytest.param([9], [9, 0], 1, [9, 0], id="single-accepted"),
]


@pytest.mark.parametrize("params", [SEEDED, GREEDY], ids=["temp0.8", "greedy"])
@pytest.mark.parametrize(("draft", "target", "n_accepted", "tokens"), CASES)
def test_verify_match_constructed(draft, target, n_accepted, tokens, params):
    verdict = verify_match(np.asarray(draft, dtype=np.int32), peaked(target), params, pos0=10)
    assert verdict.n_accepted == n_accepted
    assert verdict.tokens.dtype == np.int32
    assert verdict.tokens.tolist() == tokens


@pytest.mark.parametrize("params", [SEEDED, GREEDY], ids=["temp0.8", "greedy"])
@pytest.mark.parametrize(("draft", "target", "n_accepted", "tokens"), CASES)
def test_verify_rejection_constructed(draft, target, n_accepted, tokens, params):
    """One-hot p and one-hot q at the draft: accepted iff equal; the residual max(0, p - q) = p."""
    draft_probs = one_hot(draft) if draft else np.zeros((0, N_VOCAB), dtype=np.float32)
    verdict = verify_rejection(np.asarray(draft, dtype=np.int32), draft_probs, peaked(target), params, pos0=10)
    assert verdict.n_accepted == n_accepted
    assert verdict.tokens.dtype == np.int32
    assert verdict.tokens.tolist() == tokens


@pytest.mark.parametrize("mode", ["match", "rejection"])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize(("draft", "target", "n_accepted", "tokens"), CASES)
def test_verify_dispatch(draft, target, n_accepted, tokens, mode, with_probs):
    d = np.asarray(draft, dtype=np.int32)
    probs = (one_hot(draft) if draft else np.zeros((0, N_VOCAB), dtype=np.float32)) if with_probs else None
    verdict = verify(Draft(d, probs), peaked(target), SEEDED, 3, mode)
    assert (verdict.n_accepted, verdict.tokens.tolist()) == (n_accepted, tokens)


def test_verify_rejection_without_probs_is_match():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, N_VOCAB)) * 2).astype(np.float32)
    draft = rng.integers(0, N_VOCAB, 4).astype(np.int32)
    for pos0 in range(50):
        a = verify(Draft(draft, None), logits, SEEDED, pos0, "rejection")
        b = verify_match(draft, logits, SEEDED, pos0)
        assert (a.n_accepted, a.tokens.tolist()) == (b.n_accepted, b.tokens.tolist())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("n_match", [0, 1, 3, 6])
def test_match_equals_plain_sampling(seed, n_match):
    """Seeded temp 0.8: the verdict is plain decoding's sample() position by position."""
    k = 6
    params = SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
    rng = np.random.default_rng(100 + seed)
    for pos0 in (0, 17, 1000):
        logits = (rng.standard_normal((k + 1, 64)) * 1.5).astype(np.float32)
        plain = [sample(logits[i], params, pos0 + i) for i in range(k + 1)]
        draft = np.asarray(plain[:k], dtype=np.int32)
        if n_match < k:
            draft[n_match] = (plain[n_match] + 1) % 64  # first mismatch at n_match
            draft[n_match + 1 :] = rng.integers(0, 64, k - n_match - 1)
        verdict = verify_match(draft, logits, params, pos0)
        assert verdict.n_accepted == n_match
        assert verdict.tokens.tolist() == plain[: n_match + 1]


def test_rejection_greedy_reduces_to_match():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((4, N_VOCAB)) * 2).astype(np.float32)
    argmaxes = logits.argmax(axis=1)
    q = rng.dirichlet(np.ones(N_VOCAB), size=3).astype(np.float32)
    for draft in ([*argmaxes[:3]], [argmaxes[0], (argmaxes[1] + 1) % N_VOCAB, 0]):
        d = np.asarray(draft, dtype=np.int32)
        a = verify_rejection(d, q, logits, GREEDY, 0)
        b = verify_match(d, logits, GREEDY, 0)
        assert (a.n_accepted, a.tokens.tolist()) == (b.n_accepted, b.tokens.tolist())
    assert verify_rejection(argmaxes[:3].astype(np.int32), q, logits, GREEDY, 0).tokens.tolist() == argmaxes.tolist()


def test_rejection_seeded_is_deterministic():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((4, N_VOCAB)).astype(np.float32)
    q = rng.dirichlet(np.ones(N_VOCAB), size=3).astype(np.float32)
    d = np.asarray([int(np.argmax(row)) for row in q], dtype=np.int32)
    runs = [verify_rejection(d, q, logits, SEEDED, 5) for _ in range(3)]
    assert len({(v.n_accepted, tuple(v.tokens.tolist())) for v in runs}) == 1


def test_draft_zero_q_is_rejected():
    """q(d) = 0: a proposal the drafter called impossible is rejected, even with p(d) = 1; the
    recovered token comes from max(0, p - q), which here is p, so the token is still d."""
    q = one_hot([5])  # q(3) = 0
    verdict = verify_rejection(np.asarray([3], dtype=np.int32), q, peaked([3, 0]), SEEDED, 0)
    assert verdict.n_accepted == 0
    assert verdict.tokens.tolist() == [3]


def test_rejection_step_edges():
    p = np.array([0.0, 0.5, 0.5, 0.0])
    u = np.linspace(0.0, 0.999, 1000)
    # p(d) = 0 is never accepted, whatever q says
    acc, tok = rejection_step(p, np.array([0.97, 0.01, 0.01, 0.01]), np.zeros(1000, dtype=np.int64), u, u[::-1])
    assert not acc.any() and set(tok.tolist()) <= {1, 2}
    # p == q and q(d) = 0: rejected, residual all zero -> recovered from p
    acc, tok = rejection_step(p, p.copy(), np.full(1000, 3), u, u[::-1])
    assert not acc.any() and set(tok.tolist()) == {1, 2}
    # p(d) >= q(d) > 0: always accepted
    acc, tok = rejection_step(p, np.array([0.5, 0.25, 0.25, 0.0]), np.full(1000, 1), u, u)
    assert acc.all() and (tok == 1).all()


@pytest.mark.parametrize(
    ("n_rows", "fn"),
    [(3, "match"), (5, "match"), (3, "rejection")],
)
def test_shape_errors(n_rows, fn):
    d = np.asarray([1, 2, 3], dtype=np.int32)
    with pytest.raises(ValueError, match=r"\[4, n_vocab\]"):
        if fn == "match":
            verify_match(d, peaked([0] * n_rows), SEEDED, 0)
        else:
            verify_rejection(d, one_hot([1, 2, 3]), peaked([0] * n_rows), SEEDED, 0)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_rejection(d, one_hot([1, 2]), peaked([0] * 4), SEEDED, 0)
    with pytest.raises(ValueError, match="unknown verify mode 'typical'"):
        verify(Draft(d), peaked([0] * 4), SEEDED, 0, "typical")

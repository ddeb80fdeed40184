"""Verifying a draft against one target pass: sample-and-match and rejection sampling.

Terms (vLLM's):
- accepted tokens: the draft tokens the target keeps, a prefix d_1..d_n of the draft.
- recovered token: the target's token at the first rejected position (in rejection sampling it
  is drawn from the residual norm(max(0, p - q)); in sample-and-match it is simply the target's
  sample there).
- bonus token: when all k draft tokens are accepted, the target's sample from row k (the logits
  after the last draft token), which the pass computed for free.

Every verification emits n_accepted + 1 tokens. Worked example, k = 3, the target pass ran on
[id_last, d1, d2, d3] at positions pos0-1 .. pos0+2, so target_logits row i predicts position
pos0 + i:

    draft          d1=17   d2=42   d3=5
    target sample  t0=17   t1=42   t2=9    (t3 never drawn)
    -> n_accepted = 2, tokens = [17, 42, 9]: 17 and 42 accepted, 9 recovered at pos0+2.

    draft          d1=17   d2=42   d3=5
    target sample  t0=17   t1=42   t2=5    t3=88
    -> n_accepted = 3, tokens = [17, 42, 5, 88]: 88 is the bonus token at pos0+3.

    empty draft (k = 0): target_logits has one row -> tokens = [t0], plain decoding.

Both verifiers are lossless: sample-and-match emits exactly what plain decoding emits with the
same seed (its draws come from position_rng(seed, pos) like sample()); rejection sampling emits
tokens distributed exactly as the target's p (Leviathan et al., arXiv:2211.17192, Algorithm 1),
checked statistically in tests/test_verify_stats.py.
"""

from __future__ import annotations

import numpy as np

from .sampling import inverse_cdf, position_rng, sample, transform
from .types import Draft, SamplingParams, Verdict

VERIFY_MODES = ("match", "rejection")


def _check_shapes(draft: np.ndarray, target_logits: np.ndarray) -> int:
    k = int(draft.shape[0])
    if target_logits.ndim != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(
            f"target_logits must be [k + 1, n_vocab] = [{k + 1}, n_vocab] for a draft of {k} tokens, "
            f"got {list(target_logits.shape)}"
        )
    return k


def _verdict(tokens: list[int], n_accepted: int) -> Verdict:
    return Verdict(n_accepted=n_accepted, tokens=np.asarray(tokens, dtype=np.int32))


def verify_match(draft: np.ndarray, target_logits: np.ndarray, params: SamplingParams, pos0: int) -> Verdict:
    """Sample-and-match (llama.cpp's common_sampler_sample_and_accept_n).

    draft:         int32 [k], k >= 0: the tokens proposed for positions pos0 .. pos0+k-1.
    target_logits: float32 [k + 1, n_vocab]: row i = target logits after id_last, d_1..d_i,
                   i.e. predicting absolute position pos0 + i.
    Returns Verdict with n_accepted in 0..k and tokens int32 [n_accepted + 1].

    t_i = sample(target_logits[i], params, pos0 + i); accept d_i while d_i == t_i; the first
    mismatching t_i is the recovered token, t_k the bonus token. Because t_i is exactly what plain
    decoding samples at pos0 + i, the emitted tokens equal plain decoding's, token for token,
    whenever the batched logits equal the one-token logits. Stops sampling at the first mismatch.
    """
    k = _check_shapes(draft, target_logits)
    tokens: list[int] = []
    for i in range(k + 1):
        t = sample(target_logits[i], params, pos0 + i)
        tokens.append(t)
        if i == k or t != int(draft[i]):
            return _verdict(tokens, i)
    raise AssertionError("unreachable")


def rejection_step(
    p: np.ndarray, q: np.ndarray, d: np.ndarray, u_accept: np.ndarray, u_recover: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One position of Algorithm 1, vectorised over N independent trials.

    p:         float64 [n_vocab], the target's distribution (transform of its logits).
    q:         float [n_vocab], the drafter's distribution the draft token was drawn from.
    d:         int [N], the draft tokens.
    u_accept:  float64 [N] uniforms in [0, 1) for the accept test.
    u_recover: float64 [N] uniforms in [0, 1) for the recovered token.
    Returns (accepted bool [N], token int64 [N]): token = d where accepted, else the recovered
    token drawn from norm(max(0, p - q)) by inverse CDF.

    Accept iff q(d) > 0 and u_accept < p(d) / q(d) (computed as u * q(d) < p(d)); this is
    min(1, p/q) and never accepts a token the target gives p = 0.
    q(d) = 0 (a proposal the drafter itself called impossible, i.e. a drafter bug) is rejected:
    accepting it whenever p(d) > 0 would let a broken drafter push any token with tiny p through
    every time; rejecting falls back on the residual, which is p itself when q is all zeros.
    Residual all zero (p == q up to rounding, where rejection has probability ~0): recover from p.
    """
    d = np.asarray(d)
    q = np.asarray(q, dtype=np.float64)
    q_d = q[d]
    accepted = (q_d > 0.0) & (np.asarray(u_accept) * q_d < p[d])
    token = d.astype(np.int64)
    if not accepted.all():
        residual = np.maximum(p - q, 0.0)  # [n_vocab]
        if not residual.sum() > 0.0:
            residual = p
        token = np.where(accepted, token, inverse_cdf(residual, u_recover))
    return accepted, token


def verify_rejection(
    draft: np.ndarray,
    draft_probs: np.ndarray,
    target_logits: np.ndarray,
    params: SamplingParams,
    pos0: int,
) -> Verdict:
    """Speculative sampling, Leviathan et al. arXiv:2211.17192 Algorithm 1, in its letters.

    draft:         int32 [k], d_i drawn by the drafter from q_i.
    draft_probs:   float [k, n_vocab], q_i (after the drafter's own sampling transforms).
    target_logits: float32 [k + 1, n_vocab], row i predicts position pos0 + i.
    Returns Verdict, tokens int32 [n_accepted + 1].

    For i = 0..k-1: p = transform(target_logits[i]); accept d_i with probability
    min(1, p(d_i) / q(d_i)) using one uniform from position_rng(seed, pos0 + i, stream=1); at the
    first rejection emit the recovered token from norm(max(0, p - q)) using a uniform from
    position_rng(seed, pos0 + i, stream=2) and stop. If all k are accepted, the bonus token is
    sample(target_logits[k], params, pos0 + k), exactly as plain decoding would draw it.
    Each emitted token is distributed as p at its position (see rejection_step for the edge
    cases). Greedy params: p is one-hot, so this reduces to verify_match, which is used.
    """
    if params.greedy:
        return verify_match(draft, target_logits, params, pos0)
    k = _check_shapes(draft, target_logits)
    if draft_probs.ndim != 2 or draft_probs.shape != (k, target_logits.shape[1]):
        raise ValueError(
            f"draft_probs must be [k, n_vocab] = [{k}, {target_logits.shape[1]}], got {list(draft_probs.shape)}"
        )
    tokens: list[int] = []
    for i in range(k):
        pos = pos0 + i
        p = transform(target_logits[i], params)  # [n_vocab]
        u_accept = position_rng(params.seed, pos, stream=1).random(1)
        u_recover = position_rng(params.seed, pos, stream=2).random(1)
        accepted, token = rejection_step(p, draft_probs[i], draft[i : i + 1], u_accept, u_recover)
        tokens.append(int(token[0]))
        if not accepted[0]:
            return _verdict(tokens, i)
    tokens.append(sample(target_logits[k], params, pos0 + k))
    return _verdict(tokens, k)


def verify(draft: Draft, target_logits: np.ndarray, params: SamplingParams, pos0: int, mode: str) -> Verdict:
    """Verify `draft` against one target pass; mode "match" or "rejection".

    target_logits: float32 [k + 1, n_vocab], or kernels.constrain.Rows: the same rows under the
    logit controls (penalties, bias, grammar), row i transformed when first read with the state
    after d_1..d_i. Both verifiers read rows in order and stop at the first mismatch / rejection.

    "rejection" uses verify_rejection when the drafter reported its distribution (draft.probs is
    not None); a deterministic drafter (probs None, one-hot q) goes through verify_match, which is
    rejection sampling with one-hot q and also equals plain decoding token for token.
    """
    if mode not in VERIFY_MODES:
        raise ValueError(f"unknown verify mode {mode!r}; expected one of {', '.join(VERIFY_MODES)}")
    if mode == "rejection" and draft.probs is not None:
        return verify_rejection(draft.tokens, draft.probs, target_logits, params, pos0)
    return verify_match(draft.tokens, target_logits, params, pos0)

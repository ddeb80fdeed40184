"""Sampling that mirrors llama.cpp's default sampler chain, with position-keyed randomness.

llama.cpp's common sampler (common/sampling.cpp, default `samplers` order in common/common.h)
applies, for the samplers specrun exposes:

    top_k -> top_p -> min_p -> temperature -> dist

and the filters before `temperature` see the raw logits, so top-p's cumulative mass and min-p's
ratio are measured on the softmax at temperature 1 of the candidates still kept
(src/llama-sampler.cpp):

- top_k (k <= 0: off): keep the k largest logits.
- top_p (p >= 1: off): softmax of the kept logits, walk them in descending order and keep the
  shortest prefix whose cumulative probability is >= p (inclusive; all of them if never reached).
- min_p (p <= 0: off): keep logits >= max_logit + logf(p), i.e. p_i >= p * p_max, computed in
  float32 as llama.cpp does.
- temperature: divide the survivors' logits by temp and take the softmax; `dist` draws from it.
- temp <= 0 (greedy): llama.cpp's temp sampler keeps only the first maximum; we return the argmax
  of the raw logits (first index on ties), which is the same token.

Where llama.cpp leaves ties to std::partial_sort (unspecified order), we break them by the lower
token id, so the result is deterministic.

The logit controls (logit bias, --ignore-eos, repetition penalties: penalize(); grammars) come
before this chain, as llama.cpp applies them first; kernels.constrain applies them per row.

Randomness: every draw for the token at absolute position `pos` comes from
`position_rng(seed, pos, stream)`, never from a generator that advances with the number of draws.
That is what makes seeded speculative output equal seeded plain output: a position's token does
not depend on how many draft tokens were proposed or rejected before it.
"""

from __future__ import annotations

import numpy as np

from specrun.gguf_spec.errors import SpecrunError

from .types import SamplingParams


class NonFiniteLogits(SpecrunError):
    """A row of logits with no finite maximum: nothing can be sampled from it."""

    def __init__(self, top: float, pos: int | None = None) -> None:
        at = f" at position {pos}" if pos is not None else ""
        why = ("every token has a logit of -inf: a --logit-bias or grammar forbids them all, or "
               if top == float("-inf") else "")
        super().__init__(f"the model's logits{at} have no finite maximum ({top}): {why}the weights or metadata give "
                         "NaN or infinite values; check the file (`specrun inspect`), or use another model")
        self.top, self.pos = top, pos


def _finite_top(v: float, pos: int | None, *, inf_ok: bool = False) -> None:
    """Raise NonFiniteLogits unless v (a row's maximum) is finite (or +inf, where inf_ok: greedy picks it)."""
    if not (-np.inf < v < np.inf or (inf_ok and v == np.inf)):
        raise NonFiniteLogits(float(v), pos)


def position_rng(seed: int, pos: int, stream: int = 0) -> np.random.Generator:
    """The generator for every random draw of the token at absolute position `pos`.

    stream 0: plain sampling (sample()); 1: rejection sampling's accept test; 2: its recovered
    token. Equal (seed, pos, stream) -> equal draws, whatever happened at other positions.
    """
    return np.random.default_rng([seed, pos, stream])


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values of x, ties at the boundary to the lower id; ascending id order.

    x: float [n]. O(n): a few vectorised threshold scans (max - 4, - 8, ... - 64) find a small
    superset of the top k, then one partition of that superset; never a full sort.
    """
    n = x.shape[0]
    if k <= 0 or k >= n:
        return np.arange(n)
    sub = None  # ids of every x >= some threshold: they include the top k and all its ties
    if n > 4096:
        top = x.max()
        for margin in (4.0, 8.0, 16.0, 32.0, 64.0):
            mask = x >= top - margin
            if np.count_nonzero(mask) >= k:
                sub = np.flatnonzero(mask)
                break
    if sub is None:
        sub = np.arange(n)
    vals = x[sub]
    kth = np.partition(vals, vals.shape[0] - k)[vals.shape[0] - k]  # the k-th largest value
    greater = sub[vals > kth]
    equal = sub[vals == kth][: k - greater.shape[0]]
    return np.sort(np.concatenate([greater, equal]))


def _top_p_keep(vals: np.ndarray, top_p: float) -> np.ndarray:
    """Bool mask [n] of the candidates llama.cpp's top-p keeps (vals: float64 logits [n], n >= 1).

    Softmax at temperature 1, descending order, keep through the first index whose cumulative
    probability is >= top_p (compared against top_p as the float32 llama.cpp stores); all of
    them if never reached. Like llama.cpp's adaptive top-p, only a head of the distribution is
    sorted first: every candidate with probability >= 1e-2 * max (then 1e-4, 1e-8, then all),
    which is exactly a descending prefix with its ties; a peaked distribution over 262k
    candidates never pays for a full sort.
    """
    p_thr = float(np.float32(top_p))
    e = np.exp(vals - vals.max())
    probs = e / e.sum()  # [n]
    n = probs.shape[0]
    p_max = probs.max()
    for ratio in (1e-2, 1e-4, 1e-8, 0.0):
        head = np.flatnonzero(probs >= p_max * ratio) if ratio > 0.0 else np.arange(n)
        cum = np.cumsum(np.sort(probs[head])[::-1])  # tied values sum the same in any order
        hit = np.flatnonzero(cum >= p_thr)
        if hit.size:
            break
    n_keep = int(hit[0]) + 1 if hit.size else n
    keep = np.zeros(n, dtype=bool)
    keep[head[_top_k_ids(probs[head], n_keep)]] = True
    return keep


def _candidates(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """The sparse form of transform(): (ids int64 [n_cand] ascending, or None for the whole
    vocabulary in id order; probs float64 [n_cand]).

    requires: not params.greedy. raises NonFiniteLogits when the logits' maximum is not finite.
    """
    n_vocab = logits.shape[0]
    _finite_top(float(logits.max()), None)   # NaN propagates through max; a NaN row empties every filter below
    ids: np.ndarray | None = None
    vals = logits  # float32 [n_cand]
    if 0 < params.top_k < n_vocab:
        ids = _top_k_ids(logits, params.top_k)
        vals = logits[ids]
    if params.top_p < 1.0 and vals.shape[0] > 1:
        keep = _top_p_keep(vals.astype(np.float64), params.top_p)
        ids = np.flatnonzero(keep) if ids is None else ids[keep]
        vals = vals[keep]
    if params.min_p > 0.0:
        min_logit = np.float32(vals.max()) + np.log(np.float32(params.min_p))  # float32, as llama.cpp
        keep = vals >= min_logit
        ids = np.flatnonzero(keep) if ids is None else ids[keep]
        vals = vals[keep]
    z = vals.astype(np.float64)
    z -= z.max()
    z /= params.temp
    np.exp(z, out=z)
    z /= z.sum()
    return ids, z


def transform(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Target distribution after top_k -> top_p -> min_p -> temperature, as llama.cpp samples.

    logits: float32 [n_vocab]. Returns float64 [n_vocab] summing to 1, zero outside the kept
    candidates. Greedy (temp <= 0): one-hot of argmax, first index on ties.
    Cost: O(n_vocab) vectorised passes; a sort only of the top-p head (see _top_p_keep).
    """
    logits = np.asarray(logits, dtype=np.float32)
    if params.greedy:
        out = np.zeros(logits.shape[0], dtype=np.float64)  # [n_vocab]
        out[int(np.argmax(logits))] = 1.0
        return out
    ids, probs = _candidates(logits, params)
    if ids is None:
        return probs
    out = np.zeros(logits.shape[0], dtype=np.float64)  # [n_vocab]
    out[ids] = probs
    return out


def penalize(logits: np.ndarray, window: np.ndarray, repeat: float, frequency: float, presence: float) -> np.ndarray:
    """llama.cpp's llama_sampler_penalties on one row: a float32 copy of logits [n_vocab].

    window: int [n], the last repeat_last_n tokens the sampler accepted (prompt tokens included,
    as llama-server and llama-cli feed them; the engine builds it). For every token id t that
    occurs count(t) > 0 times in it, in float32 as llama.cpp:

        logit = logit * repeat   if logit <= 0  else  logit / repeat
        logit -= count(t) * frequency + presence

    Worked example: logits [2.0, -1.0, 0.5], window [0, 0, 1], repeat 2, frequency 0.5,
    presence 0.25 -> token 0: 2/2 - (2*0.5 + 0.25) = -0.25; token 1: -1*2 - (0.5 + 0.25) = -2.75;
    token 2 untouched: [-0.25, -2.75, 0.5].
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if len(window) == 0:
        return out
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    v = out[ids]                                                   # float32 [n_distinct]
    v = np.where(v <= 0, v * np.float32(repeat), v / np.float32(repeat)).astype(np.float32)
    v -= counts.astype(np.float32) * np.float32(frequency) + np.float32(presence)
    out[ids] = v
    return out


def inverse_cdf(probs: np.ndarray, u: np.ndarray | float) -> np.ndarray:
    """Token ids drawn from `probs` by inverse CDF in token-id order.

    probs: float [n_vocab] >= 0, not necessarily normalised, with positive mass.
    u:     uniforms in [0, 1), scalar or float64 [N]. Returns int64 of u's shape: the first id
           whose cumulative mass exceeds u * total. Never returns a zero-probability id.
    """
    cdf = np.cumsum(probs, dtype=np.float64)  # [n_vocab]
    total = cdf[-1]
    assert total > 0.0, "inverse_cdf needs positive mass"
    last = np.searchsorted(cdf, total, side="left")  # last id with positive probability
    idx = np.searchsorted(cdf, np.asarray(u, dtype=np.float64) * total, side="right")
    return np.minimum(idx, last)


def sample(logits: np.ndarray, params: SamplingParams, pos: int) -> int:
    """The token plain decoding emits at absolute position `pos`.

    logits: float32 [n_vocab]. Greedy -> argmax (first on ties). Otherwise one uniform from
    position_rng(params.seed, pos) through inverse_cdf(transform(logits, params)); computed on the
    sparse candidates, which gives the same id. Deterministic in (logits, params, pos).
    """
    if params.greedy:
        t = int(logits.argmax())   # numpy: the first NaN when there is one
        _finite_top(float(logits[t]), pos, inf_ok=True)
        return t
    try:
        ids, probs = _candidates(np.asarray(logits, dtype=np.float32), params)
    except NonFiniteLogits as e:
        raise NonFiniteLogits(e.top, pos) from None
    i = int(inverse_cdf(probs, position_rng(params.seed, pos).random()))
    return i if ids is None else int(ids[i])

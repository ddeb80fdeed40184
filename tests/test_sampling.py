"""kernels/sampling.py against a full-sort reference of llama.cpp's chain top_k -> top_p -> min_p -> temp."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.kernels.sampling import NonFiniteLogits, inverse_cdf, position_rng, sample, transform
from specrun.kernels.types import SamplingParams


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_transform(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The chain written the slow, obvious way: one full stable sort (ties to the lower id)."""
    out = np.zeros(logits.shape[0])
    if params.temp <= 0:
        out[np.argmax(logits)] = 1.0
        return out
    order = np.argsort(-logits.astype(np.float64), kind="stable")  # [n_vocab], descending
    if params.top_k > 0:
        order = order[: params.top_k]
    if params.top_p < 1.0:
        cum = np.cumsum(softmax(logits[order].astype(np.float64)))  # at temperature 1
        hit = np.flatnonzero(cum >= np.float32(params.top_p))
        order = order[: hit[0] + 1] if hit.size else order
    if params.min_p > 0.0:
        p1 = softmax(logits[order].astype(np.float64))  # at temperature 1
        order = order[p1 >= params.min_p * p1.max()]
    out[order] = softmax(logits[order].astype(np.float64) / params.temp)
    return out


COMBOS = [
    SamplingParams(),  # llama.cpp defaults: temp 0.8, top_k 40, top_p 0.95, min_p 0.05
    SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0),  # plain softmax
    SamplingParams(temp=1.3, top_k=0, top_p=0.9, min_p=0.0),
    SamplingParams(temp=0.5, top_k=0, top_p=1.0, min_p=0.1),
    SamplingParams(temp=0.7, top_k=5, top_p=0.5, min_p=0.0),
    SamplingParams(temp=2.0, top_k=1, top_p=0.95, min_p=0.05),
    SamplingParams(temp=0.9, top_k=100, top_p=0.99, min_p=0.01),
    SamplingParams(temp=1.0, top_k=10**6, top_p=0.8, min_p=0.2),  # top_k above the vocabulary
]


@pytest.mark.parametrize("params", COMBOS, ids=repr)
@pytest.mark.parametrize(
    ("n_vocab", "scale", "seed"),
    [(50, 1.0, 0), (50, 4.0, 1), (5000, 2.0, 2), (20000, 3.0, 3), (20000, 8.0, 4)],
)
def test_transform_matches_full_sort_reference(params, n_vocab, scale, seed):
    logits = (np.random.default_rng(seed).standard_normal(n_vocab) * scale).astype(np.float32)
    got = transform(logits, params)
    want = reference_transform(logits, params)
    assert got.dtype == np.float64 and got.shape == (n_vocab,)
    np.testing.assert_array_equal(np.flatnonzero(got), np.flatnonzero(want))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    assert got.sum() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(top_k=0, top_p=0.95, min_p=0.0), SamplingParams(top_k=0, top_p=1.0, min_p=0.0)],
    ids=repr,
)
@pytest.mark.parametrize("peaked", [False, True])
def test_transform_full_size_vocabulary(params, peaked):
    """262144 entries: the threshold/partition fast paths against the full sort."""
    logits = (np.random.default_rng(7).standard_normal(262144) * 3).astype(np.float32)
    if peaked:
        logits[[5, 90000, 262143]] += 25.0
    np.testing.assert_allclose(transform(logits, params), reference_transform(logits, params), rtol=1e-12, atol=1e-15)


OFF = dict(top_k=0, top_p=1.0, min_p=0.0)


@pytest.mark.parametrize(
    ("logits", "params", "support"),
    [
        # top_k: ties at the boundary go to the lower id
        ([1, 3, 2, 2, 2, 0], SamplingParams(temp=1.0, top_k=3, top_p=1.0, min_p=0.0), [1, 2, 3]),
        ([1, 3, 2, 2, 2, 0], SamplingParams(temp=1.0, top_k=1, top_p=1.0, min_p=0.0), [1]),
        ([1, 3, 2, 2, 2, 0], SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0), [0, 1, 2, 3, 4, 5]),
        ([1, 3, 2, 2, 2, 0], SamplingParams(temp=1.0, top_k=-1, top_p=1.0, min_p=0.0), [0, 1, 2, 3, 4, 5]),
        # top_p on four equal logits: cumulative 0.25, 0.5, 0.75, 1.0 exactly; inclusive (>= p)
        ([0, 0, 0, 0], SamplingParams(temp=1.0, top_k=0, top_p=0.5, min_p=0.0), [0, 1]),
        ([0, 0, 0, 0], SamplingParams(temp=1.0, top_k=0, top_p=0.5000001, min_p=0.0), [0, 1, 2]),
        ([0, 0, 0, 0], SamplingParams(temp=1.0, top_k=0, top_p=1e-6, min_p=0.0), [0]),
        ([0, 0, 0, 0], SamplingParams(temp=1.0, top_k=0, top_p=0.0, min_p=0.0), [0]),
        ([0, 0, 0, 0], SamplingParams(temp=1.0, top_k=0, top_p=0.99, min_p=0.0), [0, 1, 2, 3]),
        # top_p is measured after top_k: 2 survivors -> [0.73, 0.27] -> the first alone reaches 0.6
        ([2, 1, 1, 1, 1, 1, 1, 1], SamplingParams(temp=1.0, top_k=2, top_p=0.6, min_p=0.0), [0]),
        ([2, 1, 1, 1, 1, 1, 1, 1], SamplingParams(temp=1.0, top_k=0, top_p=0.6, min_p=0.0), [0, 1, 2, 3, 4]),
        # min_p keeps p_i >= min_p * p_max, i.e. logit >= max + log(min_p); equality is kept
        ([0, -1, -2, -3, -4], SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=float(np.exp(-2.5))), [0, 1, 2]),
        ([0, -1, -2, -3, -4], SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=float(np.exp(-0.5))), [0]),
        ([0, 0, -1], SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=1.0), [0, 1]),
        ([0, -1, -2, -30, -80], SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0), [0, 1, 2, 3, 4]),
        # the filters see temperature-1 probabilities: temperature does not move the cut
        ([0, -1, -2, -3, -4], SamplingParams(temp=0.05, top_k=0, top_p=1.0, min_p=float(np.exp(-2.5))), [0, 1, 2]),
        ([0, -1, -2, -3, -4], SamplingParams(temp=50.0, top_k=0, top_p=1.0, min_p=float(np.exp(-2.5))), [0, 1, 2]),
        ([0, -1, -2, -3, -4], SamplingParams(temp=0.05, top_k=0, top_p=0.8, min_p=0.0), [0, 1]),
        ([0, -1, -2, -3, -4], SamplingParams(temp=50.0, top_k=0, top_p=0.8, min_p=0.0), [0, 1]),
    ],
)
def test_filter_boundaries(logits, params, support):
    got = transform(np.asarray(logits, dtype=np.float32), params)
    assert np.flatnonzero(got).tolist() == support


def test_top_k_ties_large_vocabulary():
    """The thresholded partition path (n_vocab > 4096) breaks ties to the lower id too."""
    logits = np.full(10000, -5.0, dtype=np.float32)
    logits[[9000, 7000, 3000, 5000]] = 1.0
    logits[42] = 2.0
    got = transform(logits, SamplingParams(temp=1.0, top_k=3, top_p=1.0, min_p=0.0))
    assert np.flatnonzero(got).tolist() == [42, 3000, 5000]


def test_temperature_scales_survivors():
    logits = np.array([0.0, -1.0, -2.0], dtype=np.float32)
    got = transform(logits, SamplingParams(temp=0.5, **OFF))
    np.testing.assert_allclose(got, softmax(np.array([0.0, -2.0, -4.0])), rtol=1e-12)


@pytest.mark.parametrize("temp", [0.0, -1.0])
def test_greedy_is_first_argmax(temp):
    logits = np.array([1, 5, 5, 2, 5], dtype=np.float32)
    params = SamplingParams(temp=temp)
    assert transform(logits, params).tolist() == [0, 1, 0, 0, 0]
    assert all(sample(logits, params, pos) == 1 for pos in range(20))


def test_sample_is_deterministic_per_seed_and_position():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    first = [sample(logits, params, pos) for pos in range(300)]
    assert first == [sample(logits, params, pos) for pos in range(300)]
    assert len(set(first)) > 100  # a new draw at every position, not one repeated token
    other_seed = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1235)
    assert first != [sample(logits, other_seed, pos) for pos in range(300)]


@pytest.mark.parametrize("params", COMBOS[:5], ids=repr)
def test_sample_is_inverse_cdf_of_transform(params):
    """sample() works on the sparse candidates; it must pick what the dense distribution gives."""
    rng = np.random.default_rng(5)
    for pos in range(100):
        logits = (rng.standard_normal(300) * 2).astype(np.float32)
        u = position_rng(params.seed, pos).random()
        t = sample(logits, params, pos)
        assert t == int(inverse_cdf(transform(logits, params), u))
        assert transform(logits, params)[t] > 0.0


def test_position_rng_streams_differ():
    draws = {s: position_rng(7, 11, s).random() for s in range(3)}
    assert len(set(draws.values())) == 3
    assert position_rng(7, 11).random() == draws[0]
    assert position_rng(7, 12).random() != draws[0]


@pytest.mark.parametrize(
    ("probs", "u", "want"),
    [
        ([0.5, 0.5, 0.0, 0.0], 0.0, 0),
        ([0.5, 0.5, 0.0, 0.0], 0.5, 1),  # the first id whose cumulative mass exceeds u
        ([0.5, 0.5, 0.0, 0.0], 1.0, 1),  # clamped to the last positive id, never a zero-mass tail
        ([0.0, 0.0, 1.0, 0.0], 0.0, 2),  # never a zero-mass head
        ([0.0, 2.0, 0.0, 6.0], 0.3, 3),  # unnormalised
        ([0.0, 2.0, 0.0, 6.0], 0.2, 1),
    ],
)
def test_inverse_cdf(probs, u, want):
    assert int(inverse_cdf(np.asarray(probs), u)) == want


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("row, greedy_ok", [
    ([1.0, NAN, 2.0], False),          # numpy's argmax is the NaN: greedy would emit it
    ([NAN] * 3, False),
    ([-INF] * 3, False),               # every token forbidden (a logit bias, a grammar)
    ([1.0, INF, 2.0], True),           # greedy takes the infinite logit; a softmax cannot
])
@pytest.mark.parametrize("params", [SamplingParams(temp=0.0), SamplingParams(temp=0.8),
                                    SamplingParams(temp=0.8, top_k=0, top_p=1.0, min_p=0.0)])
def test_logits_without_a_finite_maximum_are_an_error_naming_the_position(row, greedy_ok, params):
    """They were a ValueError from an empty candidate set (or an AssertionError in inverse_cdf) when
    sampled, and token 0 or the NaN's id when greedy."""
    logits = np.array(row, dtype=np.float32)
    if params.greedy and greedy_ok:
        assert sample(logits, params, 5) == 1
        return
    with pytest.raises(NonFiniteLogits, match=r"^the model's logits at position 5 have no finite maximum") as e:
        sample(logits, params, 5)
    assert ("forbids them all" in str(e.value)) == (row == [-INF] * 3)

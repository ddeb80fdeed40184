"""Speculative (rejection) sampling end to end on Gemma 3 270M: the first token that comes out of a
verify pass follows the plain model's own distribution at that position.

The drafter is Gemma itself sampling at a hotter temperature (q != p), so drafts are accepted
sometimes and rejected sometimes; tokens come from both the accept and the residual branch.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from specrun.kernels.drafters import DraftModel
from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams, SpecParams
from specrun.kernels.sampling import transform
from specrun.kernels.types import DraftOptions, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
N_SEEDS = 800
SAMPLING = SamplingParams(temp=0.8)          # llama.cpp's default top-k 40, top-p 0.95, min-p 0.05


class HotDraft(DraftModel):
    """Draws its drafts at temperature 1.5 while the target samples at 0.8: q differs from p."""

    def begin(self, prompt, n_keep: int, opts: DraftOptions) -> int:
        hot = None if opts.sampling is None else replace(opts.sampling, temp=1.5)
        return super().begin(prompt, n_keep, replace(opts, sampling=hot))


@pytest.fixture(scope="module")
def setup(gemma_path):
    e = Engine(str(gemma_path), EngineParams(n_ctx=512))
    d = HotDraft(e.target, str(gemma_path))
    yield e, d
    d.close()
    e.close()


def tv(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def test_first_verified_token_follows_the_model(setup):
    e, d = setup
    P = e.tokenize(PROMPT)
    spec = SpecParams(n_max=2, verify="rejection")
    pairs, n_drafted, n_accepted = [], 0, 0
    for seed in range(N_SEEDS):
        gen = e.generate(P, 4, replace(SAMPLING, seed=seed), spec=spec, drafters=[d])
        out = [t for ch in gen for t in ch]
        pairs.append((out[0], out[1]))
        n_drafted += gen.stats.n_drafted
        n_accepted += gen.stats.n_accepted
        assert gen.stats.verify == "rejection"
    assert 0 < n_accepted < n_drafted            # both branches taken

    # the plain model's own distribution of the second token: sum over t1 of p(t1) p(t2 | t1)
    e.reset()
    e.ctx.decode(P, 0, "last")
    p1 = transform(e.ctx.logits_rows()[-1].copy(), SAMPLING)           # [n_vocab]
    expected: dict[int, float] = {}
    for t1 in np.flatnonzero(p1):
        e.ctx.seq_rm(len(P), -1)
        e.ctx.decode([int(t1)], len(P), "last")
        p2 = transform(e.ctx.logits_rows()[-1].copy(), SAMPLING)
        for t2 in np.flatnonzero(p2):
            expected[int(t2)] = expected.get(int(t2), 0.0) + p1[t1] * p2[t2]
    e.reset()
    empirical: dict[int, float] = {}
    for _, t2 in pairs:
        empirical[t2] = empirical.get(t2, 0.0) + 1.0 / N_SEEDS
    # E[TV] <= 1/2 sqrt(K/N) over a support of K tokens, plus McDiarmid's margin at delta = 1e-4
    K = len(expected)
    bound = 0.5 * math.sqrt(K / N_SEEDS) + math.sqrt(math.log(1e4) / (2 * N_SEEDS))
    got = tv(empirical, expected)
    assert got < bound, (got, bound, K)
    assert set(empirical) <= set(expected)       # never a token the model could not sample

    # and the first token (plain sampling from the prompt pass) against p(t1)
    emp1: dict[int, float] = {}
    for t1, _ in pairs:
        emp1[t1] = emp1.get(t1, 0.0) + 1.0 / N_SEEDS
    exp1 = {int(t): float(p1[t]) for t in np.flatnonzero(p1)}
    assert tv(emp1, exp1) < 0.5 * math.sqrt(len(exp1) / N_SEEDS) + math.sqrt(math.log(1e4) / (2 * N_SEEDS))


def test_rejection_sampling_is_reproducible(setup):
    e, d = setup
    P = e.tokenize("Once upon a time")
    spec = SpecParams(n_max=4, verify="rejection")
    runs = [[t for ch in e.generate(P, 24, replace(SAMPLING, seed=99), spec=spec, drafters=[d]) for t in ch]
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = [t for ch in e.generate(P, 24, replace(SAMPLING, seed=100), spec=spec, drafters=[d]) for t in ch]
    assert other != runs[0]

"""One pass-cost model and one E(k) for auto's calibration and the adaptive draft length
(kernels/draftlen.py: VerifyCost, curve_of, PassCost.of, expected_tokens): the code before they were
merged is kept here, and both give the same numbers and the same choices for fixed inputs."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from specrun.kernels.calibrate import Costs, DrafterCost, ProbeRun, choose, predict
from specrun.kernels.draftlen import (
    PassCost,
    VerifyCost,
    best_length,
    curve_of,
    curve_rows,
    expected_each,
    expected_tokens,
    rates_of,
)
from specrun.kernels.params import SpecParams

# ---- the code before the merge (kernels/calibrate.py, kernels/draftlen.py, kernels/engine.py) ----


def old_calibrate_curve(times: dict[int, list[float]]) -> tuple[list[float], list[float]]:
    """measure_verify_cost's curve: (medians made non-decreasing, raw medians)."""
    raw = [statistics.median(times[r]) for r in sorted(times)]
    med = list(raw)
    for i in range(1, len(med)):
        med[i] = max(med[i], med[i - 1])
    return med, raw


def old_engine_probe(times: dict[int, list[float]]) -> PassCost:
    """Engine._measure_pass_cost + _record_curve: the fastest per row, non-decreasing, recorded."""
    c, top = PassCost(), 0.0
    for r in sorted(times):
        top = max(top, min(times[r]))
        c.record(r, top)
    return c


def old_acc_sum(a: tuple[float, ...], k: float) -> float:
    """predict()'s a_0 + ... + a_{k'-1}, a fractional k' taking its part of the next."""
    n_full = int(k)
    return sum(a[:n_full]) + (k - n_full) * (a[n_full] if n_full < len(a) else 0.0)


def old_best_length(a, cost: PassCost, cap: int, k_min: int = 1) -> int:
    rates = [float(a)] * cap if isinstance(a, (int, float)) else a
    best, best_k, e, p = 0.0, k_min, 1.0, 1.0
    for k in range(cap + 1):
        if k > 0:
            p *= rates[k - 1]
            e += p
        if k >= k_min and e / cost.at(k + 1) > best * (1 + 1e-9):
            best, best_k = e / cost.at(k + 1), k
    return best_k


def old_expected_tokens(a, k: int) -> float:
    if isinstance(a, (int, float)):
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    e, p = 1.0, 1.0
    for i in range(k):
        p *= a[i]
        e += p
    return e


# ---- fixed numbers --------------------------------------------------------------------------

ROWS = curve_rows(17)
# ms per pass of ROWS rows (Gemma 3 270M's shape on 2 threads: a block of 4 rows, 12 below 9), 5 rounds
TIMES = {r: [(10 + 2.2 * r + (4 if r % 4 == 1 and r > 1 else 0) - (3 if r == 12 else 0) + j * 0.3 * (-1) ** j) / 1e3
             for j in range(5)] for r in ROWS}


def random_times(rng, rounds: int) -> dict[int, list[float]]:
    return {r: list((10 + 2.0 * r) * (1 + rng.uniform(-0.3, 0.6, rounds)) / 1e3) for r in ROWS}


def test_the_calibrations_curve_is_the_median_made_non_decreasing():
    rng = np.random.default_rng(7)
    for times in [TIMES, *(random_times(rng, n) for n in (1, 2, 5, 5, 7))]:
        v = curve_of(times, depth=200)
        med, raw = old_calibrate_curve(times)
        assert v == VerifyCost(tuple(ROWS), tuple(med), tuple(min(times[r]) for r in ROWS),
                               tuple(max(times[r]) for r in ROWS), 200, tuple(raw))


def test_the_engines_probe_seeds_the_same_pass_cost():
    rng = np.random.default_rng(8)
    for times in [TIMES, *(random_times(rng, 2) for _ in range(20))]:
        new = PassCost()
        new.add(curve_of(times, fastest=True))
        old = old_engine_probe(times)
        assert new.sums == old.sums and new.scale == old.scale
        for r in range(1, 40):
            assert new.at(r) == old.at(r)


def test_auto_seeds_the_curve_it_measured():
    v = curve_of(TIMES)
    c = PassCost.of(v)
    assert sorted(c.sums) == list(ROWS) and c.scale == 1.0
    assert [c.at(r) for r in ROWS] == list(v.s)
    assert [c.at(r + 0.5) for r in ROWS[:-1]] == [v.at(r + 0.5) for r in ROWS[:-1]]   # one line between points


@pytest.mark.parametrize("a", [0.0, 0.3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("k", [0, 1, 2, 7, 16])
def test_expected_tokens_of_one_rate_is_unchanged(a, k):
    assert expected_tokens(a, k) == old_expected_tokens(a, k)
    assert expected_tokens([a] * k, k) == old_expected_tokens([a] * k, k)


def test_expected_tokens_by_position_and_fractional():
    a = [0.9, 0.5, 0.8]
    assert list(expected_each(a, 3)) == [1.0, 1.9, 1.9 + 0.45, 1.9 + 0.45 + 0.36]
    assert expected_tokens(a, 2.5) == pytest.approx(1.9 + 0.45 + 0.5 * 0.36)
    assert expected_tokens(a, 5) == expected_tokens(a, 3)            # past the rates: 0
    assert expected_tokens(0.5, 1.5) == pytest.approx(1.5 + 0.5 * 0.25)
    assert rates_of([0.8, 0.4, 0.0, 0.0]) == [0.8, 0.5, 0.0, 0.0]
    assert rates_of([]) == []


def test_best_length_choices_are_unchanged():
    rng = np.random.default_rng(9)
    n = 0
    for _ in range(300):
        cap = int(rng.integers(1, 40))
        cost = PassCost.of(curve_of(random_times(rng, 3)))
        for _ in range(int(rng.integers(0, 6))):      # the engine's own passes move the level and the shape
            r = int(rng.integers(1, 18))
            cost.record(r, cost.at(r) * rng.uniform(0.7, 1.5))
        rates = list(rng.choice([rng.uniform(0, 1), 1.0, 0.0, 0.95], cap))
        for a in (rates, float(rates[0])):
            for k_min in (0, 1):
                assert best_length(a, cost, cap, k_min) == old_best_length(a, cost, cap, k_min)
                n += 1
    assert n == 1200


def probe_run(n_max: int, f: float, acc: tuple[float, ...], mean_len: float) -> ProbeRun:
    n_passes = 100
    n_drafts = round(f * n_passes)
    return ProbeRun(n_max, n_passes, 150, n_drafts, round(n_drafts * mean_len), 0, acc, 0.012, 0.0)


CANDIDATES = [
    (SpecParams(types=("ngram-simple",), ngram_size_n=3, ngram_size_m=16), (0.3, (0.6, 0.5, 0.45, 0.4, 0.3), 4.6)),
    (SpecParams(types=("ngram-simple",), ngram_size_n=12, ngram_size_m=48), (0.1, (0.9, 0.9, 0.85), 2.3)),
    (SpecParams(types=("draft-mtp",), n_max=1), (1.0, (0.7,), 1.0)),
    (SpecParams(types=("draft-mtp",), n_max=3), (1.0, (0.7, 0.5, 0.3), 3.0)),
]


def test_predict_and_choose_agree_with_the_old_e_of_k():
    rng = np.random.default_rng(10)
    for trial in range(200):
        verify = curve_of(random_times(rng, 5) if trial else TIMES)
        t1 = verify.s[0] * rng.uniform(1.0, 1.3)
        drafters, cands = [], []
        for spec, (f, acc, mean_len) in CANDIDATES:
            acc = tuple(sorted(np.clip(np.array(acc) * rng.uniform(0.5, 1.3), 0, 1), reverse=True)) if trial else acc
            run = probe_run(max(spec.n_max, spec.ngram_size_m), f, acc, mean_len)
            drafters.append(DrafterCost(spec, (run,), rng.uniform(0, 0.002), rng.uniform(0, 0.003)))
            cands.append(spec)
        costs = Costs(verify, t1, tuple(drafters))
        for spec, dc in zip(cands, drafters, strict=True):
            p, run = predict(costs, spec), dc.long
            k = min(float(spec.n_max if spec.types[0] == "draft-mtp" else spec.ngram_size_m), run.mean_len)
            assert p.tokens_per_pass == pytest.approx(1.0 + run.f * old_acc_sum(run.acc_per_pos, k), rel=1e-12)
        new = choose(costs, cands)
        old = sorted(cands, key=lambda s: -old_speedup(costs, s))
        best = old_speedup(costs, old[0])
        assert new.spec == (old[0] if best > 1.1 else SpecParams())
        assert [q.spec for q in new.table] == old


def old_speedup(costs: Costs, spec: SpecParams) -> float:
    dc = next(d for d in costs.drafters if d.spec == spec)
    p = dc.long
    k = min(float(spec.n_max if spec.types[0] == "draft-mtp" else spec.ngram_size_m), p.mean_len)
    e = 1.0 + p.f * old_acc_sum(p.acc_per_pos, k)
    tv = costs.t1_s + costs.verify.at(k + 1) - costs.verify.at(1)
    t = p.f * tv + (1 - p.f) * costs.t1_s + dc.c0_s + dc.c1_s * p.f * k
    return e * costs.t1_s / t


# ---- the one way passes are timed, on real engines -------------------------------------------


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from specrun.gguf_spec.testmodel import Head, SynthConfig
    from specrun.kernels.testmodel import build_test_model

    return build_test_model(tmp_path_factory.mktemp("hybrid") / "h.gguf", SynthConfig(head=Head.parse("exact")), "q8_0")


def greedy(engine, prompt, n: int = 12) -> list[int]:
    from specrun.kernels.types import SamplingParams

    with engine.generate(prompt, n, SamplingParams(temp=0.0)) as gen:
        return [t for toks in gen for t in toks]


@pytest.mark.parametrize("which", ["smollm", "hybrid"])
def test_calibration_and_probe_time_passes_and_leave_the_text_alone(which, smollm_path, hybrid):
    """measure_verify_cost (auto) and the adaptive length's probe time the same passes through
    Engine.measure_passes; a hybrid model takes them back through a checkpoint (or, with nothing
    cached, by clearing). The calibration leaves the KV cache empty; the text after either is plain's."""
    from specrun.kernels.calibrate import measure_verify_cost
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams

    with Engine(str(smollm_path if which == "smollm" else hybrid), EngineParams(n_ctx=1024)) as e:
        prompt = e.tokenize("the quick brown fox jumps over the lazy dog " * 8)
        plain = greedy(e, prompt)
        steps: list[str] = []
        v = measure_verify_cost(e, prompt, rows=(1, 2, 5, 9), reps=2, on_step=steps.append)
        assert v.rows == (1, 2, 5, 9) and v.depth == len(prompt) and len(steps) == 3
        assert all(x > 0 for x in v.s) and list(v.s) == sorted(v.s)
        assert all(lo <= m <= hi for lo, m, hi in zip(v.s_min, v.s_median, v.s_max, strict=True))
        assert e.kv_tokens == [] and e.ctx.pos_max() == -1
        assert greedy(e, prompt) == plain
        n_kv = len(e.kv_tokens)
        e._measure_pass_cost(9)
        assert set(curve_rows(9)) <= set(e.pass_cost.sums) and len(e.kv_tokens) == n_kv
        assert e.ctx.pos_max() == n_kv - 1
        assert greedy(e, prompt) == plain


def test_a_curve_made_by_hand_is_seeded_non_decreasing():
    c = PassCost.of(VerifyCost((1, 2, 4), (0.010, 0.014, 0.013), (), ()))
    assert [c.at(r) for r in (1, 2, 4)] == [0.010, 0.014, 0.014]

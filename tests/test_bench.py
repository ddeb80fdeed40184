"""`specrun bench` and `--spec-type auto` (kernels.calibrate): the table and its JSON agree, the
equality column catches a setting whose output differs, and the chooser's math, unit-tested with
injected costs, then end to end on tiny MTP models. No assertion is about a measured time."""

from __future__ import annotations

import io
import json
import re
import sys
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from specrun.cli.bench_cmd import (
    BenchPrompt,
    BenchRow,
    Setting,
    parse_settings,
    plot_label,
    run_bench,
    tables,
    verify_dicts,
)
from specrun.cli.main import cli
from specrun.cli.runtime.auto import resolve_auto
from specrun.cli.runtime.loading import available_types
from specrun.kernels.calibrate import (
    CachedMeasure,
    Costs,
    DrafterCost,
    ProbeRun,
    VerifyCost,
    calibrate,
    choose,
    fit_drafter,
    measure,
    measure_verify_cost,
    predict,
    setting_name,
)
from specrun.kernels.calibrate import _probe_once as probe_once
from specrun.kernels.params import NgramModParams, SpecParams
from specrun.kernels.types import Draft, SamplingParams

MS = 1e-3


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# ---- models ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    """The tiny shape: 2 trunk layers, n_embd 256, an exact MTP head as costly as the trunk. Q8_0:
    quantized weights are bit-exact in verify batches (F16 ones differ by ~1e-5, README)."""
    from specrun.gguf_spec.testmodel import Head, SynthConfig
    from specrun.kernels.testmodel import build_test_model

    return build_test_model(tmp_path_factory.mktemp("bench") / "tiny.gguf", SynthConfig(head=Head.parse("exact")),
                            "q8_0")


def engine_for(path, types=None):
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams

    types = available_types(path, None) if types is None else types
    return Engine(str(path), EngineParams(n_ctx=1024, n_threads=1, spec=SpecParams(types=types, n_max=16)))


# ---- the bench: table == JSON --------------------------------------------------------------


def table_rows(text: str, title_start: str) -> list[list[str]]:
    """The body rows of the rich table printed under the title line starting with title_start."""
    lines = text.splitlines()
    i = next(j for j, ln in enumerate(lines) if ln.startswith(title_start))
    rows, seen_header = [], False
    for ln in lines[i + 1:]:
        if ln.startswith("╰"):
            break
        if ln.startswith("│"):
            cells = [c.strip() for c in ln.strip("│").split("│")]
            if seen_header:
                rows.append(cells)
            seen_header = True
    return rows


def fmt_row(d: dict) -> list[str]:
    dash = "—"
    if d["equal_to_none"] is None:
        eq = dash
    elif not d["equal_to_none"]:
        eq = f"NO@{d['first_diff']}"
    else:
        eq = "ref" if d["n_max"] is None else "yes"
    return [d["setting"], dash if d["n_max"] is None else str(d["n_max"]), f"{d['gen_tps']:.1f}",
            f"{d['gen_tps_min']:.1f}–{d['gen_tps_max']:.1f}", f"×{d['ratio_to_none']:.2f}",
            dash if d["acceptance_rate"] is None else f"{d['acceptance_rate']:.3f}",
            dash if d["mean_acc_len"] is None else f"{d['mean_acc_len']:.2f}", f"{d['tokens_per_pass']:.2f}", eq]


@pytest.mark.slow
def test_bench_tiny_model_prints_one_row_per_setting_and_json_has_the_same_numbers(tiny_mtp):
    r = invoke("bench", "-m", str(tiny_mtp), "-t", "1", "-c", "1024", "-n", "16", "--reps", "1",
               "--spec-draft-n-max", "1,3", "--prompts", "free,code,chat", "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert "skipping the chat prompt: the model has no chat template" in r.stderr
    assert [p["name"] for p in d["prompts"]] == ["free", "code"]
    # the spec types default to what the file allows: this model has MTP heads
    # (ngram-simple runs once: its drafts are bounded by size_m, 48, not by the n-max list)
    expected = [("none", None), ("ngram-simple", 48), ("draft-mtp", 1), ("draft-mtp", 3)]
    for p in d["prompts"]:
        assert [(x["setting"], x["n_max"]) for x in p["rows"]] == expected
        rows = table_rows(r.stderr, f"{p['name']}: {p['n_prompt']} prompt tokens, -n 16, 1 reps")
        assert len(rows) == len(expected)
        for cells, x in zip(rows, p["rows"], strict=True):
            assert len(cells) == 9 and all(cells)
            assert cells == fmt_row(x)
            assert x["equal_to_none"] is True          # greedy speculative output == none's
            assert x["n_gen"] == 16
        mtp3 = p["rows"][-1]
        assert mtp3["acceptance_rate"] == 1.0 and mtp3["tokens_per_pass"] > 3   # an exact head
    vrows = table_rows(r.stderr, "verify pass cost by rows on this machine")
    assert [int(c[0]) for c in vrows] == [v["rows"] for v in d["verify_cost"]["rows"]] == [1, 2, 4, 5, 8, 9, 12, 13, 16, 17]
    for cells, v in zip(vrows, d["verify_cost"]["rows"], strict=True):
        assert cells == [str(v["rows"]), f"{v['ms']:.2f}", f"{v['ms_min']:.2f}–{v['ms_max']:.2f}",
                         f"{v['x_single']:.2f}"]
    assert d["threads"] == 1 and d["reps"] == 1 and len(d["load_avg"]) == 3


@pytest.mark.slow
def test_bench_csv_and_plot(tiny_mtp, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    r = invoke("bench", "-m", str(tiny_mtp), "-t", "1", "-n", "8", "--reps", "1", "--spec-type", "none,draft-mtp",
               "--spec-draft-n-max", "2", "-p", "Hello world, this is a test", "--csv", "--plot", str(out))
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("prompt,setting,n_max,gen_tps,")
    assert [ln.split(",")[:3] for ln in lines[1:]] == [["prompt", "none", ""], ["prompt", "draft-mtp", "2"]]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(tiny_mtp, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # import matplotlib -> ImportError
    r = invoke("bench", "-m", str(tiny_mtp), "--plot", "x.png")
    assert r.exit_code == 1
    assert r.stderr.strip() == "Error: --plot needs matplotlib: pip install 'specrun[plot]'"


def test_bench_flag_errors(tiny_mtp):
    r = invoke("bench", "-m", str(tiny_mtp), "--json", "--csv")
    assert r.exit_code == 2 and "--json and --csv do not go together" in r.stderr
    r = invoke("bench", "-m", str(tiny_mtp), "--spec-draft-n-max", "1,x")
    assert r.exit_code == 2 and "not a comma-separated list of integers" in r.stderr
    r = invoke("bench", "-m", str(tiny_mtp), "--spec-type", "none,eagle")
    assert r.exit_code == 2 and "unknown spec type 'eagle'" in r.stderr
    r = invoke("bench", "-m", str(tiny_mtp), "--prompts", "poetry")
    assert r.exit_code == 2 and "unknown prompt 'poetry'" in r.stderr
    r = invoke("bench", "-m", str(tiny_mtp), "--prompts", "free", "-p", "x")
    assert r.exit_code == 2 and "give --prompts or -p/-f, not both" in r.stderr
    r = invoke("bench", "-m", str(tiny_mtp), "--spec-type", "none,auto")
    assert r.exit_code == 2 and ("Invalid value for --spec-type: bench compares named settings, and auto is a choice "
                                 "among them: leave --spec-type out to compare every type this model can use, or see "
                                 "what auto picks with `specrun run --spec-type auto`") in r.stderr


NGRAM_NOTE = ("--spec-draft-n-max 3,8 is ignored: n-gram drafts are bounded by their own flags "
              "(--spec-ngram-simple-size-m, --spec-ngram-map-k-size-m, --spec-ngram-mod-n-max...), as in llama.cpp")


@pytest.mark.parametrize(("args", "noted"), [
    (("--spec-type", "none,ngram-simple,ngram-mod", "--spec-draft-n-max", "3,8"), True),
    (("--spec-type", "ngram-simple", "--spec-draft-n-max", "3,8"), True),
    (("--spec-type", "ngram-simple,draft-mtp", "--spec-draft-n-max", "3,8"), False),   # draft-mtp runs at each
    (("--spec-type", "none", "--spec-draft-n-max", "3,8"), False),
    (("--spec-type", "ngram-simple",), False),                                        # the default list: not given
])
def test_bench_says_when_n_max_does_not_apply(tiny_mtp, args, noted):
    """--spec-draft-n-max given with n-gram types only gets one line on stderr (the bad --prompts
    stops the command before the model loads)."""
    r = invoke("bench", "-m", str(tiny_mtp), *args, "--prompts", "poetry")
    assert r.exit_code == 2 and "unknown prompt 'poetry'" in r.stderr
    assert (NGRAM_NOTE in r.stderr) is noted, r.stderr
    if noted:
        assert r.stderr.count("is ignored") == 1


def test_plot_labels_say_n_max():
    row = dict(prompt="free", gen_tps=1.0, gen_tps_min=1.0, gen_tps_max=1.0, ratio_to_none=1.0, acceptance_rate=None,
               mean_acc_len=None, tokens_per_pass=1.0, n_gen=8, equal_to_none=True, first_diff=None)
    assert [plot_label(BenchRow(setting=s, n_max=k, **row)) for s, k in
            [("none", None), ("ngram-simple", 48), ("draft-mtp", 3)]] == ["none", "ngram-simple, n-max 48",
                                                                           "draft-mtp, n-max 3"]


def test_parse_settings_none_first_combinations_and_aliases():
    s = parse_settings("ngram-simple,draft-mtp+ngram-simple,none,draft", "1,3,1", 3, 16)
    assert [(x.label, x.spec.n_max) for x in s] == [
        ("none", 3), ("ngram-simple", 1), ("ngram-simple+draft-mtp", 1),
        ("ngram-simple+draft-mtp", 3), ("draft-simple", 1), ("draft-simple", 3)]
    assert s[0].is_none and s[1].spec.ngram_size_n == 3 and s[1].spec.ngram_size_m == 16


# ---- the equality column catches a broken setting --------------------------------------------


class LeakyKV:
    """A deliberately broken drafter: it "looks ahead" in the target's own context and leaves a
    wrong token in the KV cache at the last evaluated position (the bug of a drafter that
    shares the target context and forgets to restore it). It proposes nothing, so every step is
    a plain one: only the corrupted cache can change the output."""

    spec_type = "leaky-kv"
    needs_hidden = False

    def __init__(self, engine) -> None:
        self.engine, self.n_corrupted = engine, 0

    def begin(self, prompt, n_keep: int, opts) -> int:
        return n_keep

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        p = len(ctx) - 2                                   # the last position the target evaluated
        c = self.engine.ctx
        if c.seq_rm(p, -1):
            c.decode([(int(ctx[-2]) + 1) % self.engine.model.n_vocab], p, "none")
            self.n_corrupted += 1
        return Draft.empty()

    def accept(self, tp) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_a_setting_whose_output_differs_is_flagged(smollm_path):
    leaky: list[LeakyKV] = []

    def make(engine):
        leaky.append(LeakyKV(engine))
        return leaky[-1:]

    settings = [Setting(SpecParams()), Setting(SpecParams(types=("ngram-simple",), n_max=4)),
                Setting(SpecParams(n_max=4), name="leaky-kv", drafters=make)]
    with engine_for(smollm_path) as engine:
        prompt = BenchPrompt("free", tuple(int(t) for t in engine.tokenize("Once upon a time, there was")))
        res = run_bench(engine, [prompt], settings, 16, 2, verify_rows=(1, 2), verify_reps=1)
    assert leaky and all(d.n_corrupted > 0 for d in leaky)
    rows = {r.setting: r for r in res.rows}
    assert rows["none"].equal_to_none is True and rows["ngram-simple"].equal_to_none is True
    bad = rows["leaky-kv"]
    assert bad.equal_to_none is False and bad.first_diff is not None and 0 < bad.first_diff < 16
    from rich.console import Console

    con = Console(width=160, record=True, file=io.StringIO())
    meta = {"threads": 1, "verify_reps": 1, "n_predict": 16, "reps": 2, "temp": 0.0}
    for title, t in tables(res, meta):
        con.print(title)
        con.print(t)
    text = con.export_text()
    assert f"NO@{bad.first_diff}" in text
    assert table_rows(text, "free:")[2][-1] == f"NO@{bad.first_diff}"


# ---- the chooser's math, with injected costs -------------------------------------------------


def verify_curve(ms_by_rows: dict[int, float]) -> VerifyCost:
    rows = tuple(sorted(ms_by_rows))
    s = tuple(ms_by_rows[r] * MS for r in rows)
    return VerifyCost(rows, s, s, s)


def mtp_like(k_max: int, acc: list[float], t_pass_1: float, t_pass_k: float, t_tok: float,
             spec_type: str = "draft-mtp", f: float = 1.0) -> list[ProbeRun]:
    """Probes at n_max 1 and k_max; acc[i] = fraction of drafts accepted through position i."""
    n_passes = 100
    n_drafts = round(f * n_passes)

    def run(k):
        a = tuple(acc[:k])
        return ProbeRun(k, n_passes, 0, n_drafts, n_drafts * k, round(n_drafts * sum(a)), a, t_pass_1 * MS
                        if k == 1 else t_pass_k * MS, t_tok * MS)

    return [run(1), run(k_max)] if k_max > 1 else [run(1)]


def test_reproduces_the_gemma_numbers_of_mtp_notes_5():
    """MTP_NOTES §5: T1 13.6 ms, verify 26.8 / 33.6 ms for 2 / 4 rows, a draft step of 9 ms and
    100 % acceptance give about 0.76 at n = 1 and 0.90 at n = 3."""
    v = verify_curve({1: 13.6, 2: 26.8, 4: 33.6, 8: 49.7, 16: 79.0})
    dc = DrafterCost(SpecParams(types=("draft-mtp",), n_max=3), tuple(mtp_like(3, [1.0] * 3, 0, 0, 9.0)),
                     c0_s=0.0, c1_s=9.0 * MS)
    costs = Costs(v, 13.6 * MS, (dc,))
    p1, p3 = (predict(costs, SpecParams(types=("draft-mtp",), n_max=k)) for k in (1, 3))
    assert p1.tokens_per_pass == pytest.approx(2.0) and p1.speedup == pytest.approx(0.76, abs=0.01)
    assert p3.tokens_per_pass == pytest.approx(4.0) and p3.speedup == pytest.approx(0.90, abs=0.01)
    c = choose(costs, [SpecParams(types=("draft-mtp",), n_max=k) for k in (1, 2, 3)])
    assert c.spec.types == () and c.predicted_speedup == 1.0
    assert c.reason.startswith("none: no speculative setting is predicted faster than ×1.10; the best, "
                               "draft-mtp n-max 3, is ×0.90")


# (T1 ms, verify ms by rows, acceptance per position, draft ms per token, f, margin) -> expected choice
CASES = [
    # flat verify cost (trunk-bound), cheap exact head: the longest draft wins
    pytest.param(10.0, {1: 10, 2: 10.5, 4: 11, 8: 12, 16: 14}, [1.0] * 8, 0.5, 1.0, 0.1, ("draft-mtp", 8), id="flat"),
    # verify linear in rows (lm_head-bound, MTP_NOTES §5): nothing pays even at 100 %
    pytest.param(10.0, {1: 10, 2: 20, 4: 40, 8: 80, 16: 160}, [1.0] * 8, 0.5, 1.0, 0.1, None, id="linear"),
    # acceptance that falls off with position: a short draft is best
    pytest.param(10.0, {1: 10, 2: 11, 4: 16, 8: 30, 16: 60}, [0.9, 0.8, 0.2, 0.05, 0, 0, 0, 0], 1.0, 1.0, 0.1,
                 ("draft-mtp", 2), id="falloff"),
    # a 7 % gain is inside the margin; with no margin it is taken
    pytest.param(10.0, {1: 10, 2: 14, 4: 24, 8: 38, 16: 70}, [0.6] + [0.0] * 7, 1.0, 1.0, 0.1, None, id="margin"),
    pytest.param(10.0, {1: 10, 2: 14, 4: 24, 8: 38, 16: 70}, [0.6] + [0.0] * 7, 1.0, 1.0, 0.0, ("draft-mtp", 1),
                 id="no-margin"),
]


@pytest.mark.parametrize("t1, curve, acc, t_tok, f, margin, expected", CASES)
def test_choose_from_injected_costs(t1, curve, acc, t_tok, f, margin, expected):
    v = verify_curve(curve)
    cands = [SpecParams(types=("draft-mtp",), n_max=k) for k in (1, 2, 3, 4, 6, 8)]
    tv = {k: t1 + v.at(k + 1) / MS - v.at(1) / MS for k in (1, 8)}
    probes = mtp_like(8, acc, tv[1] + t_tok, tv[8] + 8 * t_tok, t_tok, f=f)
    dc = fit_drafter(SpecParams(types=("draft-mtp",), n_max=8), probes, v, t1 * MS)
    assert dc.c0_s == pytest.approx(0.0, abs=1e-9) and dc.c1_s == pytest.approx(t_tok * MS)
    c = choose(Costs(v, t1 * MS, (dc,)), cands, margin)
    got = (c.spec.types[0], c.spec.n_max) if c.spec.types else None
    assert got == expected, c.reason
    assert [p.speedup for p in c.table] == sorted((p.speedup for p in c.table), reverse=True)
    if expected:
        assert c.reason.startswith(f"draft-mtp n-max {expected[1]}: predicted ×")
    else:
        assert c.reason.startswith("none: ")


def test_verify_cost_reads_non_decreasing_and_bench_shows_what_was_measured(smollm_path):
    """A pass of more rows can cost less (rows in blocks): the curve at() reads is made non-decreasing,
    the bench table and JSON show the medians as measured (a lifted median above its own max read as
    a bug). Live: the medians of 1, 4, 9 and 12 rows on SmolLM2."""
    with engine_for(smollm_path, ()) as engine:
        v = measure_verify_cost(engine, engine.tokenize("one two three four " * 10), rows=(1, 4, 9, 12), reps=1)
    assert all(a <= b for a, b in zip(v.s, v.s[1:], strict=False)) and v.measured == v.s_median
    assert all(lo <= m <= hi for m, lo, hi in zip(v.measured, v.s_min, v.s_max, strict=True))
    dip = VerifyCost((1, 9, 12), (0.010, 0.030, 0.030), (0.009, 0.029, 0.027), (0.011, 0.031, 0.029), 0,
                     (0.010, 0.030, 0.028))
    assert [d["ms"] for d in verify_dicts(dip)] == [10.0, 30.0, 28.0] and dip.at(12) == 0.030
    assert verify_dicts(VerifyCost((1, 2), (0.01, 0.02), (0.01, 0.02), (0.01, 0.02)))[1]["x_single"] == 2.0


def test_fit_reproduces_both_probes_and_ngram_without_matches_is_never_chosen():
    v = verify_curve({1: 10, 2: 12, 4: 14, 8: 18, 16: 26, 17: 27})
    t1 = 10.0
    # MTP probes with extra per-pass (1 ms) and per-token (0.2 ms) bookkeeping beyond the draft step
    tv = lambda k: t1 + v.at(k + 1) / MS - v.at(1) / MS  # noqa: E731
    probes = mtp_like(6, [0.8] * 6, tv(1) + 1 + 1.2, tv(6) + 1 + 6 * 1.2, 1.0)
    dc = fit_drafter(SpecParams(types=("draft-mtp",), n_max=6), probes, v, t1 * MS)
    assert dc.c0_s == pytest.approx(1 * MS) and dc.c1_s == pytest.approx(1.2 * MS)
    costs = Costs(v, t1 * MS, (dc,))
    for p in probes:
        pred = predict(costs, SpecParams(types=("draft-mtp",), n_max=p.n_max))
        assert pred.t_pass_s == pytest.approx(p.t_pass_s)
    # n-grams that found no match on free text: one pass per token plus the lookup
    ng = mtp_like(16, [], 10.3, 10.3, 0.0, spec_type="ngram-simple", f=0.0)
    dn = fit_drafter(SpecParams(types=("ngram-simple",), n_max=16), ng, v, t1 * MS)
    assert dn.c0_s == pytest.approx(0.3 * MS)
    pn = predict(Costs(v, t1 * MS, (dn,)), SpecParams(types=("ngram-simple",), n_max=16))
    assert pn.tokens_per_pass == 1.0 and pn.speedup < 1.0
    # n-grams that draft on half the passes with high acceptance (a copy): chosen
    cp = mtp_like(16, [0.95] * 16, 0, 10.3 + 0.5 * (v.at(17) - v.at(1)) / MS, 0.0, f=0.5)
    n3m16 = SpecParams(types=("ngram-simple",), ngram_size_n=3, ngram_size_m=16)
    dcp = fit_drafter(n3m16, cp[-1:], v, t1 * MS)
    c = choose(Costs(v, t1 * MS, (dcp,)), [n3m16])
    assert c.spec == n3m16 and c.predicted_speedup > 3
    assert c.reason.startswith("ngram-simple size-n 3 size-m 16: predicted ×")


def test_verify_cost_interpolates_and_extrapolates():
    v = verify_curve({1: 10, 2: 20, 4: 24, 8: 40})
    assert v.at(1) == pytest.approx(10 * MS) and v.at(3) == pytest.approx(22 * MS)
    assert v.at(6) == pytest.approx(32 * MS) and v.at(10) == pytest.approx(48 * MS)


# ---- auto, end to end ------------------------------------------------------------------------

FREE = "Once upon a time, in a small village at the edge of a great forest, there lived"


def injected_timings(t1_ms: float, verify_ms: dict[int, float], tok_ms: float):
    """A calibrate measure() that runs the live probes (their acceptance is deterministic: greedy)
    and replaces every timing with the injected ones, so the choice cannot depend on the machine."""
    v = verify_curve(verify_ms)

    def fake(engine, prompt, candidates, **opts):
        live = measure(engine, prompt, candidates, **{**opts, "reps": 1, "verify_reps": 1})
        drafters = []
        for dc in live.drafters:
            per_token = dc.spec.types[0] != "ngram-simple"
            probes = [replace(p, t_tok_s=tok_ms * MS if per_token else 0.0,
                              t_pass_s=p.f * (t1_ms * MS + v.at(p.mean_len + 1) - v.at(1)) + (1 - p.f) * t1_ms * MS
                              + (p.f * p.mean_len * tok_ms * MS if per_token else 0.0)) for p in dc.probes]
            drafters.append(fit_drafter(dc.spec, probes, v, t1_ms * MS))
        return Costs(v, t1_ms * MS, tuple(drafters))

    return fake


@pytest.mark.slow
def test_auto_keeps_adaptive_ngrams_when_no_setting_is_predicted_faster(tiny_mtp, capsys):
    """The tiny shape's costs: the MTP head costs as much as the trunk, a verify row as much as a
    plain step; free text has no repeated n-grams. The head is exact, so only the costs say no to
    it; n-grams stay on, adaptive (held back on text they do not predict), since the request's
    text is not the calibration's."""
    with engine_for(tiny_mtp) as engine:
        assert engine.mtp_enabled
        spec = resolve_auto(engine, SpecParams(), engine.tokenize(FREE),
                            measure=injected_timings(2.0, {1: 2, 2: 4, 4: 8, 8: 16, 16: 32, 17: 34}, 2.0))
    assert (spec.types, spec.ngram_size_n, spec.ngram_size_m, spec.adaptive) == (("ngram-simple",), 2, 16, True)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(r"spec auto: ngram-simple size-n 2 size-m 16 longest match, adaptive \(drafts only where a draft "
                    r"is predicted to pay on the text at hand\): no setting was predicted more than 10% faster than "
                    r"none on this prompt; the best, (draft-mtp n-max 1, ×0\.67 \(acceptance 1\.00|\S+ .*×1\.00 \()",
                    line), line
    assert "calibration: none" not in line


@pytest.mark.slow
def test_auto_chooses_draft_mtp_when_it_is_clearly_faster(tiny_mtp, capsys):
    """A realistic shape's costs, injected: a nearly flat verify curve and a head at 1/25 of a plain
    step; the exact head is accepted every time (its live probes say so), so the longest draft wins.
    The choice reads only the injected timings and the probes' acceptance, so the tiny model serves."""
    with engine_for(tiny_mtp) as engine:
        spec = resolve_auto(engine, SpecParams(adaptive=True), engine.tokenize(FREE),
                            measure=injected_timings(10.0, {1: 10, 2: 10.5, 4: 11, 8: 12, 16: 14, 17: 14.2}, 0.4))
    assert spec.types == ("draft-mtp",) and spec.n_max == 8 and spec.adaptive
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(r"spec auto: draft-mtp n-max 8: predicted ×[4-9]\.\d\d over none \(acceptance 1\.00, "
                    r"9\.00 tokens/pass, ", line), line


@pytest.mark.slow
def test_ngram_probes_do_not_draft_from_their_own_last_probe(smollm_path):
    """ngram-mod's pool outlives a generation (as llama.cpp's), so the engine's own drafter would
    draft a repeated probe from the probe before it; each probe gets a fresh one instead."""
    spec = SpecParams(types=("ngram-mod",), ngram_mod=NgramModParams(n_match=4, n_min=4, n_max=16))
    with engine_for(smollm_path, ("ngram-mod",)) as engine:
        prompt = engine.tokenize(FREE)
        fresh = [probe_once(engine, prompt, 32, spec)[1] for _ in range(2)]
        assert (fresh[0].n_gen_tokens, fresh[0].n_acc_tokens) == (fresh[1].n_gen_tokens, fresh[1].n_acc_tokens)
        shared = []
        for _ in range(2):                  # what the fresh drafters keep out of the calibration
            with engine.generate(prompt, 40, SamplingParams(temp=0.0), spec=spec) as gen:
                list(gen)
            shared.append(gen.stats.drafters[0])
        assert shared[1].n_acc_tokens > shared[0].n_acc_tokens == fresh[0].n_acc_tokens


@pytest.mark.parametrize("winner", ["ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"])
@pytest.mark.parametrize("builtin", [True, False])
def test_auto_tries_every_ngram_type_and_runs_the_winner(smollm_path, capsys, winner, builtin):
    """Every n-gram type of llama.cpp is a candidate. The winner runs as it was calibrated on the
    request's own prompt. On the built-in prompt of chat and serve, ngram-simple (n2 m16) and suffix
    go adaptive instead, each step drafting from the one that pays more; ngram-mod keeps its own
    lengths (its n-min rule keeps it silent on text it does not predict)."""
    from specrun.cli.runtime.auto import AUTO_NGRAM_TYPES, auto_candidates

    assert AUTO_NGRAM_TYPES == ("ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix")
    with engine_for(smollm_path, ("ngram-simple",)) as engine:
        cands = auto_candidates(engine, SpecParams())
        assert [c.types[0] for c in cands if c.types[0].startswith("ngram") or c.types[0] == "suffix"] == [
            "ngram-simple", "ngram-simple", *AUTO_NGRAM_TYPES]
        # ngram-simple's candidates copy from the longest-matching occurrence, unless the command says last
        assert {c.ngram_match for c in cands if c.types == ("ngram-simple",)} == {"longest"}
        assert {c.ngram_match for c in auto_candidates(engine, SpecParams(ngram_match="last"))
                if c.types == ("ngram-simple",)} == {"last"}

        def wins(engine, prompt, candidates, **_):   # the winner accepted whole, the others silent
            v = VerifyCost((1, 65), (0.01, 0.02), (0.01, 0.02), (0.01, 0.02))
            out = []
            for c in {replace(c, n_max=0): c for c in candidates}.values():
                out.append(DrafterCost(c, (ProbeRun(c.n_max, 10, 200, 10, 600, 600, (1.0,) * 64, 0.02, 0.0)
                                           if c.types == (winner,) else ProbeRun(c.n_max, 32, 32, 0, 0, 0, (), 0.01, 0.0),),
                                       0.0, 0.0))
            return Costs(v, 0.01, tuple(out))

        prompt = None if builtin else engine.tokenize(FREE)
        spec = resolve_auto(engine, SpecParams(), prompt, measure=wins)
    said = capsys.readouterr().err.strip().splitlines()[-1]
    if builtin and winner != "ngram-mod":      # beside suffix, which drafts from earlier requests
        assert spec.types == ("ngram-simple", "suffix") and (spec.ngram_size_n, spec.ngram_size_m) == (2, 16)
        assert spec.suffix == SpecParams().suffix    # with the global tree (probed without it)
        assert spec.adaptive and said.startswith("spec auto: ngram-simple size-n 2 size-m 16 longest match + suffix max-depth")
    else:
        assert spec.types == (winner,) and not spec.adaptive
        assert said.startswith(f"spec auto: {winner}")


def test_auto_seeds_the_adaptive_pass_costs_from_its_calibration(smollm_path, capsys):
    """auto's verify-cost curve (median of 5 rounds) becomes the engine's pass costs, made
    non-decreasing; the first adaptive generation then times no passes of its own, and its text is
    plain's."""
    with engine_for(smollm_path, ("ngram-simple",)) as engine:
        rows, ms = (1, 2, 4, 8, 16, 17), (10.0, 14.0, 13.0, 31.0, 55.0, 61.0)   # 4 rows read below 2: noise

        def curve(engine, prompt, candidates, **_):
            v = VerifyCost(rows, tuple(m * MS for m in ms), tuple(m * MS for m in ms), tuple(m * MS for m in ms))
            return Costs(v, 0.01, tuple(DrafterCost(c, (ProbeRun(c.n_max, 32, 32, 0, 0, 0, (), 0.01, 0.0),), 0.0, 0.0)
                                        for c in {replace(c, n_max=0): c for c in candidates}.values()))

        spec = resolve_auto(engine, SpecParams(), None, measure=curve)
        assert spec.adaptive and set(engine.pass_cost.sums) == set(rows)
        assert [round(engine.pass_cost.at(r) / MS, 6) for r in rows] == [10.0, 14.0, 14.0, 31.0, 55.0, 61.0]

        def no_probe(*a, **k):
            raise AssertionError("the seeded engine timed passes again")

        prompt = engine.tokenize("def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
        plain = [t for c in engine.generate(prompt, 24, SamplingParams(temp=0.0)) for t in c]
        engine._measure_pass_cost = no_probe
        got = [t for c in engine.generate(prompt, 24, SamplingParams(temp=0.0), spec=spec) for t in c]
        assert got == plain


# ---- auto's cache of the machine's costs ------------------------------------------------------------


def _fake_costs(candidates, t1=0.01):
    v = VerifyCost((1, 2), (t1, 2 * t1), (t1, 2 * t1), (t1, 2 * t1))
    groups = {replace(c, n_max=0): c for c in candidates if c.types}.values()
    return Costs(v, t1, tuple(DrafterCost(c, (ProbeRun(c.n_max, 10, 20, 10, 20, 10, (0.5, 0.5), 0.02, 0.0),), 0.001, 0.002)
                              for c in groups))


def _once():
    """A measure() that may run once; a second call fails the test."""
    calls = []

    def measure_once(engine, prompt, candidates, **_):
        assert not calls, "measured again"
        calls.append(1)
        return _fake_costs(candidates)

    return measure_once, calls


def _acceptance(engine, prompt, groups, n_probe, on_step):
    return [ProbeRun(g.n_max, 16, 32, 8, 16, 12, (0.9, 0.6), 0.0, 0.0) for g in groups]


CANDS = [SpecParams(types=("ngram-simple",)), SpecParams(types=("draft-mtp",), n_max=1),
         SpecParams(types=("draft-mtp",), n_max=4)]
KEY = {"model": "/m.gguf:100:1", "cpu": "Xeon", "cores": "2", "threads": "2"}


def test_auto_cache_measures_once_per_key(tmp_path):
    """The first call measures and writes one JSON file; the second times nothing: the machine's
    costs come back from the file and the acceptance from its own probes (the prompt's). A changed
    key, other probe settings, or refresh measure again."""
    m, calls = _once()
    first = CachedMeasure(tmp_path, KEY, measure=m, acceptance=_acceptance)
    costs = first(None, [1, 2, 3], CANDS)
    assert not first.hit and calls == [1] and [p.name for p in tmp_path.iterdir()] == [first.path.name]
    second = CachedMeasure(tmp_path, KEY, measure=m, acceptance=_acceptance)
    assert second.steps(CANDS) == 2       # one acceptance probe per drafter
    again = second(None, [4, 5, 6], CANDS)
    assert second.hit and second.path == first.path
    assert (again.verify, again.t1_s) == (costs.verify, costs.t1_s)
    assert [(d.spec, d.c0_s, d.c1_s) for d in again.drafters] == [(d.spec, d.c0_s, d.c1_s) for d in costs.drafters]
    assert [d.long.acc_per_pos for d in again.drafters] == [(0.9, 0.6)] * 2     # this prompt's, not the cached run's
    for other in (CachedMeasure(tmp_path, {**KEY, "threads": "1"}, measure=m, acceptance=_acceptance),
                  CachedMeasure(tmp_path, {**KEY, "model": "/m.gguf:100:2"}, measure=m, acceptance=_acceptance),
                  CachedMeasure(tmp_path, KEY, refresh=True, measure=m, acceptance=_acceptance)):
        calls.clear()
        other(None, [1, 2, 3], CANDS)
        assert not other.hit and calls == [1]
    calls.clear()
    more = CachedMeasure(tmp_path, KEY, measure=m, acceptance=_acceptance)
    more(None, [1, 2, 3], [*CANDS, SpecParams(types=("draft-mtp",), n_max=8)])    # another probe of draft-mtp
    assert not more.hit and calls == [1]
    tmp_path.joinpath(first.path.name).write_text("{not json")                  # a broken file: measured again
    calls.clear()
    broken = CachedMeasure(tmp_path, KEY, measure=m, acceptance=_acceptance)
    broken(None, [1, 2, 3], CANDS)
    assert not broken.hit and calls == [1] and json.loads(first.path.read_text())["entry"]["key"] == KEY


def test_auto_refresh_option_reaches_run_and_serve():
    """--spec-auto-refresh is a field of the checked options, for run and serve alike (no module default)."""
    from specrun.cli.runtime.options import run_options
    from specrun.cli.serve_cmd import serve_options

    for args, want in ((["-m", "x.gguf", "-p", "hi", "--spec-auto-refresh"], True), (["-m", "x.gguf", "-p", "hi"], False)):
        ctx = cli.commands["run"].make_context("run", args)
        assert run_options(ctx.params, prompt="hi").auto_refresh is want
    serve = cli.commands["serve"]
    for args, want in ((["-m", "x.gguf", "--spec-auto-refresh"], True), (["-m", "x.gguf"], False)):
        assert serve_options(**serve.make_context("serve", args).params).auto_refresh is want


def test_auto_uses_its_cache_on_the_next_run(smollm_path, tmp_path, capsys):
    """resolve_auto on a second run skips the timings and says so, with how to refresh; refresh
    measures again. The choice reads this prompt's acceptance either way."""
    m, calls = _once()
    with engine_for(smollm_path, ("ngram-simple",)) as engine:
        prompt = engine.tokenize(FREE)
        first = resolve_auto(engine, SpecParams(), prompt, measure=m, cache=tmp_path)
        said = capsys.readouterr().err.strip().splitlines()[-1]
        assert calls == [1] and "cache" not in said
        second = resolve_auto(engine, SpecParams(), prompt, measure=m, cache=tmp_path)
        said = capsys.readouterr().err.strip().splitlines()[-1]
        assert second.types == first.types
        assert said.endswith("; --spec-auto-refresh measures again]") and "machine costs from the cache (" in said
        calls.clear()
        resolve_auto(engine, SpecParams(), prompt, measure=m, cache=tmp_path, refresh=True)
        assert calls == [1] and "cache" not in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.full
def test_auto_calibration_probes_every_ngram_type(smollm_path):
    """The live calibration probes each n-gram type on the prompt and predicts it from its own
    probe: on a prompt that repeats itself, the short ngram-simple keys and ngram-cache draft."""
    from specrun.cli.runtime.auto import auto_candidates

    with engine_for(smollm_path, ("ngram-simple",)) as engine:
        prompt = engine.tokenize(" ".join(f"item {i}: the ledger lists its stock and moves." for i in range(16)))
        choice = calibrate(engine, prompt, auto_candidates(engine, SpecParams()), n_probe=24, reps=1, verify_reps=1)
    got = {setting_name(p.spec): round(p.tokens_per_pass, 2) for p in choice.table}
    assert sorted(got) == ["ngram-cache", "ngram-map-k size-n 12 size-m 48", "ngram-map-k4v size-n 12 size-m 48",
                           "ngram-mod n-match 24 n-min 48 n-max 64", "ngram-simple size-n 12 size-m 48 longest match",
                           "ngram-simple size-n 2 size-m 16 longest match",
                           "suffix max-depth 24 max-spec-factor 1 min-token-prob 0.1"], got
    assert got["ngram-cache"] > 1 and got["ngram-simple size-n 2 size-m 16 longest match"] > 1, got


def test_setting_name_names_each_type_of_a_list_with_its_own_flags():
    spec = SpecParams(types=("ngram-simple", "suffix", "draft-mtp"), ngram_size_n=2, ngram_size_m=16, n_max=3)
    assert setting_name(spec) == ("ngram-simple size-n 2 size-m 16 + suffix max-depth 24 max-spec-factor 1 "
                                  "min-token-prob 0.1 + draft-mtp n-max 3")
    assert setting_name(replace(spec, types=())) == "none"


def test_available_types(tiny_mtp, smollm_path):
    ngrams = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix")   # need no file
    assert available_types(tiny_mtp, None) == (*ngrams, "draft-mtp")
    assert available_types(smollm_path, None) == ngrams
    assert available_types(smollm_path, smollm_path) == (*ngrams, "draft-simple")

"""benchmarks/peers.py (specrun serve vs llama-server): the table's medians, ratios and `= none`
column from fake timings, the spec table (acceptance, tokens per pass, a failed server, the EAGLE-3
goals) from a small fixed JSON, the docs page's block replacement, and that every workload's prompt file
is there. Nothing here starts a server or asserts a measured time."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
peers = importlib.util.module_from_spec(_spec)
sys.modules["peers"] = peers                      # dataclasses look their module up there
_spec.loader.exec_module(peers)


def req(system, setting, rep, gen, prompt, text="same", workload="code-rewrite", n=40, model="gemma-3-270m",
        drafted=None, accepted=None):
    return {"model": model, "workload": workload, "setting": setting, "system": system, "rep": rep,
            "gen_tps": gen, "prompt_tps": prompt, "prompt_n": n, "predicted_n": 128, "tokens_evaluated": n,
            "text": text, "spec": None, "draft_n": drafted, "draft_n_accepted": accepted}


def fake_run() -> dict:
    rs = []
    for rep, (a, b) in enumerate([(60, 100), (64, 90), (62, 110)]):        # medians: 62 and 100
        rs.append(req("specrun", "none", rep, a, 500))
        rs.append(req("llama-server", "none", rep, b, 1000 + rep))
    for rep, (a, b) in enumerate([(120, 150), (130, 160), (124, 140)]):    # medians: 124 and 150
        rs.append(req("specrun", "ngram-simple", rep, a, 400))
        rs.append(req("llama-server", "ngram-simple", rep, b, 800, text="same" if rep else "other"))
    for rep in range(3):
        rs.append(req("specrun", "auto", rep, 93, 500))
    servers = [{"model": "gemma-3-270m", "setting": "auto", "system": "specrun", "load_avg_1m": 0.5,
                "auto": "spec auto: ngram-simple size-n 3 size-m 16: predicted ×1.50 over none (...)"},
               {"model": "gemma-3-270m", "setting": "none", "system": "specrun", "load_avg_1m": 1.3, "auto": None}]
    meta = {"date": "2026-01-02", "commit": "abc1234", "dirty": [], "cpu": "CPU", "cores": 2,
            "llama_server_version": "version: 1 (deadbee)", "threads": 2, "ctx": 4096, "n_predict": 128, "reps": 3,
            "workloads": {"code-rewrite": {"model": "gemma-3-270m", "file": "benchmarks/prompts/code_rewrite.txt",
                                           "what": "rewrite"}}}
    return {"meta": meta, "servers": servers, "requests": rs}


def test_summary_medians_ratios_and_equality():
    rows = {(r["setting"], r["system"]): r for r in peers.summarize(fake_run()["requests"])}
    assert rows[("none", "specrun")]["gen_tps"] == 62 and rows[("none", "llama-server")]["gen_tps"] == 100
    assert rows[("ngram-simple", "specrun")]["x_none"] == pytest.approx(124 / 62)
    assert rows[("ngram-simple", "llama-server")]["x_none"] == pytest.approx(1.5)
    assert rows[("none", "llama-server")]["prompt_tps"] == 1001
    assert rows[("ngram-simple", "specrun")]["equal_none"] is True
    assert rows[("ngram-simple", "llama-server")]["equal_none"] is False      # one rep of three differs
    assert rows[("auto", "specrun")]["x_none"] == pytest.approx(1.5)


def test_markdown_rows():
    md = peers.markdown(fake_run())
    lines = {ln.split(" | ")[1]: ln for ln in md.splitlines() if ln.startswith("| code-rewrite |")}
    cells = lambda s: [c.strip() for c in lines[s].strip("|").split("|")]          # noqa: E731
    assert cells("none") == ["code-rewrite", "none", "62.0 (60–64)", "1.00", "yes", "100.0 (90–110)", "1.00", "yes", "0.62",
                             "500", "1001", "0.50"]
    assert cells("ngram-simple") == ["code-rewrite", "ngram-simple", "124.0 (120–130)", "2.00", "yes", "150.0 (140–160)", "1.50",
                                     "**no**", "0.83†", "400", "800", "0.50"]   # llama-server's text: "other"
    auto = cells("auto → ngram-simple size-n 3 size-m 16 (llama-server: its best, ngram-simple)")
    assert auto[2:] == ["93.0 (93–93)", "1.50", "yes", "150.0 (140–160)", "1.50", "**no**", "0.62†", "500", "800", "0.62"]
    assert "`auto` ≥ llama-server's best of {none, ngram-simple, ngram-simple n3 m16}: 0 of 1 workloads " \
           "(not on: code-rewrite); the two texts differ on 1 of the 1 (†); `auto`'s text = `none`'s: 1 of 1." in md
    assert "†: the two servers wrote different texts" in md
    assert "commit `abc1234`" in md and "40 prompt tokens" in md and "after one warm-up" in md
    assert "identical between specrun and llama-server: 1 of 1 workloads." in md


def test_auto_runs_beside_llama_servers_best_and_is_judged_against_that_block():
    """auto's verdict comes from its own block (llama-server's best measured beside it), not from
    llama-server's row of an earlier block: there ngram-simple read 150 tok/s, beside auto 90."""
    run = fake_run()
    other = peers.Workload("other", "gemma-3-270m", "free.txt", "free")
    others = [req("llama-server", "none", rep, 70, 900, workload="other") for rep in range(3)]
    groups = peers.auto_partners(run["requests"] + others, [peers.WORKLOADS[1], other])
    assert {k: [w.name for w in ws] for k, ws in groups.items()} == {"ngram-simple": ["code-rewrite"], "none": ["other"]}
    run["requests"] += [{**req("llama-server", "auto", rep, 90, 800), "partner": "ngram-simple"} for rep in range(3)]
    md = peers.markdown(run)
    line = next(ln for ln in md.splitlines() if ln.startswith("| code-rewrite | auto"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "auto → ngram-simple size-n 3 size-m 16 (llama-server beside it: its best, ngram-simple)"
    assert cells[5] == "90.0 (90–90)" and cells[8] == "1.03"
    assert "`auto` ≥ llama-server's best of {none, ngram-simple, ngram-simple n3 m16}: 1 of 1 workloads;" in md


def test_docs_block_is_replaced_and_required():
    text = f"# t\n\nbefore\n{peers.BEGIN}\nold table\n{peers.END}\nafter\n"
    new = peers.replace_block(text, "| new |\n")
    assert new == f"# t\n\nbefore\n{peers.BEGIN}\n| new |\n{peers.END}\nafter\n"
    assert peers.replace_block(new, "| new |\n") == new
    with pytest.raises(SystemExit):
        peers.replace_block("no markers", "x")


def test_docs_have_the_markers_once():
    text = peers.DOCS.read_text(encoding="utf-8")
    assert text.count(peers.BEGIN) == 1 and text.count(peers.END) == 1


def test_workloads_have_prompt_files_and_enough_variety():
    assert len(peers.WORKLOADS) >= 6
    for w in peers.WORKLOADS:
        assert (peers.PROMPTS / w.file).read_text(encoding="utf-8").strip(), w.file


def test_other_work_share_leaves_out_the_server():
    # all CPUs: 100 ticks, 70 busy, of which the server's own 30: other work took 40 %
    assert peers.others_share(((100, 50), (0, 10)), ((200, 120), (0, 40))) == pytest.approx(0.4)
    assert peers.others_share(((100, 50), (0, 10)), ((200, 60), (0, 25))) == 0.0      # never below 0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_servers_ticks_include_its_children():
    """specrun serve evaluates long prompts in a child process (kernels/prefill_worker.py): its CPU
    time is the server's, not other work, while it runs and once it has been waited for."""
    import os
    import subprocess
    me = os.getpid()
    before = peers.cpu_ticks(me)[1]
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.5: pass\nprint(1, flush=True)\ninput()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "1\n"               # it has burned 0.5 s of CPU and waits
        assert child.pid in peers.process_tree(me)
        running = peers.cpu_ticks(me)[1] - before
    finally:
        child.communicate("")
    assert running >= 0.3 * os.sysconf("SC_CLK_TCK")
    assert peers.cpu_ticks(me)[1] - before >= running           # waited for: in our cutime


def test_eagle3_settings_run_on_the_synthetic_pair_only():
    e3 = [s for s in peers.SETTINGS if s.name.startswith("draft-eagle3")]
    assert e3 and all(s.applies(peers.EAGLE3_MODEL) and not s.applies("gemma-3-270m") for s in e3)
    none, ngram = (next(s for s in peers.SETTINGS if s.name == n) for n in ("none", "ngram-simple"))
    assert none.applies(peers.EAGLE3_MODEL) and none.applies("gemma-3-270m")
    assert ngram.applies("gemma-3-270m") and not ngram.applies(peers.EAGLE3_MODEL)
    assert all(ngram.applies(m) for m in peers.MTP_MODELS)      # the hybrid model's n-gram rows
    assert not any(s.applies(m) for m in peers.MTP_MODELS for s in peers.SETTINGS if s.name.startswith("ngram-map"))
    assert any(w.model == peers.EAGLE3_MODEL for w in peers.WORKLOADS)


# ---- the spec table (issue 15, item 4) -------------------------------------------------------------

E3 = "draft-eagle3 n-max {}".format


def spec_run() -> dict:
    """Two workloads: ngram-map-k on code-rewrite (llama-server refused ngram-cache), draft-eagle3 on the
    synthetic pair; llama-server omits draft_n when it drafted nothing (None here)."""
    rs = []
    for rep in range(2):
        rs += [req("specrun", "none", rep, 50, 500, drafted=0, accepted=0),
               req("llama-server", "none", rep, 40, 600),
               req("specrun", "ngram-map-k", rep, 75, 500, drafted=100, accepted=64),     # 256 / 128: 2.00
               req("llama-server", "ngram-map-k", rep, 60, 600, drafted=80, accepted=32,
                   text="same" if rep else "other"),                                       # 256 / 192: 1.33
               req("specrun", "ngram-cache", rep, 49, 500, drafted=0, accepted=0)]
        for sy, none, tps in (("specrun", 60, (150, 170, 160)), ("llama-server", 50, (140, 130, 180))):
            rs.append(req(sy, "none", rep, none, 300, workload="eagle3-free", model=peers.EAGLE3_MODEL))
            for k, t, n in zip((3, 5, 7), tps, (96, 100, 112), strict=True):       # every draft accepted
                rs.append(req(sy, E3(k), rep, t, 300, workload="eagle3-free", model=peers.EAGLE3_MODEL,
                              drafted=n, accepted=n))
    servers = [{"model": "gemma-3-270m", "setting": s, "system": sy, "auto": None, "error": None}
               for s in ("none", "ngram-map-k") for sy in peers.SYSTEMS]
    servers += [{"model": "gemma-3-270m", "setting": "ngram-cache", "system": "specrun", "auto": None, "error": None},
                {"model": "gemma-3-270m", "setting": "ngram-cache", "system": "llama-server", "auto": None,
                 "error": "exited with 1 while starting: error: unknown value for --spec-type: ngram-cache"}]
    servers += [{"model": peers.EAGLE3_MODEL, "setting": s, "system": sy, "auto": None, "error": None}
                for s in ("none", E3(3), E3(5), E3(7)) for sy in peers.SYSTEMS]
    meta = {"date": "2026-01-03", "commit": "abc1234", "dirty": [], "cpu": "CPU", "cores": 2,
            "llama_server_version": "version: 1 (deadbee)", "threads": 2, "ctx": 4096, "n_predict": 128, "reps": 2,
            "max_busy": 0.25,
            "workloads": {"code-rewrite": {"model": "gemma-3-270m", "file": "benchmarks/prompts/code_rewrite.txt",
                                           "what": "rewrite"},
                          "eagle3-free": {"model": peers.EAGLE3_MODEL, "file": "benchmarks/prompts/free.txt",
                                          "what": "free text"}}}
    return {"meta": meta, "servers": servers, "requests": rs}


@pytest.mark.parametrize("setting, system, acceptance, tokens_per_pass, drafted", [
    ("none", "specrun", None, 1.0, 0),
    ("none", "llama-server", None, 1.0, 0),                  # draft_n absent: nothing drafted
    ("ngram-map-k", "specrun", 0.64, 2.0, 200),
    ("ngram-map-k", "llama-server", 0.4, 256 / 192, 160),
    ("ngram-cache", "specrun", None, 1.0, 0),
])
def test_summary_acceptance_and_tokens_per_pass(setting, system, acceptance, tokens_per_pass, drafted):
    rows = {(r["setting"], r["system"]): r for r in peers.summarize(spec_run()["requests"])
            if r["workload"] == "code-rewrite"}
    r = rows[(setting, system)]
    assert r["drafted"] == drafted
    assert r["acceptance"] == (None if acceptance is None else pytest.approx(acceptance))
    assert r["tokens_per_pass"] == pytest.approx(tokens_per_pass)


def spec_cells(md: str, workload: str) -> dict[str, list[str]]:
    return {cells[1]: cells for cells in ([c.strip() for c in ln.strip("|").split("|")] for ln in md.splitlines()
                                          if ln.startswith(f"| {workload} |"))}


@pytest.mark.parametrize("workload, setting, cells", [
    ("code-rewrite", "none", ["50.0", "1.00", "—", "1.00", "yes", "40.0", "1.00", "—", "1.00", "yes", "1.25"]),
    ("code-rewrite", "ngram-map-k", ["75.0", "1.50", "0.64 (128 / 200)", "2.00", "yes",
                                     "60.0", "1.50", "0.40 (64 / 160)", "1.33", "**no**", "1.25"]),
    ("code-rewrite", "ngram-cache", ["49.0", "0.98", "—", "1.00", "yes",
                                     "failed: exited with 1 while starting: error: unknown value for --spec-type: "
                                     "ngram-cache", "—", "—", "—", "—", "—"]),
    ("eagle3-free", "none", ["60.0", "1.00", "—", "1.00", "yes", "50.0", "1.00", "—", "1.00", "yes", "1.20"]),
    ("eagle3-free", E3(5), ["170.0", "2.83", "1.00 (200 / 200)", "4.57", "yes",
                            "130.0", "2.60", "1.00 (200 / 200)", "4.57", "yes", "1.31"]),
    ("eagle3-free", E3(7), ["160.0", "2.67", "1.00 (224 / 224)", "8.00", "yes",
                            "180.0", "3.60", "1.00 (224 / 224)", "8.00", "yes", "0.89"]),
])
def test_spec_markdown_rows(workload, setting, cells):
    assert spec_cells(peers.spec_markdown(spec_run()), workload)[setting][2:] == cells


def test_spec_markdown_only_the_run_settings_and_the_verdicts():
    md = peers.spec_markdown(spec_run())
    assert list(spec_cells(md, "code-rewrite")) == ["none", "ngram-map-k", "ngram-cache"]        # in SETTINGS order
    assert list(spec_cells(md, "eagle3-free")) == ["none", E3(3), E3(5), E3(7)]
    assert "`eagle3-free`: specrun's best EAGLE-3 setting is draft-eagle3 n-max 5, 2.83× its `none` " \
           "(goal ≥ 2.5×: met); specrun ÷ llama-server there: 1.31 (goal ≥ 1.0: met)." in md
    assert "llama-server's output differs from its own `none` on: code-rewrite / ngram-map-k." in md
    assert "| workload | setting | specrun tok/s | × none | acceptance | tokens/pass | = none | llama-server tok/s " \
           "| × none | acceptance | tokens/pass | = none | specrun ÷ llama-server |" in md
    assert "median of 2 requests after one warm-up." in md and "min–max" not in md
    assert "- `eagle3-free` (synthetic:eagle3-realistic, `free.txt`, 40 prompt tokens): free text" in md


def test_spec_verdict_not_met():
    data = spec_run()
    for r in data["requests"]:
        if r["workload"] == "eagle3-free" and r["setting"].startswith("draft-eagle3"):
            r["gen_tps"] = {"specrun": 120, "llama-server": 130}[r["system"]]     # 2.0× and 0.92
    assert "draft-eagle3 n-max 3, 2.00× its `none` (goal ≥ 2.5×: **not met**); specrun ÷ llama-server there: " \
           "0.92 (goal ≥ 1.0: **not met**)." in peers.spec_markdown(data)


def test_main_table_lists_failed_servers():
    md = peers.markdown(spec_run())
    assert "Failed (no numbers): gemma-3-270m / ngram-cache / llama-server: exited with 1 while starting: error: unknown value " \
           "for --spec-type: ngram-cache." in md


def test_each_table_replaces_only_its_own_block():
    text = f"a\n{peers.BEGIN}\npeers rows\n{peers.END}\nb\n{peers.SPEC_BEGIN}\nold\n{peers.SPEC_END}\nc\n"
    t = peers.TABLES["spec"]
    new = peers.replace_block(text, "| spec |\n", t.begin, t.end)
    assert new == f"a\n{peers.BEGIN}\npeers rows\n{peers.END}\nb\n{peers.SPEC_BEGIN}\n| spec |\n{peers.SPEC_END}\nc\n"
    assert peers.TABLES["peers"].out != t.out


def test_docs_have_the_spec_markers_once_after_the_peers_table():
    text = peers.DOCS.read_text(encoding="utf-8")
    assert text.count(peers.SPEC_BEGIN) == 1 and text.count(peers.SPEC_END) == 1
    assert text.index(peers.END) < text.index(peers.SPEC_BEGIN) < text.index(peers.SPEC_END)


def test_table_defaults_name_known_workloads_and_settings():
    names = {s.name for s in peers.SETTINGS}
    for t in peers.TABLES.values():
        assert set(t.settings) <= names and set(t.workloads) <= {w.name for w in peers.WORKLOADS}
    spec = peers.TABLES["spec"]
    assert set(peers.NGRAM_FAMILY) <= set(spec.settings) and {E3(k) for k in (3, 5, 7)} <= set(spec.settings)


@pytest.mark.parametrize("name", peers.NGRAM_FAMILY)
def test_ngram_family_uses_llama_cpp_defaults_on_registry_models_only(name):
    s = next(s for s in peers.SETTINGS if s.name == name)
    assert s.args == ("--spec-type", name) and s.systems == peers.SYSTEMS
    assert s.applies("gemma-3-270m") and not s.applies(peers.EAGLE3_MODEL)


@pytest.mark.parametrize("log, why", [
    ("load\nerror: invalid argument: --spec-type\nusage: ...\n", "error: invalid argument: --spec-type"),
    ("a\nb\n\n", "b"),
    ("", "(empty log)"),
])
def test_last_error_line(tmp_path, log, why):
    (tmp_path / "x.log").write_text(log)
    assert peers.last_error(tmp_path / "x.log") == why


# ---- the mtp table (issue 12, item 2) -----------------------------------------------------------------

def test_mtp_settings_run_on_the_synthetic_qwen35_only_and_make_a_table():
    mtp = [s for s in peers.SETTINGS if s.name.startswith("draft-mtp")]
    assert [s.name for s in mtp] == [f"draft-mtp n-max {k}" for k in (1, 3, 5)]
    for s in mtp:
        assert s.args[:2] == ("--spec-type", "draft-mtp") and s.systems == peers.SYSTEMS
        assert all(s.applies(m) for m in peers.MTP_MODELS) and not s.applies("gemma-3-270m")
        assert not s.applies(peers.EAGLE3_MODEL)
    t = peers.TABLES["mtp"]
    assert {peers.WORKLOADS[[w.name for w in peers.WORKLOADS].index(n)].model for n in t.workloads} == set(peers.MTP_MODELS)
    assert t.out not in {o.out for o in peers.TABLES.values() if o is not t}
    assert len({(o.begin, o.end) for o in peers.TABLES.values()}) == len(peers.TABLES)


def test_mtp_verdict_per_n_max():
    rs = []
    model = next(iter(peers.MTP_MODELS))
    for rep in range(2):
        for sy, none, tps in (("specrun", 100, (110, 170, 210)), ("llama-server", 105, (115, 180, 200))):
            rs.append(req(sy, "none", rep, none, 300, workload="mtp-free", model=model))
            for k, t in zip((1, 3, 5), tps, strict=True):
                rs.append(req(sy, f"draft-mtp n-max {k}", rep, t, 300, workload="mtp-free", model=model,
                              drafted=64, accepted=64))
    md = peers.spec_markdown({"meta": {**spec_run()["meta"], "workloads": {"mtp-free": {
        "model": model, "file": "benchmarks/prompts/free.txt", "what": "free text"}}}, "servers": [], "requests": rs})
    assert "`mtp-free`: specrun ÷ llama-server for draft-mtp (issue 12's goal ≥ 1.0) at n-max 1 0.96 (1.10× / " \
           "1.10× none), n-max 3 0.94 (1.70× / 1.71× none), n-max 5 1.05 (2.10× / 1.90× none): met at 1 of 3." in md
    assert "best EAGLE-3" not in md


def test_docs_have_the_mtp_markers_once():
    text = peers.DOCS.read_text(encoding="utf-8")
    assert text.count(peers.MTP_BEGIN) == 1 and text.count(peers.MTP_END) == 1


def test_docs_have_the_rpc_markers_once():
    spec = importlib.util.spec_from_file_location("rpc_bench", ROOT / "benchmarks" / "rpc_bench.py")
    rpc_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rpc_bench)                  # imports `peers`, loaded above
    text = peers.DOCS.read_text(encoding="utf-8")
    assert text.count(rpc_bench.BEGIN) == 1 and text.count(rpc_bench.END) == 1

"""benchmarks/peers.py (specrun serve vs llama-server): the table's medians, ratios and `= none`
column from fake timings, the README block replacement, and that every workload's prompt file is
there. Nothing here starts a server or asserts a measured time."""

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


def req(system, setting, rep, gen, prompt, text="same", workload="code-rewrite", n=40):
    return {"model": "gemma-3-270m", "workload": workload, "setting": setting, "system": system, "rep": rep,
            "gen_tps": gen, "prompt_tps": prompt, "prompt_n": n, "predicted_n": 128, "tokens_evaluated": n,
            "text": text, "spec": None}


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
                                     "**no**", "0.83", "400", "800", "0.50"]
    auto = cells("auto → ngram-simple size-n 3 size-m 16 (llama-server: its best, ngram-simple)")
    assert auto[2:] == ["93.0 (93–93)", "1.50", "yes", "150.0 (140–160)", "1.50", "**no**", "0.62", "500", "800", "0.62"]
    assert "`auto` ≥ llama-server's best of {none, ngram-simple, ngram-simple n3 m16}: 0 of 1 workloads " \
           "(not on: code-rewrite); `auto`'s text = `none`'s: 1 of 1." in md
    assert "commit `abc1234`" in md and "40 prompt tokens" in md and "after one warm-up" in md
    assert "identical between specrun and llama-server: 1 of 1 workloads." in md


def test_readme_block_is_replaced_and_required():
    text = f"# t\n\nbefore\n{peers.BEGIN}\nold table\n{peers.END}\nafter\n"
    new = peers.replace_block(text, "| new |\n")
    assert new == f"# t\n\nbefore\n{peers.BEGIN}\n| new |\n{peers.END}\nafter\n"
    assert peers.replace_block(new, "| new |\n") == new
    with pytest.raises(SystemExit):
        peers.replace_block("no markers", "x")


def test_readme_has_the_markers_once():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count(peers.BEGIN) == 1 and text.count(peers.END) == 1


def test_workloads_have_prompt_files_and_enough_variety():
    assert len(peers.WORKLOADS) >= 6
    for w in peers.WORKLOADS:
        assert (peers.PROMPTS / w.file).read_text(encoding="utf-8").strip(), w.file


def test_other_work_share_leaves_out_the_server():
    # all CPUs: 100 ticks, 70 busy, of which the server's own 30: other work took 40 %
    assert peers.others_share(((100, 50), (0, 10)), ((200, 120), (0, 40))) == pytest.approx(0.4)
    assert peers.others_share(((100, 50), (0, 10)), ((200, 60), (0, 25))) == 0.0      # never below 0


def test_eagle3_settings_run_on_the_synthetic_pair_only():
    e3 = [s for s in peers.SETTINGS if s.name.startswith("draft-eagle3")]
    assert e3 and all(s.applies(peers.EAGLE3_MODEL) and not s.applies("gemma-3-270m") for s in e3)
    none, ngram = (next(s for s in peers.SETTINGS if s.name == n) for n in ("none", "ngram-simple"))
    assert none.applies(peers.EAGLE3_MODEL) and none.applies("gemma-3-270m")
    assert ngram.applies("gemma-3-270m") and not ngram.applies(peers.EAGLE3_MODEL)
    assert any(w.model == peers.EAGLE3_MODEL for w in peers.WORKLOADS)

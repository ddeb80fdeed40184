"""benchmarks/pass_times.py: the preload library really times llama.cpp's graphs (a real specrun run
under LD_PRELOAD), and its log becomes per-request groups and a table. Nothing here asserts a time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))      # the scripts import each other as the script directory
import pass_times  # noqa: E402

SPECRUN = str(Path(sys.executable).with_name("specrun"))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_shim_times_every_graph_of_a_real_run(tmp_path, smollm_path):
    so = pass_times.build_shim(out=tmp_path / "pass_times.so")
    log = tmp_path / "times.txt"
    env = {**os.environ, "LD_PRELOAD": str(so), "PASS_TIMES": str(log)}
    r = subprocess.run([SPECRUN, "-m", str(smollm_path), "-p", "The capital of France is", "-n", "4", "-no-cnv",
                        "--spec-type", "none", "-t", "2", "--temp", "0"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-800:]
    graphs = pass_times.parse(log.read_text())
    # the prompt (a few rows, in one graph below 512 tokens), then one row per generated token after the first
    assert graphs and graphs[0].rows > 1
    steps = [g for g in graphs[1:] if g.rows == 1]
    assert len(steps) >= 3
    assert all(g.ms > 0 and g.nodes == graphs[0].nodes for g in steps)   # the same model's graph
    assert all(b.start >= a.start + a.ms - 0.01 for a, b in zip(graphs, graphs[1:], strict=False))   # in order


def test_parse_skips_torn_lines():
    text = "10.000 2.500 894 16\n12.600 0.163 44 1\n13.0 0.1 44"   # the last line cut mid-write
    assert pass_times.parse(text) == [pass_times.Graph(10.0, 2.5, 894, 16), pass_times.Graph(12.6, 0.163, 44, 1)]


def test_groups_and_windows():
    G = pass_times.Graph
    graphs = [G(0.0, 50.0, 890, 41), G(60.0, 27.0, 894, 16), G(90.0, 0.2, 44, 1), G(91.0, 0.2, 44, 1),
              G(95.0, 27.0, 894, 16), G(500.0, 5.0, 894, 1)]
    rec = pass_times.request_record(graphs, 0.0, 130.0)
    assert len(rec["graphs"]) == 5 and rec["graph_ms"] == pytest.approx(104.4)
    assert rec["rest_ms"] == pytest.approx(130.0 - 104.4)
    g = pass_times.groups(graphs[:5], max_nodes=894)
    assert g == {("target", 41): [50.0], ("target", 16): [27.0, 27.0], ("44 nodes", 1): [0.2, 0.2]}


def test_summary_and_table():
    G = pass_times.Graph

    def req(system, tps, verify_ms, rest):
        graphs = [G(0.0, 20.0, 800, 40), G(30.0, verify_ms, 800, 17), G(60.0, verify_ms, 800, 17)]
        rec = pass_times.request_record(graphs, 0.0, 40.0 + 2 * verify_ms + rest)
        return {"system": system, "rep": 0, "gen_tps": tps, "draft_n": 32, "draft_n_accepted": 30,
                "text": "same", **rec}

    data = {"meta": {"date": "2026-12-04", "commit": "abc1234", "dirty": [], "cpu": "CPU", "cores": 2,
                     "workload": "code-rewrite-smollm2", "setting": "ngram-simple n3 m16", "reps": 2,
                     "n_predict": 128, "threads": 2, "ctx": 4096},
            "requests": [req("specrun", 200.0, 10.0, 5.0), req("specrun", 210.0, 10.0, 7.0),
                         req("llama-server exact", 190.0, 11.0, 5.0), req("llama-server exact", 200.0, 11.0, 5.0)]}
    s = pass_times.summarize(data["requests"])
    assert s["specrun"]["graph_ms"] == pytest.approx(40.0) and s["llama-server exact"]["graph_ms"] == pytest.approx(42.0)
    assert s["specrun"]["groups"][("target", 17)] == (2.0, 10.0)
    md = pass_times.markdown(data)
    assert "| tok/s (server timings) | 205.0 | 195.0 | 1.051 |" in md
    assert "| target | 17 | 2.00 × 10.000 | 2.00 × 11.000 | 0.909 |" in md
    assert "| drafted / accepted (all reps) | 64 / 60 | 64 / 60 | |" in md
    assert "Texts: the same for every request." in md


def test_also_servers_are_specrun_with_their_environment_and_flags():
    from types import SimpleNamespace

    assert pass_times.variant("specrun GOMP_SPINCOUNT=10000000 OMP_WAIT_POLICY=PASSIVE --no-fast-prefill") == (
        ["GOMP_SPINCOUNT=10000000", "OMP_WAIT_POLICY=PASSIVE"], ["--no-fast-prefill"])
    assert pass_times.variant("specrun --spec-draft-n-max 4") == ([], ["--spec-draft-n-max", "4"])
    args = SimpleNamespace(threads=2, ctx=4096, specrun="specrun", llama_server="/bin/llama-server")
    none = next(s for s in pass_times.SETTINGS if s.name == "none")
    cmd = pass_times.server("specrun X=1 --no-fast-prefill", "gemma-3-270m", "/m.gguf", none, args)
    assert cmd[:5] == ["env", "X=1", "specrun", "serve", "-m"] and cmd[-1] == "--no-fast-prefill"
    assert pass_times.server("specrun", "gemma-3-270m", "/m.gguf", none, args)[:2] == ["specrun", "serve"]


def test_an_unparsable_also_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        pass_times.main(["--also", "X='1", "--from-json", "/nonexistent.json"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(": error: --also \"X='1\": No closing quotation; quote it as a shell would, "
                        "e.g. --also \"GOMP_SPINCOUNT=1e7 --no-fast-prefill\"")   # after argparse's prog name

"""benchmarks/suffix_bench.py: the sessions' requests built from the prompt files, and the table's
session tok/s, ratios, acceptance and text checks from fake timings. Nothing here starts a server."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))       # suffix_bench imports peers as the script directory does
_spec = importlib.util.spec_from_file_location("suffix_bench", ROOT / "benchmarks" / "suffix_bench.py")
sb = importlib.util.module_from_spec(_spec)
sys.modules["suffix_bench"] = sb               # its dataclasses look their module up
_spec.loader.exec_module(sb)


def test_edits_and_versions():
    steps = [{"old": "a\n", "new": "A\n"}, {"old": "b\n", "new": "B\n", "also": [["c", "C"]]}, {"old": "", "new": ""}]
    assert sb.versions("a\nb\nc c\n", steps) == ["a\nb\nc c\n", "A\nb\nc c\n", "A\nB\nC C\n"]
    with pytest.raises(ValueError, match="not in the file"):
        sb.edited("x\n", {"old": "y\n", "new": "z\n"})


def test_workloads_requests():
    ws = {w.name: w for w in sb.load_workloads()}
    edit = ws["agent-edit"]
    assert "def _refill(self):" not in edit.users[3] and "def _refill(self):" in edit.users[4]   # step 4 made before 5
    end, body = sb.request_body(edit, "completion", 0, [], 64)
    assert end == "/completion" and body["n_predict"] == 64 and body["prompt"].endswith("Assistant: ```python\n")
    chat = ws["chat-quotes"]
    end, body = sb.request_body(chat, "chat", 2, ["one", "two"], 32)
    assert end == "/v1/chat/completions" and body["max_tokens"] == 32
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in body["messages"][2::2]] == ["one", "two"]
    _, body = sb.request_body(ws["tool-calls"], "chat", 3, ["x"] * 3, 32)   # stands alone: no earlier answers
    assert [m["role"] for m in body["messages"]] == ["system", "user"]


def rec(system, turn, n, ms, text, drafted=0, accepted=0, rep=0):
    return {"model": "m", "workload": "w", "system": system, "rep": rep, "turn": turn, "text": text,
            "predicted_n": n, "predicted_ms": ms, "gen_tps": n / ms * 1e3, "prompt_n": 10, "prompt_ms": 5.0,
            "draft_n": drafted, "draft_n_accepted": accepted, "others_busy": 0.0}


def run_of(rs: list[dict], n_requests: int) -> dict:
    """A run's JSON around these requests: one rep of workload "w" (n_requests requests)."""
    return {"meta": {"date": "d", "commit": "c", "dirty": [], "cpu": "CPU", "cores": 2, "llama_server_version": "",
                     "threads": 2, "ctx": 4096, "n_predict": 100, "reps": 1, "max_busy": 0.25, "missing": [],
                     "workloads": {"w": {"what": "a test", "requests": n_requests, "history": False}}},
            "servers": [], "requests": rs}


def test_summary_and_table():
    rs = [rec("none", 0, 100, 1000, "a"), rec("none", 1, 100, 1000, "b"),
          rec("suffix", 0, 100, 500, "a", 60, 50), rec("suffix", 1, 100, 300, "b", 40, 30),
          rec("ngram-mod", 0, 100, 800, "a"), rec("ngram-mod", 1, 100, 800, "bX"),
          rec("llama-server:ngram-mod", 0, 100, 900, "a"), rec("llama-server:ngram-mod", 1, 100, 700, "b")]
    rows = {r["system"]: r for r in sb.summarize(rs)}
    assert rows["none"]["gen_tps"] == pytest.approx(100.0)
    assert rows["suffix"]["gen_tps"] == pytest.approx(250.0)          # 200 tokens in 0.8 s
    assert rows["suffix"]["x_none"] == pytest.approx(2.5)
    assert rows["suffix"]["x_best"] == pytest.approx(2.0)             # llama-server: 200 in 1.6 s
    assert rows["suffix"]["acceptance"] == pytest.approx(0.8) and rows["suffix"]["equal_none"] is True
    assert rows["ngram-mod"]["equal_none"] is False
    assert rows["ngram-mod"]["diffs"] == [(0, 1, 'at character 1 of 1: "" vs "X"')]
    md = sb.markdown(run_of(rs, 2))
    assert "| m | w | suffix | 250.0 (250–250) | 2.50 | 2.00 | 0.80 (80 / 100) | yes |" in md
    assert "- m / w / ngram-mod: rep 1, request 2, at character 1 of 1" in md
    assert "≥ 1.3× the best llama-server on 1 of 1 workloads (on: m / w)" in md


def test_auto_choice_from_the_server_log(tmp_path):
    log = tmp_path / "auto.log"
    log.write_text("loading\nspec auto: suffix (adaptive): predicted 1.40x on the built-in prompt\nready\n")
    assert sb.auto_choice(log) == "suffix (adaptive)"
    log.write_text("no such line\n")
    assert sb.auto_choice(log) is None
    assert sb.auto_choice(tmp_path / "missing.log") is None


def test_exact_llama_server_is_its_own_best_and_column():
    """llama-server on exact mode's kernels writes specrun's text: its best is reported apart from
    the default llama-server's, in its own column and verdict, and its command carries the flags."""
    rs = [rec("none", 0, 100, 1000, "a"), rec("auto", 0, 100, 400, "a", 50, 40),
          rec("llama-server:ngram-mod", 0, 100, 500, "a2"), rec("llama-server-exact:ngram-mod", 0, 100, 800, "a")]
    rows = {r["system"]: r for r in sb.summarize(rs)}
    assert rows["auto"]["x_best"] == pytest.approx(1.25) and rows["auto"]["best"] == "llama-server:ngram-mod"
    assert rows["auto"]["x_exact"] == pytest.approx(2.0) and rows["auto"]["best_exact"] == "llama-server-exact:ngram-mod"
    md = sb.markdown(run_of(rs, 1))
    assert "| m | w | auto | 250.0 (250–250) | 2.50 | 1.25 | 2.00 | 0.80 (40 / 50) | yes |" in md
    assert ("Issue 50's goals for `auto`: ≥ 1.3× the best llama-server on 0 of 1 workloads; ≥ 1.3× the best "
            "llama-server exact on 1 of 1 workloads (on: m / w); below `none` on 0 of 1.") in md
    s = next(s for s in sb.SYSTEMS if s.name == "llama-server-exact:ngram-mod")
    args = type("A", (), {"threads": 2, "ctx": 4096, "llama_server": "LS", "suffix_args": ""})
    cmd = sb.command(s, "m", "P", 8080, args)
    assert cmd[:4] == ["env", "GGML_CPU_TILED_MM=0", "LS", "-m"] and cmd[5:8] == ["-nr", "-ctk", "q8_0"]

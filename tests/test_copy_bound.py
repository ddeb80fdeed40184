"""benchmarks/copy_bound.py: the oracle copy drafter's longest match and its passes, on hand-worked
texts (no model). Nothing here asserts a time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))      # the scripts import each other as the script directory
import copy_bound  # noqa: E402
import draft_length_replay as replay_mod  # noqa: E402

CURVE = {1: 0.010, 2: 0.012, 4: 0.015, 8: 0.022, 16: 0.036, 17: 0.040, 32: 0.068, 33: 0.072, 49: 0.11}


@pytest.mark.parametrize("text,pos,match_n,cap,want", [
    ([5, 6, 7, 5, 6, 8], 4, 1, 9, 1),        # after "5": j = 1 copies [6, 7] against [6, 8]
    ([5, 6, 7, 5, 6, 7], 4, 1, 9, 2),        # the same, and the copy holds
    ([5, 6, 7, 5, 6, 7], 4, 1, 1, 1),        # cut at cap
    ([5, 6, 7, 9, 6, 7], 4, 1, 9, 0),        # "9" never came before
    ([5, 6, 7, 9, 6, 7], 4, 0, 9, 2),        # n = 0: [6, 7] appears anywhere, at j = 1
    ([1, 2, 3, 4, 1, 2, 3, 4], 4, 0, 9, 4),  # n = 0: the whole remainder, and not past pos
    ([1, 2, 3, 4, 1, 2, 3, 4], 5, 2, 9, 0),  # n = 2: "4 1" never came before pos 5
    ([1, 2, 3, 4, 1, 2, 3, 4], 6, 2, 9, 2),  # n = 2: "1 2" came, then [3, 4]
    ([7, 7, 7, 7], 2, 1, 9, 1),              # j = 1 follows a 7 and copies text[1]; it may not read text[2] = pos
])
def test_longest_copy(text, pos, match_n, cap, want):
    assert copy_bound.longest_copy(text, pos, match_n, cap) == want


def test_bound_covers_a_copy_in_few_passes_and_beats_the_replayed_drafter():
    prompt = list(range(100, 140)) + [7, 8, 9]
    gen = list(range(100, 140)) * 2
    b = copy_bound.copy_bound(prompt, gen, CURVE, 3)
    assert sum(b["rows"]) == len(gen) - 1     # every token after the first, each once
    assert len(b["rows"]) < 10                # long copies: a few passes, not one per token
    fixed = replay_mod.replay(prompt, gen, CURVE, 16, False)["modeled_s"]
    assert b["modeled_s"] <= fixed
    assert copy_bound.copy_bound(prompt, gen, CURVE, 0)["modeled_s"] <= b["modeled_s"] + 1e-12


def test_bound_on_text_with_nothing_to_copy_is_one_token_a_pass():
    prompt, gen = [1, 2, 3], [10, 11, 12, 13, 14]
    b = copy_bound.copy_bound(prompt, gen, CURVE, 1)
    assert b["rows"] == [1, 1, 1, 1]
    assert b["modeled_s"] == pytest.approx(4 * CURVE[1])


def test_needed_is_llama_servers_best_over_specruns_none(tmp_path):
    def req(setting, system, tps):
        return {"workload": "w", "setting": setting, "system": system, "rep": 0, "gen_tps": tps, "prompt_tps": 1.0,
                "prompt_n": 10, "predicted_n": 128, "draft_n": 0, "draft_n_accepted": 0, "text": "x"}
    runs = [req("none", "specrun", 50.0), req("none", "llama-server", 48.0),
            req("ngram-simple n3 m16", "llama-server", 90.0), req("ngram-simple", "llama-server", 60.0)]
    p = tmp_path / "peers.json"
    p.write_text(json.dumps({"meta": {}, "requests": runs}))
    assert copy_bound.needed(p) == {"w": pytest.approx(90.0 / 50.0)}


def test_a_session_bound_copies_from_earlier_requests():
    """An answer that repeats an earlier request's answer is a copy in a session, not alone."""
    answer = list(range(200, 230))
    alone = copy_bound.copy_bound([1, 2, 3], answer, CURVE, 1)
    after = copy_bound.copy_bound([1, 2, 3], answer, CURVE, 1, earlier=[9, 1, 2, 3, *answer])
    assert alone["rows"] == [1] * (len(answer) - 1)
    assert sum(after["rows"]) == len(answer) - 1 and len(after["rows"]) < 5


def test_needed_sessions_reads_a_suffix_bench_run(tmp_path):
    def req(system, ms, turn=0):
        return {"model": "m", "workload": "w", "system": system, "rep": 0, "turn": turn, "text": "x",
                "predicted_n": 100, "predicted_ms": ms, "draft_n": 0, "draft_n_accepted": 0, "others_busy": 0.0}
    runs = [req("none", 1000.0), req("auto", 500.0), req("llama-server:ngram-mod", 800.0),
            req("llama-server:ngram-simple", 900.0)]
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"meta": {}, "requests": runs}))
    assert copy_bound.needed_sessions(p) == {"w:m": {"needed": pytest.approx(1.25), "auto": pytest.approx(2.0)}}

"""benchmarks/serve_load.py: the table's rows, paired ratios and goal counts from fake phases.
Nothing here starts a server."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))       # serve_load imports peers as the script directory does
_spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
sl = importlib.util.module_from_spec(_spec)
sys.modules["serve_load"] = sl
_spec.loader.exec_module(sl)


def phase(system, rep, tok_s, clients=2, setting="none", text="t"):
    reqs = [{"prompt": "a.txt", "latency_s": 1.0 + rep, "predicted_n": 8, "prompt_n": 4, "tokens_evaluated": 4,
             "text_id": text}]
    return {"model": "m", "setting": setting, "clients": clients, "system": system, "rep": rep, "tok_s": tok_s,
            "others_busy": 0.0, "requests": reqs}


def run_of(phases, reps):
    meta = {"date": "d", "commit": "c", "dirty": [], "cpu": "cpu", "cores": 2, "llama_server_version": "v",
            "threads": 2, "ctx_per_slot": 2048, "n_predict": 8, "requests": 1, "reps": reps, "clients": [1, 2],
            "settings": {"none": ""}, "mixes": {"m": ["benchmarks/prompts/a.txt"]}}
    return {"meta": meta, "servers": [], "phases": phases, "texts": {}}


def test_paired_ratios_follow_the_reps():
    # the machine slows down between reps: each rep's pair agrees (1.1x), the medians alone do not
    ps = [phase("specrun", 0, 110.0), phase("llama-server", 0, 100.0),
          phase("specrun", 1, 55.0), phase("llama-server", 1, 50.0),
          phase("specrun", 2, 33.0), phase("llama-server", 2, 30.0)]
    rows = {r["system"]: r for r in sl.summarize(run_of(ps, 3))}
    assert sl.paired(rows["specrun"], rows["llama-server"]) == pytest.approx([1.1, 1.1, 1.1])
    assert sl._pairs([1.1, 0.9, 1.0]) == "1.00 (0.90–1.10)"
    assert sl._pairs([1.25]) == "1.25" and sl._pairs([]) == "—"
    assert sl.paired(rows["specrun"], None) == []


def test_a_rep_one_system_lacks_is_left_out():
    ps = [phase("specrun", 0, 100.0), phase("llama-server", 0, 80.0), phase("specrun", 1, 90.0)]
    rows = {r["system"]: r for r in sl.summarize(run_of(ps, 2))}
    assert sl.paired(rows["specrun"], rows["llama-server"]) == pytest.approx([1.25])


def test_table_counts_goals_by_median_and_by_rep():
    ps = [phase("specrun", 0, 96.0), phase("llama-server", 0, 100.0),      # rep 0: 0.96
          phase("specrun", 1, 60.0), phase("llama-server", 1, 50.0),       # rep 1: 1.20
          phase("specrun", 2, 52.0), phase("llama-server", 2, 50.0)]       # rep 2: 1.04
    text = "\n".join(sl.table(run_of(ps, 3)))
    assert "| 1.04 (0.96–1.20) |" in text        # the paired ratios' median and range
    assert "| 1.20 |" in text                    # the medians' ratio: 60 over 50
    assert "by rep (median of the paired ratios) at 1 of 1" in text
    one = "\n".join(sl.table(run_of(ps[:2], 1)))
    assert "median of the paired ratios" not in one and "| 0.96 | 0.96 |" in one


@pytest.mark.slow
def test_the_repetitive_mix_stays_under_one_prompt_block(gemma_path, smollm_path):
    """Each repetitive prompt is under 512 tokens of both models: specrun's fast prompt context keeps
    whole 512-token blocks of earlier prompts, which cache_prompt false does not clear."""
    from specrun.kernels.llama import Model

    for path in (gemma_path, smollm_path):
        m = Model(path)
        try:
            sizes = {f: len(m.tokenize((sl.PROMPTS / f).read_text(encoding="utf-8"))) for f in sl.REPETITIVE}
        finally:
            m.close()
        assert all(n < 512 for n in sizes.values()), sizes

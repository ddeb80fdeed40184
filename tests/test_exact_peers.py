"""benchmarks/exact_peers.py (specrun, llama-server, llama-server with exact mode's flags): the
table's cells, its text column and the `auto` verdicts from fake timings; the command lines the
servers start with. Nothing here starts a server or asserts a measured time."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))       # exact_peers imports peers as the script directory does
_spec = importlib.util.spec_from_file_location("exact_peers", ROOT / "benchmarks" / "exact_peers.py")
ep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ep)


def req(system, setting, rep, gen, text, drafted=None, accepted=None):
    return {"model": "gemma-3-270m", "workload": "code-rewrite", "setting": setting, "system": system, "rep": rep,
            "gen_tps": gen, "prompt_tps": 300.0, "prompt_n": 98, "predicted_n": 128, "tokens_evaluated": 98,
            "text": text, "spec": None, "draft_n": drafted, "draft_n_accepted": accepted, "others_busy": 0.01}


def fake() -> dict:
    rs = []
    for rep in range(3):
        rs += [req("specrun", "none", rep, 60 + rep, "exact"), req("llama-server", "none", rep, 58, "drift"),
               req("llama-server exact", "none", rep, 61, "exact"),
               req("specrun", "ngram-simple n3 m16", rep, 66, "exact", 176, 90),
               req("llama-server", "ngram-simple n3 m16", rep, 116, "drift", 123, 109),
               req("llama-server exact", "ngram-simple n3 m16", rep, 61 * 1.1, "exact", 176, 90),
               req("specrun", "auto", rep, 80, "exact", 120, 80)]
    rs.append(req("llama-server", "ngram-simple", 0, 70, "drift2", 48, 41))   # a drifting text: not its none
    return {"meta": {"date": "2026-12-04", "commit": "abc1234", "dirty": [], "cpu": "CPU", "cores": 2, "reps": 3,
                     "n_predict": 128, "threads": 2, "ctx": 4096}, "requests": rs}


def test_cells_texts_and_verdicts():
    md = ep.markdown(fake())
    assert ("| code-rewrite | none | 61.0, 1.00× | 58.0, 1.00× | 61.0, 1.00× | specrun's `none` text: specrun, "
            "llama-server exact |") in md
    assert ("| code-rewrite | ngram-simple n3 m16 | 66.0, 1.08×, 528 / 270 | 116.0, 2.00×, 369 / 327 | 67.1, 1.10×, "
            "528 / 270 | specrun's `none` text: specrun, llama-server exact |") in md
    assert "| code-rewrite | auto | 80.0, 1.31×, 360 / 240 | — | — | specrun's `none` text: specrun |" in md
    assert ("| code-rewrite | ngram-simple | — | 70.0, 1.21×, 48 / 41 | — | specrun's `none` text: none of them; "
            "not its own `none`'s: llama-server |") in md
    # auto against each llama-server's best of none / ngram-simple / n3 m16
    assert "code-rewrite: auto 80.0 ÷ llama-server's best (ngram-simple n3 m16, 116.0) = 0.69" in md
    assert "code-rewrite: auto 80.0 ÷ llama-server exact's best (ngram-simple n3 m16, 67.1) = 1.19" in md


def test_commands():
    args = SimpleNamespace(threads=2, ctx=4096, specrun="specrun", llama_server="/bin/llama-server")
    none = next(s for s in ep.SETTINGS if s.name == "none")
    exact = ep.command("llama-server exact", "gemma-3-270m", "/m.gguf", none, args)
    assert exact[:4] == ["env", "GGML_CPU_TILED_MM=0", "/bin/llama-server", "-m"]
    assert exact[5:8] == ["-nr", "-ctk", "q8_0"] and exact[-2:] == list(none.args)
    plain = ep.command("llama-server", "gemma-3-270m", "/m.gguf", none, args)
    assert "-nr" not in plain and plain[0] == "/bin/llama-server"
    assert ep.command("specrun", "gemma-3-270m", "/m.gguf", none, args)[:4] == ["specrun", "serve", "-m", "gemma-3-270m"]
    # a synthetic model has no registry name: specrun gets its path, as llama-server does
    synth = ep.command("specrun", "synthetic:eagle3-realistic", "/t.gguf", none, args)
    assert synth[:4] == ["specrun", "serve", "-m", "/t.gguf"]

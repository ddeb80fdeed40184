"""benchmarks/draft_length.py's session harness: each session as a fresh server would serve it."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))       # draft_length imports peers and suffix_bench as the script does
_spec = importlib.util.spec_from_file_location("draft_length", ROOT / "benchmarks" / "draft_length.py")
dl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dl)


def test_a_session_ends_at_the_token_that_completes_the_stop():
    """A pass may emit tokens past "\\nUser:"; the server cuts them, and so does the harness."""
    text = {1: "Sure", 2: ".", 3: "\n", 4: "User", 5: ":", 6: " more"}
    e = SimpleNamespace(model=SimpleNamespace(detokenize=lambda toks: "".join(text[t] for t in toks)))
    assert dl._to_stop(e, [1, 2, 3, 4]) is None
    assert dl._to_stop(e, [1, 2, 3, 4, 5, 6]) == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_each_session_starts_with_fresh_drafters(smollm_path):
    """The same session twice on one engine makes the same passes: the second does not draft from the
    first's answers (suffix's global tree lives in the engine's cached drafter), and equals none."""
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams

    settings = dl.SETS["sessions"][0]
    w = "tool-calls:smollm2-135m-instruct"
    sessions = {**dl.SESSIONS, w: (dl.SESSIONS[w][0], replace(dl.SESSIONS[w][1], users=dl.SESSIONS[w][1].users[:3]))}
    with Engine(str(smollm_path), EngineParams(n_ctx=4096, n_threads=2)) as e:
        dl.SESSIONS, saved = sessions, dl.SESSIONS
        try:
            runs = []
            for spec in (settings["none"], settings["ngram n2 m16 + suffix"], settings["ngram n2 m16 + suffix"]):
                e.pass_cost = dl.FrozenCost({1: [32, 0.01], 2: [32, 0.012], 9: [32, 0.03], 17: [32, 0.05]})
                runs.append(dl.run_workload(e, w, spec, 24))
        finally:
            dl.SESSIONS = saved
    (plain, _), (first, st1), (second, st2) = runs
    assert first == second == plain and len(plain) > 30
    st1.pop("t_gen_s"), st2.pop("t_gen_s")
    assert st1 == st2 and st1["drafted"] > 0

"""benchmarks/draft_length_replay.py replays the engine's n-gram loop without the model: on the
model's own text it must make the engine's passes, row for row (fixed and adaptive length), or
its numbers say nothing about kernels/draftlen.py. Nothing here asserts a time."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))      # the scripts import each other as the script directory
import draft_length_replay as replay_mod  # noqa: E402
import same_text  # noqa: E402

PROMPT = (ROOT / "benchmarks" / "prompts" / "code_rewrite.txt").read_text()   # SmolLM2 copies most of its code
CURVE = {1: 0.010, 2: 0.012, 4: 0.015, 8: 0.022, 16: 0.036, 17: 0.040, 32: 0.068, 33: 0.072, 49: 0.11}


@pytest.fixture(scope="module")
def engine(smollm_path):
    with Engine(str(smollm_path), EngineParams(n_ctx=1024)) as e:
        yield e


@pytest.mark.parametrize("size_m,adaptive", [(16, False), (16, True), (48, True)])
def test_replay_makes_the_engines_passes(engine, size_m, adaptive):
    prompt = engine.tokenize(PROMPT)
    spec = replace(same_text.NGRAM, ngram_size_n=3, ngram_size_m=size_m, adaptive=adaptive)
    cost = {r: [32, s] for r, s in CURVE.items()}
    live = same_text.run_setting(engine, prompt, spec, 96, cost, None)
    assert live["drafted"] > 0                     # the text copies: the loop drafted
    got = replay_mod.replay(prompt.tolist(), live["tokens"], CURVE, size_m, adaptive)
    assert got["rows"] == live["rows"]
    assert got["modeled_s"] == pytest.approx(live["modeled_s"])


def test_foresight_is_no_slower_than_the_fixed_cut_on_a_copy():
    # a text that copies its prompt: each pass's foresight cut is at least as good as drafting to the cap
    prompt = list(range(100, 140)) + [7, 8, 9]
    gen = list(range(100, 140)) * 2
    fixed = replay_mod.replay(prompt, gen, CURVE, 16, False)["modeled_s"]
    assert replay_mod.foresight(prompt, gen, CURVE, 16) <= fixed

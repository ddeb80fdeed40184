"""benchmarks/same_text.py's forcing harness on SmolLM2: a forced text comes out token for token, drafts
are accepted exactly as far as they copy it, and forcing the model's own text changes nothing (the
same passes of the same rows). Nothing here asserts a time."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))      # the scripts import each other as the script directory
import same_text  # noqa: E402

PROMPT = "Repeat after me: the cat sat on the mat and the dog sat on the log.\n"


@pytest.fixture(scope="module")
def engine(smollm_path):
    with Engine(str(smollm_path), EngineParams(n_ctx=1024)) as e:
        yield e


COST = {r: [1, 0.01 + 0.001 * r] for r in (1, 2, 4, 8, 16, 17, 32, 33)}


@pytest.mark.parametrize("setting", ["none", "ngram-simple n3 m16", "adaptive n3 m16 (auto)"])
def test_forced_text_comes_out_and_drafts_count_only_what_copies(engine, setting):
    prompt = engine.tokenize(PROMPT)
    text = " the cat sat on the mat and the dog sat on the log. the cat sat on the rug and a dog sat on a log."
    toks = same_text.continuation(engine, PROMPT, text)
    r = same_text.run_setting(engine, prompt, same_text.SETTINGS[setting][0], len(toks), COST, toks)
    assert r["tokens"] == toks.tolist()
    assert r["passes"] == len(toks) - 1 - r["accepted"]       # the first token comes from the prompt pass
    if setting != "none":
        assert r["accepted"] > 0
    if setting == "ngram-simple n3 m16":
        assert r["drafted"] > r["accepted"]          # the copy breaks at "rug" and at "a"


def test_forcing_the_models_own_text_reproduces_its_passes(engine):
    prompt = engine.tokenize(PROMPT)
    spec = same_text.SETTINGS["ngram-simple n3 m16"][0]
    own = same_text.run_setting(engine, prompt, spec, 48, COST, None)
    forced = same_text.run_setting(engine, prompt, spec, len(own["tokens"]), COST,
                                   np.asarray(own["tokens"], dtype=np.int32))
    assert forced["tokens"] == own["tokens"] and forced["rows"] == own["rows"]


def test_the_engine_is_unpatched_after_forcing(engine):
    from specrun.kernels import engine as engine_mod
    from specrun.kernels.constrain import Constraints
    with same_text.forced(np.asarray([1, 2], dtype=np.int32), engine.model.n_vocab, engine.model.eos):
        assert engine_mod.Constraints is not Constraints
    assert engine_mod.Constraints is Constraints
